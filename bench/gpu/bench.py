"""The Python side of scripts/gpu-check: fixtures, the transformers + PEFT (+ bitsandbytes) reference,
and the arithmetic (MFU, tolerances) behind each row of its table.

usage: bench.py COMMAND [options]      (scripts/gpu-check runs these; each reports one JSON object,
                                        or table rows for the row-* commands, on a line marked as
                                        tests/support/oracle.py marks it: the rest is for people)

  model     --kind K[,K…] --out DIR[,DIR…] [--layers N] [--device D] [--adapter]
            a random-weight llama in HF format (bf16 safetensors) with a byte-level tokenizer
            (ids 0-255 are the bytes, 256 is <|endoftext|>: a text of n ASCII bytes is n tokens),
            optionally a PEFT adapter with random A and B (DIR/peft_adapter)
  data      --out FILE --n N --median M --max L [--min 64] [--sigma S] [--full-first K] [--seed]
            instruction documents {"instruction", "output"} whose token lengths (prompt + response +
            EOS) are lognormal (median M, sigma S) clipped to [min, max]; the prompt is 10-60% of
            each; the first K documents are exactly max long, so a run's first (warm-up) step
            is its largest and the peak memory is that of a full batch x max
  matmul    --device D [--n 8192] [--dtype bf16]     the measured dense matrix rate (TFLOP/s)
  ref-small --model DIR --ours-bf16 F --ours-fp32 F --device D [--examples F --expect OUT ...]
            our logits (lora-eval --dump-logits) vs transformers', bf16 and fp32; and what the
            training stages must see: tokens per step and transformers' first-step loss
  row-nf4   --model DIR --ours F --device D [--adapter DIR]
            our NF4 logits vs transformers + bitsandbytes (nf4, double quant, bf16 compute) [+ PEFT]
  row-generate --model DIR --prompts F --ours LOG --device D [--new N]
            lora-generate's greedy ids and tokens/s (its --prompts --ids --stats output) vs
            transformers' batched generate on the same prompts
  row-grpo  --one DIR --two DIR
            a GRPO run on 1 rank vs 2: the same completions, reward figures and adapter; step time
  moe-model --out DIR --device D [--tiny]
            a random qwen3_moe in HF format (fp32; 16 experts of 512, top 4, renormalised; --tiny: 4
            experts of 64, top 2) with the byte-level tokenizer
  row-moe   --model DIR --ours F --metrics F --device D
            our fp32 logits of the MoE model (lora-eval --dump-logits) vs transformers'; one MoE
            layer's forward and backward with lorarun's grouping (sort by expert, a product per
            expert) vs a dense loop over every expert, on the device; our training run's tokens/s
  row-train --expect F --metrics F --world W [--same-as F]
            a short lora-train run's metrics vs ref-small's expectations (and, for a
            dist.shard_base run, its losses vs the same run's with the base whole)
  ref-train --model DIR --examples F --batch B --steps S --device D [--qlora] [--ac] --out F
            the reference training loop: transformers + PEFT LoRA (r=16, alpha=32, all-linear),
            torch AdamW, clipping at 1.0, right-padded batches of the same examples in the same order
  row-speed --model DIR --examples F --batch B --warmup W --peak TFLOPS --ours METRICS
            --ref REF.json [--packed] [--ours-mem MiB] [--ref-mem MiB] [--aims ...]

Examples files are `lora-data preview N RECIPE --json` output: our own tokenization, so both sides
train on the same ids and labels.
"""
import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "support"))
import oracle  # noqa: E402  (first: before anything imports bitsandbytes)

# Shapes: Llama-3.2-1B and Llama-3.1-8B (random weights), a small llama for the correctness
# stages, and tiny ones for --cpu-smoke.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               max_position_embeddings=131072, rope_theta=500000.0,
               rope_scaling=dict(LLAMA3_ROPE, factor=8.0)),
    # correctness: GQA, llama3 rope scaling whose low frequencies matter at these lengths
    "small": dict(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                  max_position_embeddings=4096, rope_theta=500000.0,
                  rope_scaling=dict(LLAMA3_ROPE, factor=8.0, original_max_position_embeddings=256)),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                 max_position_embeddings=1024, rope_theta=10000.0,
                 rope_scaling=dict(LLAMA3_ROPE, factor=8.0, original_max_position_embeddings=64)),
    "tiny1b": dict(vocab_size=1024, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                   max_position_embeddings=1024, rope_theta=500000.0),
    "tiny8b": dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                   max_position_embeddings=1024, rope_theta=500000.0),
}
EOS = 256
LORA_R, LORA_ALPHA = 16, 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def emit(obj):
    oracle.report(**obj)


def torch_device(name):
    import torch
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {name} but torch sees no GPU")
    return torch.device(name)


def sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- fixtures

