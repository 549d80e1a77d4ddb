"""The training reference: transformers + PEFT + torch AdamW doing what lora-train does, step by step.

usage: train_reference.py init MODEL_DIR OUT_DIR R ALPHA SEED [VARIANT]
           a PEFT adapter (all-linear) whose lora_A and lora_B are both random, so that every
           LoRA weight gets a gradient from the first step on; VARIANT dora: a DoRA adapter, its
           magnitudes 1 +- 0.1 times the base's row norms; save=M1+M2: modules_to_save [M1, M2];
           tokens=I1+I2: trainable_token_indices [I1, I2] (their start: the base's rows, as PEFT's)
       train_reference.py check [--loraplus=RATIO] [--init=NAME,R,ALPHA,SEED] MODEL_DIR INIT_DIR DATA.jsonl
                                OURS_DIR WORLD BATCH ACCUM EPOCHS LR WARMUP [LOSS_TOL WEIGHT_TOL]
           replays lora-train's run (instruction documents {"instruction", "output"}, template
           "Q: {instruction}\\nA: ", shuffle none, cosine schedule, max_grad_norm 1.0) and compares
           the loss of every step (OURS_DIR/metrics.jsonl) and the final adapter
           (OURS_DIR/epoch_<EPOCHS-1>); reports match (tests/support/oracle.py) and the measured
           differences, and exits 1 when they differ beyond the tolerances (relative; default 1e-4
           for the losses, 1e-3 for the weights). --router-aux=COEF: a mixture of experts' router loss
           (transformers' aux_loss of each micro-batch, output_router_logits) times COEF joins each
           micro-batch's loss weighted by its trained tokens, and each step's router loss (their
           token-weighted mean) must equal metrics.jsonl's router_loss. --loraplus: the optimizer is PEFT's
           create_loraplus_optimizer(AdamW, loraplus_lr_ratio=RATIO). --init: no INIT_DIR is read;
           PEFT starts a fresh all-linear adapter with init_lora_weights=NAME (gaussian, pissa,
           pissa_niter_N, olora), its random draws from lorarun's stream (our_stream); for pissa and
           olora INIT_DIR receives the start and the trained adapter is converted for the original
           base as PEFT's save_pretrained(path_initial_model_for_weight_conversion=INIT_DIR) does, which
           OURS_DIR's must equal, and, loaded by PEFT on the original base, it must give the trained
           (residual) model's logits (original_base_logits_diff, relative, <= 1e-4).
       train_reference.py merged MODEL_DIR ADAPTER_DIR MERGED_DIR DATA.jsonl
           MERGED_DIR (lora-merge's output) loaded by transformers against PEFT's model of ADAPTER_DIR on
           MODEL_DIR, on the file's first 4 documents: reports logits_diff (relative to the largest logit)
       train_reference.py eval MODEL_DIR ADAPTER_DIR DATA.jsonl FRACTION
           lora-train's evaluation with eval.fraction FRACTION (> 0; else the whole file, as eval.path):
           the held-out lines (held_out below), rendered as the training documents, through the
           adapter in eval mode; reports eval_loss (summed over every trained token of every
           held-out document, divided by their count), eval_tokens, eval_documents, train_documents
MODEL_DIR may be a .gguf file: transformers loads it (and its tokenizer) with its own GGUF loading.

Batches follow lora-train's rules: world W ranks, shuffle none, DistributedSampler padding (the
order is padded to a multiple of W with its first documents), rank r reads documents r, r+W,
r+2W, … (DistributedSampler with shuffle=False); each optimizer step takes ACCUM micro-batches of
BATCH from every rank. The loss is summed over
trained tokens and divided by the step's token count over all ranks and micro-batches.
"""
import contextlib
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import oracle  # noqa: E402  (first: before anything imports bitsandbytes)
import torch  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup  # noqa: E402

TEMPLATE = "Q: {instruction}\nA: "
# Called with the PEFT model once --init has started it (nf4_check.py re-quantises OLoRA's residual).
after_init = None