def bytes_to_unicode():
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_tokenizer(d):
    """A byte-level BPE without merges: token id = byte value, 256 = <|endoftext|>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    vocab["<|endoftext|>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(os.path.join(d, "tokenizer.json"))
    assert tok.encode("ab c").ids == [97, 98, 32, 99], tok.encode("ab c").ids
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                   "eos_token": "<|endoftext|>", "model_max_length": 131072}, f)


def llama_config(kind, layers=None):
    from transformers import LlamaConfig
    shape = dict(SHAPES[kind])
    if layers:
        shape["num_hidden_layers"] = layers
    return LlamaConfig(**shape, bos_token_id=EOS, eos_token_id=EOS, rms_norm_eps=1e-5,
                       attention_bias=False, mlp_bias=False)


def cmd_model(a):
    kinds, outs = a.kind.split(","), a.out.split(",")
    if len(kinds) != len(outs) or any(k not in SHAPES for k in kinds):
        raise SystemExit(f"--kind {a.kind} / --out {a.out}: give as many directories as kinds, kinds from {sorted(SHAPES)}")
    for i, (kind, out) in enumerate(zip(kinds, outs)):  # one process: Python's start-up is paid once
        make_model(kind, out, a.layers, a.device, a.adapter and i == 0, a.seed + i)


def make_model(kind, out, layers, device_name, adapter, seed):
    import torch
    from transformers import LlamaForCausalLM
    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    write_tokenizer(out)
    cfg = llama_config(kind, layers)
    torch.manual_seed(seed)
    device = torch_device(device_name)
    # Built where it will run, in bf16: an 8B model is 16 GB, made in a second on a GPU.
    with device:
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.generation_config.pad_token_id = EOS
    model.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    if adapter:
        from peft import LoraConfig, get_peft_model
        peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
        g = torch.Generator(device="cpu").manual_seed(seed + 1)
        with torch.no_grad():  # B != 0 so that the adapter changes the logits
            for n, p in peft.named_parameters():
                if "lora_" in n:
                    p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.device, p.dtype))
        peft.save_pretrained(os.path.join(out, "peft_adapter"))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    emit({"model": out, "kind": kind, "layers": cfg.num_hidden_layers, "params": params,
          "seconds": round(time.time() - t0, 1)})


def cmd_data(a):
    rng = random.Random(a.seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "  # about one space in six: word-like runs

    def text(n):
        return "".join(rng.choice(letters) for _ in range(n))

    lengths = []
    with open(a.out, "w") as f:
        for i in range(a.n):
            if i < a.full_first:
                total = a.max
            else:
                total = int(round(rng.lognormvariate(math.log(a.median), a.sigma)))
                total = max(a.min, min(a.max, total))
            prompt = max(1, int(total * (rng.uniform(0.1, 0.6) if i >= a.full_first else 0.5)))
            response = total - prompt - 1  # + EOS
            f.write(json.dumps({"instruction": text(prompt), "output": text(response)}) + "\n")
            lengths.append(total)
    rest = lengths[a.full_first:] or lengths
    emit({"data": a.out, "documents": a.n, "median": statistics.median(rest), "mean": round(statistics.mean(rest), 1),
          "max": max(lengths), "min": min(lengths)})


# ---------------------------------------------------------------- measured peak

def cmd_matmul(a):
    import torch
    device = torch_device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    n = a.n
    torch.manual_seed(0)
    x = torch.randn(n, n, device=device, dtype=dtype)  # random data: zeros run faster than real work
    y = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(x, y)
    sync(device)
    times = []
    for _ in range(a.repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(x, y)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    emit({"tflops": 2 * n ** 3 / t / 1e12, "n": n, "dtype": a.dtype, "device": str(device),
          "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"})


# ---------------------------------------------------------------- references

def load_reference(model_dir, device, dtype_name, nf4=False, adapter=None, trainable=False):
    import torch
    from transformers import AutoModelForCausalLM
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    kwargs = {"dtype": dtype}
    if nf4:
        from transformers import BitsAndBytesConfig
        kwargs["quantization_config"] = BitsAndBytesConfig(  # compute in the model's dtype
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)
    kwargs["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter, is_trainable=trainable)
    return model.eval()


def load_dump(path):
    from safetensors.torch import load_file
    d = load_file(path)
    for k in ("input_ids", "attention_mask", "logits"):
        if k not in d:
            raise SystemExit(f"{path} has no '{k}' (lora-eval --dump-logits writes input_ids, attention_mask, logits)")
    return d


def logits_of(model, dump, device):
    import torch
    with torch.no_grad():
        return model(input_ids=dump["input_ids"].to(device),
                     attention_mask=dump["attention_mask"].to(device)).logits.float().cpu()


def max_diff(a, b, mask):
    real = mask.bool()
    return (a[real] - b[real]).abs().max().item()


def fmt_g(x):
    return f"{x:.3g}" if x == x else "nan"


def cmd_ref_small(a):
    """The small model's references in one process (Python's start-up paid once): the logits rows,
    and what the training stages must see (tokens per step, transformers' first-step loss)."""
    rows = logits_rows(a)
    expect = {}
    if a.examples:
        exs = read_examples(a.examples)
        device = torch_device(a.device)
        model = load_reference(a.model, device, a.train_dtype)
        for w in (int(x) for x in a.worlds.split(",")):
            steps = step_slices(len(exs), w, a.batch, a.steps)
            expect[w] = {"tokens": [sum(trained_tokens(exs[i]) for i in s) for s in steps],
                         "step1_loss": first_step_loss(model, [exs[i] for i in steps[0]], device)}
        with open(a.expect, "w") as f:
            json.dump(expect, f)
    emit({"rows": rows, "expect": expect})


def first_step_loss(model, batch, device):
    """Sum of the batch's token losses over its trained tokens, in fp32 from the model's logits."""
    import torch
    ids, labels, mask = collate(batch, device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        lp = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                               labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
    return lp.item() / max(1, (labels[:, 1:] != -100).sum().item())


def logits_rows(a):
    """bf16: no worse than twice transformers' own bf16 error; fp32: within 1e-4 of transformers.

    Both bf16 results are compared with transformers in fp32 on the same bf16-rounded weights, so
    what is left is arithmetic: max|ours_bf16 - ref_fp32| <= 2 max|hf_bf16 - ref_fp32| says our
    kernels lose at most twice what transformers' lose on this very input (a scale-free bound:
    bf16 keeps 8 significant bits, so the absolute error depends on the logits' size). fp32:
    1e-4 x max(1, max|logit|), the CPU reference tests' tolerance; different GPU reduction orders
    give ~1e-6 here.
    """
    import torch
    device = torch_device(a.device)
    ours16, ours32 = load_dump(a.ours_bf16), load_dump(a.ours_fp32)
    mask = ours16["attention_mask"]
    if not torch.equal(ours16["input_ids"], ours32["input_ids"]):
        raise SystemExit("the bf16 and fp32 dumps hold different input_ids")
    ref32_model = load_reference(a.model, device, "fp32")
    ref32 = logits_of(ref32_model, ours16, device)
    del ref32_model
    ref16 = logits_of(load_reference(a.model, device, "bf16"), ours16, device)
    o16, o32 = ours16["logits"], ours32["logits"]
    if o16.shape != ref32.shape:
        raise SystemExit(f"our logits are {tuple(o16.shape)}, transformers' {tuple(ref32.shape)}")
    d_bf16 = max_diff(o16, ref16, mask)
    err_ours, err_hf = max_diff(o16, ref32, mask), max_diff(ref16, ref32, mask)
    d_fp32 = max_diff(o32, ref32, mask)
    biggest = ref32[mask.bool()].abs().max().item()
    tol16, tol32 = 2 * err_hf, 1e-4 * max(1.0, biggest)
    real = mask.bool()  # padding positions are nobody's business
    finite = bool(torch.isfinite(o16[real]).all() and torch.isfinite(o32[real]).all())
    ok16, ok32 = finite and err_ours <= tol16, finite and d_fp32 <= tol32
    B, T = ours16["input_ids"].shape
    return [
        {"stage": "logits bf16 vs transformers", "status": "PASS" if ok16 else "FAIL",
         "ours": f"max|diff| {fmt_g(d_bf16)}", "ref": f"bf16 err {fmt_g(err_hf)}",
         "ratio": "", "notes": f"vs fp32: ours {fmt_g(err_ours)} {'<=' if ok16 else '>'} 2x transformers' ({fmt_g(tol16)}); "
                               f"{B}x{T} padded batch, max|logit| {biggest:.2f}"},
        {"stage": "logits fp32 vs transformers", "status": "PASS" if ok32 else "FAIL",
         "ours": f"max|diff| {fmt_g(d_fp32)}", "ref": "", "ratio": "",
         "notes": f"{'<=' if ok32 else '>'} tolerance {fmt_g(tol32)} (1e-4 x max(1, max|logit|))"}]


def cmd_row_nf4(a):
    """NF4: our logits vs transformers + bitsandbytes (nf4, double quant, bf16 compute) on the same
    weights. Both are compared with bitsandbytes on the same NF4 weights computing in fp32, so
    what is left is arithmetic plus any difference in the quantisation itself:

        max|ours - nf4_fp32| <= 2 max|bnb_bf16 - nf4_fp32| + 0.05 max|bnb_bf16 - bf16|

    The first term is the bf16 logits rule (at most twice bitsandbytes' own bf16 error on this
    input); the second allows rounding ties in the quantisation, a twentieth of what NF4 itself
    changes in the logits. A wrong code table, block size, absmax or double quantisation moves
    the logits by the order of NF4's whole effect."""
    import torch
    device = torch_device(a.device)
    stage = "NF4 logits vs bitsandbytes" + (" + PEFT adapter" if a.adapter else "")
    if device.type == "cpu":  # (--cpu-smoke) bitsandbytes' CPU path depends on the CPU: tests/support/bnb_cpu.py
        import bnb_cpu
        reason = bnb_cpu.linear4bit_cpu_path()
        if reason:
            emit({"rows": [{"stage": stage, "status": "SKIP", "ours": "", "ref": "", "ratio": "", "notes": reason}]})
            return
    ours = load_dump(a.ours)
    mask = ours["attention_mask"]
    plain = logits_of(load_reference(a.model, device, "bf16", adapter=a.adapter), ours, device)
    bnb = logits_of(load_reference(a.model, device, "bf16", nf4=True, adapter=a.adapter), ours, device)
    bnb32 = logits_of(load_reference(a.model, device, "fp32", nf4=True, adapter=a.adapter), ours, device)
    effect = max_diff(bnb, plain, mask)
    d = max_diff(ours["logits"], bnb, mask)
    err_ours, err_bnb = max_diff(ours["logits"], bnb32, mask), max_diff(bnb, bnb32, mask)
    tol = 2 * err_bnb + 0.05 * effect
    ok = bool(torch.isfinite(ours["logits"][mask.bool()]).all()) and err_ours <= tol and effect > 0
    import bitsandbytes
    emit({"rows": [{"stage": stage, "status": "PASS" if ok else "FAIL", "ours": f"max|diff| {fmt_g(d)}",
                    "ref": f"bf16 err {fmt_g(err_bnb)}", "ratio": "",
                    "notes": ("identical logits; " if d == 0 else "")
                    + f"vs NF4 in fp32: ours {fmt_g(err_ours)} {'<=' if ok else '>'} 2x bitsandbytes' + 0.05 x NF4 "
                      f"effect {fmt_g(effect)} = {fmt_g(tol)}; bitsandbytes {bitsandbytes.__version__}, nf4 + double "
                      "quant, bf16 compute"}]})


def cmd_row_generate(a):
    """Greedy generation with the KV cache: our ids (lora-generate --prompts --ids --stats, its log)
    against transformers' batched, left-padded generate on the same prompts and device (fp32), and
    tokens/s. A row whose ids part where transformers' two best logits are within 1e-3 of the larger
    logit's size (a near tie, which another reduction order may break the other way: random weights
    make many) passes and is counted; any other difference fails."""
    import torch
    from transformers import AutoTokenizer
    device = torch_device(a.device)
    prompts = [json.loads(line) for line in open(a.prompts) if line.strip()]
    log = open(a.ours).read().splitlines()
    ours = [json.loads(line) for line in log if line.startswith("[")]
    m = re.search(r"(\d+) new tokens in ([\d.]+) s", "\n".join(log))
    if len(ours) != len(prompts) or not m:
        raise SystemExit(f"{a.ours}: expected {len(prompts)} id lists and lora-generate's --stats line")
    model = load_reference(a.model, device, "fp32")
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.convert_ids_to_tokens(0)
    enc = tok(prompts, return_tensors="pt", padding=True).to(device)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    with torch.no_grad():
        model.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=a.new, do_sample=False, pad_token_id=tok.pad_token_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    width, same, ties, bad, theirs_tokens = enc.input_ids.size(1), 0, 0, [], 0
    for i, row in enumerate(out[:, width:].tolist()):
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        theirs_tokens += len(row)
        if row == ours[i]:
            same += 1
            continue
        k = next((j for j, (x, y) in enumerate(zip(row, ours[i])) if x != y), min(len(row), len(ours[i])))
        ids = torch.cat([enc.input_ids[i][enc.attention_mask[i].bool()], torch.tensor(row[:k], device=device)])
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, -1].float()
        top = logits.topk(2).values
        ours_id = ours[i][k] if k < len(ours[i]) else None
        gap = (top[0] - logits[ours_id]).item() if ours_id is not None else float("inf")
        if gap <= 1e-3 * max(1.0, top[0].abs().item()):
            ties += 1
        else:
            bad.append(f"row {i} parts at token {k} (logit gap {fmt_g(gap)})")
    ours_tps = int(m.group(1)) / float(m.group(2))
    ref_tps = theirs_tokens / seconds
    emit({"rows": [{"stage": "generation (KV cache) vs transformers", "status": "FAIL" if bad else "PASS",
                    "ours": f"{ours_tps:.0f} tokens/s", "ref": f"{ref_tps:.0f} tokens/s",
                    "ratio": f"{ours_tps / ref_tps:.2f}x",
                    "notes": "; ".join(bad) if bad else f"{len(prompts)} prompts x {a.new} new tokens, greedy, fp32, "
                    f"one batch: {same} rows identical, {ties} parting at a near tie"}]})


def cmd_row_grpo(a):
    """GRPO on 1 rank (--one) and 2 (--two), the same global batch: every completion (its ids), its
    reward and advantage identical, each step's reward figures equal, the adapters within 1e-4 of the
    largest weight; the step time (the median of the steps after the first)."""
    from safetensors.torch import load_file

    def rows(d, name):
        return [json.loads(line) for line in open(os.path.join(d, name)) if line.strip()]

    one, two = rows(a.one, "completions.jsonl"), rows(a.two, "completions.jsonl")
    bad = []
    if len(one) != len(two) or not one:
        bad.append(f"{len(one)} vs {len(two)} completions logged")
    else:
        for i, (x, y) in enumerate(zip(one, two)):
            if (x["completion_ids"], x["reward"], x["advantage"]) != (y["completion_ids"], y["reward"], y["advantage"]):
                bad.append(f"completion {i} (step {x['step']}) differs")
                break
    steps = [[r for r in rows(d, "metrics.jsonl") if "reward" in r] for d in (a.one, a.two)]
    for s1, s2 in zip(*steps):
        if any(s1[k] != s2[k] for k in ("reward", "reward_std", "frac_reward_zero_std")):
            bad.append(f"step {s1['step']} reward figures differ")
            break
    w1 = load_file(os.path.join(a.one, "epoch_0/adapter_model.safetensors"))
    w2 = load_file(os.path.join(a.two, "epoch_0/adapter_model.safetensors"))
    largest = max(t.abs().max().item() for t in w1.values())
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1) / largest
    if diff > 1e-4:
        bad.append(f"adapters differ by {fmt_g(diff)} of the largest weight")
    times = [statistics.median([r["seconds"] for r in s[1:]] or [s[0]["seconds"]]) for s in steps]
    emit({"rows": [{"stage": "GRPO steps, 1 rank = 2 ranks", "status": "FAIL" if bad else "PASS",
                    "ours": f"{times[0]:.3f} s/step (1 rank)", "ref": f"{times[1]:.3f} s/step (2 ranks, gloo)",
                    "ratio": "",
                    "notes": "; ".join(bad) if bad else f"{len(one)} completions identical, adapters within "
                    f"{fmt_g(diff)} of the largest weight; 4 prompts x 4 completions of <= 16 tokens a step, beta 0.04"}]})


def read_examples(path):
    out = []
    for line in open(path):
        if not line.strip():
            continue
        e = json.loads(line)
        if "rejected" in e:
            raise SystemExit(f"{path}: document {e.get('position')} was rejected ({e['rejected']}): the data must be clean")
        out.append((e["ids"], e["labels"]))
    if not out:
        raise SystemExit(f"{path} holds no examples")
    return out


def collate(batch, device):
    """Right-padded like lora-train: ids 0, labels -100, mask 0 on padding."""
    import torch
    T = max(len(ids) for ids, _ in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    labels = torch.full((len(batch), T), -100, dtype=torch.long)
    mask = torch.zeros(len(batch), T, dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(y)] = torch.tensor(y)
        mask[i, :len(x)] = 1
    return ids.to(device), labels.to(device), mask.to(device)


def trained_tokens(example):
    """What lora-train counts: labels that are predicted (position 0 never is)."""
    return sum(1 for y in example[1][1:] if y != -100)


def step_slices(n, world, batch, steps):
    """Global example indices of each optimizer step: shuffle none, DistributedSampler padding
    (the order is padded to a multiple of the world size with its first examples), rank r reads
    examples r, r+world, r+2*world, … (DistributedSampler, shuffle=False), one micro-batch of
    `batch` per rank per step."""
    per_rank = math.ceil(n / world)
    order = list(range(n)) + list(range(n))[: per_rank * world - n]
    slices = [order[r::world] for r in range(world)]
    out = []
    for k in range(steps):
        step = [i for r in range(world) for i in slices[r][k * batch:(k + 1) * batch]]
        if not step:
            break
        out.append(step)
    return out


def read_metrics(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        raise SystemExit(f"{path} is empty: lora-train logged no step")
    return rows


def cmd_row_train(a):
    """A short lora-train run: every step trained exactly the tokens its documents hold, every
    loss is finite, the first step's loss (LoRA B = 0: the base model's) equals transformers'
    on the same documents within 1% (bf16 logits carry ~0.4% rounding; a masking, shift or
    normalisation error moves it by far more or changes the token count), and training lowers it.
    The expectations come from ref-small (--expect)."""
    want = json.load(open(a.expect))[str(a.world)]
    rows = read_metrics(a.metrics)
    problems = []
    got_tokens = [int(r["tokens"]) for r in rows]
    if got_tokens != want["tokens"][:len(got_tokens)]:
        problems.append(f"tokens per step {got_tokens[:4]}... != expected {want['tokens'][:4]}...")
    if len(rows) < min(a.steps, len(want["tokens"])):
        problems.append(f"{len(rows)} steps logged, {min(a.steps, len(want['tokens']))} expected")
    losses = [r["loss"] for r in rows]
    ref_loss = want["step1_loss"]
    if not all(math.isfinite(x) for x in losses):
        problems.append("non-finite loss")
    rel = abs(losses[0] - ref_loss) / ref_loss
    if rel > 0.01:
        problems.append(f"first-step loss {losses[0]:.4f} vs transformers {ref_loss:.4f}")
    if len(losses) >= 4 and not statistics.mean(losses[-2:]) < losses[0]:
        problems.append(f"loss did not go down ({losses[0]:.4f} -> {losses[-1]:.4f})")
    note = a.note
    if a.same_as:  # dist.shard_base gathers the same bytes the whole base holds: the same losses
        whole = read_metrics(a.same_as)
        worst = max((abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(rows, whole)), default=math.inf)
        if len(whole) != len(rows) or not worst <= 1e-6:
            problems.append(f"losses differ from the whole-base run's (max rel {worst:.1e}, {len(rows)} vs "
                            f"{len(whole)} steps)")
        step = statistics.median(r["seconds"] for r in rows[1:] or rows)
        step_whole = statistics.median(r["seconds"] for r in whole[1:] or whole)
        note = (f"losses = whole-base run's (max rel {worst:.1e}); base {max(r.get('base_mb', 0) for r in rows):.1f}"
                f" MiB on rank 0 (slices + blocks gathered); step time x{step / step_whole:.2f} of the whole-base run"
                + (f"; {note}" if note else ""))
    emit({"rows": [{"stage": a.stage, "status": "FAIL" if problems else "PASS",
                    "ours": f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", "ref": f"step-1 loss {ref_loss:.4f}",
                    "ratio": "", "notes": "; ".join(problems) if problems else
                    f"{len(rows)} steps, tokens per step exact, step-1 loss within {rel:.1e} (tol 1e-2)"
                    + (f"; {note}" if note else "")}]})


def cmd_ref_train(a):
    """The reference loop, as a transformers + PEFT user writes it (no packing: padding to the
    longest example of each batch, as DataCollatorForSeq2Seq does)."""
    import torch
    from peft import LoraConfig, get_peft_model
    device = torch_device(a.device)
    exs = read_examples(a.examples)
    t_load = time.time()
    model = load_reference(a.model, device, a.dtype, nf4=a.qlora)
    if a.ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules="all-linear",
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    load_s = time.time() - t_load
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    for k, s in enumerate(step_slices(len(exs), 1, a.batch, a.steps)):
        t0 = time.perf_counter()
        ids, labels, mask = collate([exs[i] for i in s], device)  # host-to-device copy counted, as ours
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()  # synchronises
        sync(device)
        steps.append({"step": k + 1, "loss": loss, "tokens": sum(trained_tokens(exs[i]) for i in s),
                      "seconds": time.perf_counter() - t0})
    res = {"steps": steps, "load_s": round(load_s, 1), "qlora": a.qlora, "ac": a.ac,
           "trainable": sum(p.numel() for p in params)}
    if device.type == "cuda":
        res["max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
        res["max_reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2 ** 20
    else:
        import resource
        res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(a.out, "w") as f:
        json.dump(res, f)
    emit({k: v for k, v in res.items() if k != "steps"})


# ---------------------------------------------------------------- speed and MFU

def model_numbers(model_dir):
    """Parameter counts from config.json: frozen base parameters and LoRA's (r=16, all-linear)."""
    c = json.load(open(os.path.join(model_dir, "config.json")))
    h, L, V, ffn = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or h // heads
    q, kvd = heads * hd, kv * hd
    shapes = [(h, q), (h, kvd), (h, kvd), (q, h), (h, ffn), (h, ffn), (ffn, h)]  # (in, out)
    per_layer = sum(i * o for i, o in shapes) + 2 * h
    frozen = V * h * (1 if c.get("tie_word_embeddings") else 2) + L * per_layer + h
    lora = L * sum(LORA_R * (i + o) for i, o in shapes)
    return c, frozen, lora


def llama_flops(c, seq_len):
    """NeMo AutoModel's llama3_flops(config, gbs=1, seq_len): full-training FLOPs of one sequence
    (forward + backward to inputs + backward to weights, causal attention counted half)."""
    h, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    ffn = c["intermediate_size"]
    return seq_len * L * h * h * (12 + 12 * kv / heads + 18 * ffn / h + 12 * seq_len / h * 0.5 + 6 * V / (L * h))


def speed(steps, warmup, flops_of_step):
    """tokens/s and achieved TFLOP/s over the steps after `warmup`."""
    timed = steps[warmup:] or steps
    secs = sum(s["seconds"] for s in timed)
    tokens = sum(s["tokens"] for s in timed)
    flops = sum(flops_of_step(k + (len(steps) - len(timed)), s) for k, s in enumerate(timed))
    return tokens / secs, flops / secs / 1e12, len(timed)


def fmt_rate(x):
    return f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.0f}"


def fmt_mib(x):
    return "n/a" if x is None or x < 0 else f"{x / 1024:.2f} GiB"


def cmd_row_speed(a):
    """One speed row: ours vs the reference on the same examples, batch, length and rank.

    MFU counts useful work only, as NeMo AutoModel does for LoRA: llama3_flops per example at
    its real length (padding counts nothing, so padding cannot raise MFU) x (2 + lora/frozen)/3,
    over the measured bf16 matrix rate. Unpacked runs see exactly the examples of each step
    (shuffle none, batch b: examples [k b, (k+1) b)); a packed run's steps are rows of several
    examples, so its FLOPs are its trained tokens x the data's FLOPs per trained token.
    """
    c, frozen, lora = model_numbers(a.model)
    mult = (2 + lora / frozen) / 3
    exs = read_examples(a.examples)
    flops_ex = [llama_flops(c, len(ids)) * mult for ids, _ in exs]
    tok_ex = [trained_tokens(e) for e in exs]
    rest = slice(a.batch, None) if len(exs) > a.batch else slice(None)  # the full-length warm-up examples aside
    per_token = sum(flops_ex[rest]) / max(1, sum(tok_ex[rest]))
    slices = step_slices(len(exs), 1, a.batch, 10 ** 6)

    def unpacked(k, s):
        return sum(flops_ex[i] for i in slices[k])

    def packed(k, s):
        return s["tokens"] * per_token

    ref = json.load(open(a.ref)) if a.ref else None
    ours = [{"tokens": r["tokens"], "seconds": r["seconds"]} for r in read_metrics(a.ours)] if a.ours else None
    notes, status = [], "ok"
    if a.fail or a.skip:
        status = "FAIL" if a.fail else "SKIP"
        notes.append(a.fail or a.skip)
    if ours and not a.packed:
        want = [sum(tok_ex[i] for i in s) for s in slices[:len(ours)]]
        if [int(s["tokens"]) for s in ours] != want:
            notes.append("ours trained other tokens than the reference's steps!")
    o = speed(ours, a.warmup, packed if a.packed else unpacked) if ours else None
    r = speed(ref["steps"], a.warmup, unpacked) if ref else None
    ratio = o[0] / r[0] if o and r else None
    aims = []
    if o:
        mfu = o[1] / a.peak
        if r and a.aim_ratio:
            aims.append((f">={a.aim_ratio}x ref", ratio >= a.aim_ratio))
        if a.aim_mfu:
            aims.append((f"MFU>={a.aim_mfu:.0%}", mfu >= a.aim_mfu))
        if a.aim_mem_gib and a.ours_mem is not None and a.ours_mem >= 0:
            aims.append((f"peak<{a.aim_mem_gib:g} GiB", a.ours_mem / 1024 < a.aim_mem_gib))
        if a.aim_vs_bf16:
            bf16 = read_metrics(a.aim_vs_bf16)
            ob = speed([{"tokens": x["tokens"], "seconds": x["seconds"]} for x in bf16], a.warmup, packed)[0]
            aims.append((f"{o[0] / ob:.2f}x bf16 LoRA >=0.9", o[0] / ob >= 0.9))
        if aims and status == "ok":
            status = "PASS" if all(ok for _, ok in aims) else "BELOW AIM"
    ours_txt = f"{fmt_rate(o[0])} tok/s, MFU {o[1] / a.peak:.1%}, {fmt_mib(a.ours_mem)}" if o else "-"
    ref_txt = f"{fmt_rate(r[0])} tok/s, MFU {r[1] / a.peak:.1%}, {fmt_mib(a.ref_mem)}" if r else "-"
    if ref and "max_allocated_mib" in ref:
        notes.append(f"ref torch max allocated {fmt_mib(ref['max_allocated_mib'])}")
    notes += [f"aim {n}: {'met' if ok else 'MISSED'}" for n, ok in aims]
    if o or r:
        notes.append(f"{o[2] if o else r[2]} timed steps; (2+lora/frozen)/3 = {mult:.4f}; peak = {a.mem_kind}")
    if a.note:
        notes.append(a.note)
    emit({"rows": [{"stage": a.stage, "status": status, "ours": ours_txt, "ref": ref_txt,
                    "ratio": f"{ratio:.2f}x" if ratio else "", "notes": "; ".join(notes)}],
          "ours_tokens_per_s": o[0] if o else None, "ref_tokens_per_s": r[0] if r else None,
          "ours_mfu": o[1] / a.peak if o else None, "ref_mfu": r[1] / a.peak if r else None,
          "ours_mem_mib": a.ours_mem, "ref_mem_mib": a.ref_mem})


def cmd_moe_model(a):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    os.makedirs(a.out, exist_ok=True)
    write_tokenizer(a.out)
    size = (dict(hidden_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32) if a.tiny else
            dict(hidden_size=512, moe_intermediate_size=512, num_experts=16, num_experts_per_tok=4,
                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64))
    cfg = Qwen3MoeConfig(vocab_size=512, intermediate_size=1536, norm_topk_prob=True, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=EOS, eos_token_id=EOS, **size)
    torch.manual_seed(a.seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers far from uniform: no near ties in a token's top k
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    model.generation_config.pad_token_id = EOS
    model.save_pretrained(a.out)
    emit({"model": a.out, "params": sum(p.numel() for p in model.parameters())})


def moe_layer_seconds(device, grouped, n, hidden, inter, experts, k, reps=10):
    """Median seconds of one MoE layer's forward and backward (fp32; gradients to the input)."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05).to(device)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.05).to(device)
    router = torch.randn(experts, hidden, generator=g).to(device)
    x0 = torch.randn(n, hidden, generator=g).to(device)
    times = []
    for _ in range(reps + 2):
        x = x0.clone().requires_grad_(True)
        sync(device)
        t0 = time.perf_counter()
        probs = torch.softmax(x @ router.t(), -1, dtype=torch.float)
        w, chosen = probs.topk(k, -1)
        w = w / w.sum(-1, keepdim=True)
        if grouped:  # lib/model/moe.cpp's order of work
            flat = chosen.flatten()
            order = torch.argsort(flat, stable=True)
            token = order // k
            counts = torch.bincount(flat, minlength=experts).tolist()
            routed = x.index_select(0, token)
            outs, start = [], 0
            for e, c in enumerate(counts):
                if c:
                    a, b = (routed[start:start + c] @ gate_up[e].t()).chunk(2, -1)
                    outs.append((torch.nn.functional.silu(a) * b) @ down[e].t())
                    start += c
            out = torch.zeros_like(x).index_add(0, token, torch.cat(outs) * w.flatten()[order].unsqueeze(1))
        else:
            dense = torch.zeros(n, experts, device=device).scatter(1, chosen, w)
            out = torch.zeros_like(x)
            for e in range(experts):
                a, b = (x @ gate_up[e].t()).chunk(2, -1)
                out = out + ((torch.nn.functional.silu(a) * b) @ down[e].t()) * dense[:, e:e + 1]
        out.sum().backward()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def cmd_row_moe(a):
    device = torch_device(a.device)
    rows = []
    ours = load_dump(a.ours)
    ref = logits_of(load_reference(a.model, device, "fp32"), ours, device)
    diff = max_diff(ours["logits"], ref, ours["attention_mask"]) / ref.abs().max().item()
    rows.append({"stage": "MoE logits fp32 vs transformers", "status": "PASS" if diff <= 1e-4 else "FAIL",
                 "ours": "", "ref": "", "ratio": "",
                 "notes": f"qwen3_moe; max |diff| / max |logit| {fmt_g(diff)} on {int(ours['attention_mask'].sum())} tokens"})
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    shape = dict(n=4096, hidden=cfg["hidden_size"], inter=cfg["moe_intermediate_size"] * 2,
                 experts=cfg.get("num_experts") or cfg["num_local_experts"], k=cfg["num_experts_per_tok"])
    grouped, dense = (moe_layer_seconds(device, g, **shape) for g in (True, False))
    rows.append({"stage": "MoE layer: grouped vs dense loop", "status": "PASS",  # a measurement: the ratio says
                 "ours": f"{grouped * 1e3:.2f} ms", "ref": f"{dense * 1e3:.2f} ms", "ratio": f"{dense / grouped:.2f}x",
                 "notes": "one layer's forward and backward, {n} tokens, {experts} experts of {inter}, top {k}, fp32; "
                          "ref: every expert on every token".format(**shape)})
    metrics = read_metrics(a.metrics)
    rate = statistics.median(r["tokens_per_s"] for r in metrics[1:] or metrics)
    losses = [r["loss"] for r in metrics]
    ok = all(math.isfinite(x) for x in losses) and "expert_load/min" in metrics[-1]
    rows.append({"stage": "MoE training (lora-train)", "status": "PASS" if ok else "FAIL", "ours": f"{rate:.0f} tok/s",
                 "ref": "", "ratio": "",
                 "notes": f"{len(metrics)} steps, LoRA all-linear (attention, routers, experts); loss {losses[0]:.3f} -> "
                          f"{losses[-1]:.3f}; expert_load {metrics[-1].get('expert_load/min', float('nan')):.2f}-"
                          f"{metrics[-1].get('expert_load/max', float('nan')):.2f}"})
    emit({"rows": rows})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("--kind", required=True, help="one of %s, or several, comma-separated" % ", ".join(sorted(SHAPES)))
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int)
    m.add_argument("--device", default="cpu")
    m.add_argument("--adapter", action="store_true")
    m.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("data")
    d.add_argument("--out", required=True)
    d.add_argument("--n", type=int, required=True)
    d.add_argument("--median", type=float, default=512)
    d.add_argument("--sigma", type=float, default=0.8)
    d.add_argument("--min", type=int, default=64)
    d.add_argument("--max", type=int, default=2048)
    d.add_argument("--full-first", type=int, default=0)
    d.add_argument("--seed", type=int, default=0)
    mm = sub.add_parser("matmul")
    mm.add_argument("--device", default="cuda")
    mm.add_argument("--n", type=int, default=8192)
    mm.add_argument("--dtype", default="bf16")
    mm.add_argument("--repeat", type=int, default=10)
    rl = sub.add_parser("ref-small")
    rl.add_argument("--model", required=True)
    rl.add_argument("--ours-bf16", required=True)
    rl.add_argument("--ours-fp32", required=True)
    rl.add_argument("--device", default="cuda")
    rl.add_argument("--examples", help="lora-data preview --json of the training stages' data")
    rl.add_argument("--expect", help="where to write the training stages' expectations")
    rl.add_argument("--batch", type=int, default=4)
    rl.add_argument("--steps", type=int, default=8)
    rl.add_argument("--worlds", default="1,2")
    rl.add_argument("--train-dtype", default="bf16", choices=["bf16", "fp32"])
    rn = sub.add_parser("row-nf4")
    rn.add_argument("--model", required=True)
    rn.add_argument("--ours", required=True)
    rn.add_argument("--adapter")
    rn.add_argument("--device", default="cuda")
    rg = sub.add_parser("row-generate")
    rg.add_argument("--model", required=True)
    rg.add_argument("--prompts", required=True, help="one JSON string a line")
    rg.add_argument("--ours", required=True, help="lora-generate --prompts --ids --stats output")
    rg.add_argument("--new", type=int, default=32)
    rg.add_argument("--device", default="cuda")
    rq = sub.add_parser("row-grpo")
    rq.add_argument("--one", required=True, help="output_dir of the 1-rank GRPO run")
    rq.add_argument("--two", required=True, help="output_dir of the 2-rank GRPO run")
    rt = sub.add_parser("row-train")
    rt.add_argument("--stage", required=True)
    rt.add_argument("--expect", required=True, help="ref-small's expectations")
    rt.add_argument("--metrics", required=True)
    rt.add_argument("--world", type=int, default=1)
    rt.add_argument("--steps", type=int, default=8)
    rt.add_argument("--note", default="")
    rt.add_argument("--same-as", help="metrics.jsonl of the same run without dist.shard_base: equal losses")
    tr = sub.add_parser("ref-train")
    tr.add_argument("--model", required=True)
    tr.add_argument("--examples", required=True)
    tr.add_argument("--batch", type=int, required=True)
    tr.add_argument("--steps", type=int, required=True)
    tr.add_argument("--device", default="cuda")
    tr.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    tr.add_argument("--qlora", action="store_true")
    tr.add_argument("--ac", action="store_true", help="activation (gradient) checkpointing")
    tr.add_argument("--out", required=True)
    rs = sub.add_parser("row-speed")
    rs.add_argument("--stage", required=True)
    rs.add_argument("--model", required=True)
    rs.add_argument("--examples", required=True)
    rs.add_argument("--batch", type=int, required=True)
    rs.add_argument("--warmup", type=int, default=2)
    rs.add_argument("--peak", type=float, required=True, help="measured matrix rate, TFLOP/s")
    rs.add_argument("--ours")
    rs.add_argument("--ref")
    rs.add_argument("--packed", action="store_true")
    rs.add_argument("--ours-mem", type=float)
    rs.add_argument("--ref-mem", type=float)
    rs.add_argument("--mem-kind", default="GPU memory.used")
    rs.add_argument("--fail", help="our run failed: this reason (the row still shows the reference)")
    rs.add_argument("--skip", help="our run was not started: this reason (the row still shows the reference)")
    rs.add_argument("--note", help="appended to the notes")
    rs.add_argument("--aim-ratio", type=float)
    rs.add_argument("--aim-mfu", type=float)
    rs.add_argument("--aim-mem-gib", type=float)
    rs.add_argument("--aim-vs-bf16", help="ours' bf16 LoRA metrics.jsonl: QLoRA within 10%% of its speed")
    mo = sub.add_parser("moe-model")
    mo.add_argument("--out", required=True)
    mo.add_argument("--device", default="cpu")
    mo.add_argument("--tiny", action="store_true")
    mo.add_argument("--seed", type=int, default=0)
    rm = sub.add_parser("row-moe")
    rm.add_argument("--model", required=True)
    rm.add_argument("--ours", required=True, help="lora-eval --dump-logits of the MoE model, fp32")
    rm.add_argument("--metrics", required=True, help="metrics.jsonl of a short lora-train run on it")
    rm.add_argument("--device", default="cuda")
    a = p.parse_args()
    {"moe-model": cmd_moe_model, "row-moe": cmd_row_moe, "model": cmd_model, "data": cmd_data, "matmul": cmd_matmul, "ref-small": cmd_ref_small, "row-generate": cmd_row_generate,
     "row-nf4": cmd_row_nf4, "row-grpo": cmd_row_grpo, "row-train": cmd_row_train, "ref-train": cmd_ref_train,
     "row-speed": cmd_row_speed}[a.cmd](a)


if __name__ == "__main__":
    main()