def load_base(model_dir):
    """transformers' model of a HF directory or a .gguf file, in float32."""
    if model_dir.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(model_dir)),
                                                    gguf_file=os.path.basename(model_dir), dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def load_tokenizer(model_dir):
    """(the tokenizers.Tokenizer, eos id or None) of a HF directory or a .gguf file."""
    if model_dir.endswith(".gguf"):
        from transformers import AutoConfig, AutoTokenizer
        where, name = os.path.dirname(os.path.abspath(model_dir)), os.path.basename(model_dir)
        tok = AutoTokenizer.from_pretrained(where, gguf_file=name).backend_tokenizer
        return tok, AutoConfig.from_pretrained(where, gguf_file=name).eos_token_id
    return Tokenizer.from_file(model_dir + "/tokenizer.json"), json.load(open(model_dir + "/config.json")).get(
        "eos_token_id")


def init(model_dir, out_dir, r, alpha, seed, variant=""):
    torch.manual_seed(seed)
    base = load_base(model_dir)
    kind, _, names = variant.partition("=")
    tables = ({"modules_to_save": names.split("+")} if kind == "save"
              else {"trainable_token_indices": [int(i) for i in names.split("+")]} if kind == "tokens" else {})
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0,
                                            use_dora=variant == "dora", **tables))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)


@contextlib.contextmanager
def our_stream(seed):
    """lorarun's draws while PEFT initialises: one CPU generator seeded with train.seed serves the init's
    own draws (gaussian's normal_, svd_lowrank's test matrices) layer by layer, as lib/model/lora_init.cpp
    draws them; PEFT's other draws (the nn.Linear it builds and then overwrites) use the global stream."""
    import peft.tuners.lora.layer as layer
    gen = torch.Generator().manual_seed(seed)
    normal, lowrank = torch.nn.init.normal_, layer.svd_lowrank

    def ours_normal(t, mean=0.0, std=1.0, generator=None):
        return normal(t, mean, std, generator=gen)

    def ours_lowrank(a, q, niter):
        saved = torch.get_rng_state()
        torch.set_rng_state(gen.get_state())
        try:
            return lowrank(a, q, niter=niter)
        finally:
            gen.set_state(torch.get_rng_state())
            torch.set_rng_state(saved)

    torch.nn.init.normal_, layer.svd_lowrank = ours_normal, ours_lowrank
    try:
        yield
    finally:
        torch.nn.init.normal_, layer.svd_lowrank = normal, lowrank


def held_out(line, fraction):
    """lorarun's eval.fraction split (lib/data/source.cpp): FNV-1a 64 of the line's bytes, its top
    53 bits as a number in [0, 1), below the fraction."""
    h = 0xcbf29ce484222325
    for b in line.encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return (h >> 11) * 2.0 ** -53 < fraction


def lines_of(data):
    """The file's documents as lora-train reads them: lines without their newline, blank ones dropped."""
    return [line[:-1] if line.endswith("\n") else line for line in open(data) if line.strip()]


def examples(model_dir, data):
    return examples_of(model_dir, open(data))


def examples_of(model_dir, lines):
    tok, eos = load_tokenizer(model_dir)
    out = []
    for line in lines:
        if not line.strip():
            continue
        doc = json.loads(line)
        prompt = tok.encode(TEMPLATE.replace("{instruction}", doc["instruction"])).ids
        response = tok.encode(doc["output"], add_special_tokens=False).ids + ([eos] if eos is not None else [])
        out.append((prompt + response, [-100] * len(prompt) + response))
    return out


def collate(batch):
    T = max(len(ids) for ids, _ in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    labels = torch.full((len(batch), T), -100, dtype=torch.long)
    mask = torch.zeros(len(batch), T, dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return ids, labels, mask


def check(model_dir, init_dir, data, ours, world, batch, accum, epochs, lr, warmup, loss_tol=1e-4, weight_tol=1e-3,
          loraplus=None, init_spec=None, router_aux=None):
    exs = examples(model_dir, data)
    n = len(exs)
    per_rank = math.ceil(n / world)
    order = list(range(n))
    order += order[: per_rank * world - n]
    slices = [order[r::world] for r in range(world)]
    steps_per_epoch = math.ceil(per_rank / (batch * accum))

    base = load_base(model_dir)
    converted = False
    if init_spec is None:
        model = PeftModel.from_pretrained(base, init_dir, is_trainable=True)
    else:
        name, r, alpha, seed = init_spec.split(",")
        with our_stream(int(seed)):
            model = get_peft_model(base, LoraConfig(r=int(r), lora_alpha=float(alpha), target_modules="all-linear",
                                                    lora_dropout=0.0, init_lora_weights=name))
        converted = name != "gaussian"
        if after_init is not None:
            after_init(model)
        if converted:  # PEFT's recipe: the start saved as a plain LoRA adapter, for the conversion at the end
            model.peft_config["default"].init_lora_weights = True
            model.save_pretrained(init_dir)
    at_start = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if loraplus is None:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    else:
        from peft.optimizers import create_loraplus_optimizer
        opt = create_loraplus_optimizer(model, torch.optim.AdamW, lr=lr, loraplus_lr_ratio=loraplus, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, warmup, steps_per_epoch * epochs)
    losses, router_losses = [], []
    for _ in range(epochs):
        for s in range(steps_per_epoch):
            total, tokens, router = 0.0, 0, 0.0
            for mine in slices:
                for a in range(accum):
                    start = (s * accum + a) * batch
                    chunk = [exs[i] for i in mine[start:start + batch]]
                    if not chunk:
                        continue
                    ids, labels, mask = collate(chunk)
                    out = model(input_ids=ids, attention_mask=mask, **(
                        {"output_router_logits": True} if router_aux is not None else {}))
                    logits = out.logits
                    loss = torch.nn.functional.cross_entropy(
                        logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                        ignore_index=-100, reduction="sum")
                    trained = int((labels[:, 1:] != -100).sum())
                    total += loss.item()
                    if router_aux is not None:  # each micro-batch's, weighted by its trained tokens
                        router += out.aux_loss.item() * trained
                        loss = loss + router_aux * out.aux_loss * trained
                    loss.backward()
                    tokens += trained
            for p in params:
                p.grad /= max(1, tokens)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(total / tokens)
            router_losses.append(router / tokens)

    rows = [json.loads(line) for line in open(ours + "/metrics.jsonl")]
    got = [row["loss"] for row in rows]
    worst_loss = max(abs(a - b) / max(1e-6, abs(b)) for a, b in zip(got, losses)) if got else math.inf
    if router_aux is not None:  # the router loss each step logged, as the loss
        got_router = [row.get("router_loss", math.inf) for row in rows]
        worst_loss = max([worst_loss] + [abs(a - b) / max(1e-6, abs(b)) for a, b in zip(got_router, router_losses)])
    moved = max((v.detach() - at_start[k]).abs().max().item() for k, v in model.state_dict().items() if k in at_start)
    mine_dir = f"{ours}/epoch_{epochs - 1}"
    mine = load_file(mine_dir + "/adapter_model.safetensors")
    if converted:
        model.save_pretrained(ours + "/peft-converted", path_initial_model_for_weight_conversion=init_dir)
        want = load_file(ours + "/peft-converted/adapter_model.safetensors")
    else:  # as PEFT saves it: tables under their module names, magnitudes without ".weight"
        want = {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    same = set(mine) == set(want) and all(mine[k].shape == v.shape for k, v in want.items())
    worst_w = max((mine[k] - v).abs().max().item() / max(1e-6, v.abs().max().item())
                  for k, v in want.items()) if same else math.inf
    logits_diff = 0.0
    if converted:  # ours on the original base computes what PEFT's trained residual model computes
        model.eval()
        ids, _, mask = collate(exs[:4])
        with torch.no_grad():
            trained = model(input_ids=ids, attention_mask=mask).logits
            on_original = PeftModel.from_pretrained(load_base(model_dir), mine_dir)(input_ids=ids,
                                                                                    attention_mask=mask).logits
        logits_diff = (on_original - trained).abs().max().item() / trained.abs().max().item()
    print(f"steps {len(losses)} (ours {len(got)}); loss first {losses[0]:.6f} last {losses[-1]:.6f}; "
          f"worst relative loss diff {worst_loss:.2e}; worst relative weight diff {worst_w:.2e}; "
          f"largest weight change {moved:.2e}; tensors {len(want)} (ours {len(mine)})"
          + (f"; ours on the original base vs PEFT's trained logits {logits_diff:.2e}" if converted else ""))
    # (a re-quantised residual is not the original's NF4 weights less B0A0: that rounding stays, as in PEFT)
    exact_base = after_init is None
    ok = (len(got) == len(losses) and same and worst_loss < loss_tol and worst_w < weight_tol and moved > 1e-3
          and (logits_diff <= 1e-4 or not exact_base))
    print("match" if ok else "MISMATCH")
    oracle.report(match=ok, steps=len(losses), our_steps=len(got), worst_relative_loss_diff=worst_loss,
                  relative_loss_diffs=[abs(a - b) / max(1e-6, abs(b)) for a, b in zip(got, losses)],
                  worst_relative_weight_diff=worst_w, largest_weight_change=moved,
                  **{"original_base_logits_diff" if exact_base else "original_nf4_base_logits_diff":
                     logits_diff if converted else None})
    return 0 if ok else 1


def merged(model_dir, adapter_dir, merged_dir, data):
    ids, _, mask = collate(examples(model_dir, data)[:4])
    with torch.no_grad():
        want = PeftModel.from_pretrained(load_base(model_dir), adapter_dir).eval()(input_ids=ids,
                                                                                  attention_mask=mask).logits
        got = load_base(merged_dir).eval()(input_ids=ids, attention_mask=mask).logits
    diff = (got - want).abs().max().item() / want.abs().max().item()
    print(f"merged vs PEFT logits: {diff:.2e}")
    oracle.report(logits_diff=diff)
    return 0


def evaluate(model_dir, adapter_dir, data, fraction):
    lines = lines_of(data)
    held = [line for line in lines if held_out(line, fraction)] if fraction > 0 else lines
    model = PeftModel.from_pretrained(load_base(model_dir), adapter_dir)
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ex in examples_of(model_dir, held):
            ids, labels, mask = collate([ex])
            logits = model(input_ids=ids, attention_mask=mask).logits.double()
            total += torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                       labels[:, 1:].reshape(-1), ignore_index=-100,
                                                       reduction="sum").item()
            tokens += int((labels[:, 1:] != -100).sum())
    print(f"held out {len(held)} of {len(lines)} documents; eval loss {total / tokens:.8f} over {tokens} tokens")
    oracle.report(eval_loss=total / tokens, eval_tokens=tokens, eval_documents=len(held),
                  train_documents=len(lines) - len(held) if fraction > 0 else None)
    return 0


if __name__ == "__main__":
    cmd, args = sys.argv[1], [a for a in sys.argv[2:] if not a.startswith("--")]
    options = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--"))
    loraplus = float(options["loraplus"]) if "loraplus" in options else None
    if cmd == "init":
        init(args[0], args[1], int(args[2]), float(args[3]), int(args[4]), *args[5:6])
    elif cmd == "check":
        sys.exit(check(args[0], args[1], args[2], args[3], int(args[4]), int(args[5]), int(args[6]), int(args[7]),
                       float(args[8]), int(args[9]), *map(float, args[10:12]), loraplus=loraplus,
                       init_spec=options.get("init"),
                       router_aux=float(options["router-aux"]) if "router-aux" in options else None))
    elif cmd == "merged":
        sys.exit(merged(*args[:4]))
    elif cmd == "eval":
        sys.exit(evaluate(args[0], args[1], args[2], float(args[3])))
    else:
        sys.exit(__doc__)
