"""lora-merge --out FILE.gguf against transformers, PEFT and gguf-py (tests/model/test_gguf_export.cpp).

  gguf_export_check.py make DIR
      writes tiny random llama, qwen2 and qwen3 models (DIR/<arch>/base: transformers' save_pretrained with
      make_models.py's byte-level BPE tokenizer, a chat template and one non-special added token;
      vocabulary 400 with ids no token has; qwen2's intermediate size 80 is not whole Q8_0 blocks) and a random PEFT adapter for each
      (DIR/<arch>/adapter: LoraConfig(init_lora_weights=False), B != 0).
  gguf_export_check.py check DIR ARCH
      for each DIR/<arch>/<type>.gguf (f32, f16, bf16, q8_0) that lora-merge wrote: loads it with
      transformers (AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., float32)) and reports
      the largest |logit| difference on a right-padded batch from PEFT's merge_and_unload() of the
      same base and adapter, its 2-D weights quantised as the file's (gguf.quants.quantize, then
      dequantize: the f32 file's reference is the merged model itself); the largest |weight|
      difference; whether every tensor of a typed file is gguf.quants.quantize of the f32 file's
      (converter rule: F32 for 1-D, norms, non-.weight; F16 where Q8_0 does not fit); every key and
      tensor as gguf-py's GGUFReader reads them; and the tokenizer keys against what
      convert_hf_to_gguf.py's get_vocab_base and gguf.SpecialVocab make of the base directory.
  gguf_export_check.py smol-make DIR GGUF
      a random r=2 adapter on q_proj and v_proj (DIR/adapter) for transformers' model loaded from
      GGUF, and PEFT's merge_and_unload() logits on a right-padded batch (DIR/reference.pt).
  gguf_export_check.py smol-check DIR GGUF OUT.gguf
      the f32 OUT.gguf's logits (transformers) against those, and whether every tokenizer.* key of
      OUT.gguf equals the base file's (type and value).

  gguf_export_check.py smol-check-dir DIR GGUF OUT_DIR
      the HF directory lora-merge wrote from the GGUF base: transformers' logits of OUT_DIR against
      those; whether AutoTokenizer of OUT_DIR gives the ids transformers' GGUF tokenizer gives on
      the tokenizer corpus (tests/tokenizer/corpus.py), and keeps the chat template and eos.

Results are reported on marked lines (oracle.report); transformers' warnings are not read.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle import report  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

TYPES = ["f32", "f16", "bf16", "q8_0"]
LENGTHS = [12, 9, 5]


def batch(vocab, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(LENGTHS), max(LENGTHS)), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    return ids * mask, mask


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[mask.bool()]


def make(out):
    from make_models import make_tokenizer
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    configs = {
        "llama": (LlamaForCausalLM, LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=96,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, tie_word_embeddings=True,
                                                rope_theta=5000.0)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(vocab_size=400, hidden_size=64, intermediate_size=80,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, tie_word_embeddings=False)),
        # head_dim 128: transformers' GGUF loading of qwen3 takes Qwen3Config's default, not key_length
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(vocab_size=400, hidden_size=64, intermediate_size=96,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=128, max_position_embeddings=64,
                                                tie_word_embeddings=False)),
    }
    for arch, (cls, config) in configs.items():
        base = os.path.join(out, arch, "base")
        os.makedirs(base, exist_ok=True)
        eos = make_tokenizer(base)
        with open(os.path.join(base, "tokenizer.json")) as f:
            tok = json.load(f)
        new_id = len(tok["model"]["vocab"])  # the next id; those after it up to 399 stay unused
        tok["added_tokens"].append({"id": new_id, "content": "<think>", "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
        with open(os.path.join(base, "tokenizer.json"), "w") as f:
            json.dump(tok, f)
        with open(os.path.join(base, "tokenizer_config.json")) as f:
            tc = json.load(f)
        tc["chat_template"] = "{% for m in messages %}<|endoftext|>{{ m['content'] }}{% endfor %}"
        with open(os.path.join(base, "tokenizer_config.json"), "w") as f:
            json.dump(tc, f)
        config.bos_token_id = config.eos_token_id = eos
        model = cls(config).eval()
        model.save_pretrained(base)
        lcfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                          task_type="CAUSAL_LM")
        get_peft_model(model, lcfg).save_pretrained(os.path.join(out, arch, "adapter"))
    report(made=list(configs))


def merged_reference(base, adapter, **kw):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **kw)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def qtype_of(gguf, name, shape, outtype):
    """convert_hf_to_gguf.py's prepare_tensors rule for a tensor of GGUF `name`, torch `shape`."""
    Q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return Q.F32
    want = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[outtype]
    if want == Q.Q8_0 and shape[-1] % 32 != 0:
        return Q.F16  # gguf.QuantError: the converter falls back to F16
    return want


def quantised_like(merged, outtype):
    """A copy of `merged` with each 2-D weight quantised and dequantised by gguf-py as the file's."""
    import copy
    import gguf
    model = copy.deepcopy(merged)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                q = qtype_of(gguf, name, p.shape, outtype)
                data = gguf.quants.quantize(p.detach().numpy(), q)
                p.copy_(torch.from_numpy(np.asarray(gguf.quants.dequantize(data, q), dtype=np.float32)))
    return model


def load_gguf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def field_json(f):
    from gguf import GGUFValueType as V
    if f.types[0] == V.ARRAY and len(f.types) > 1 and f.types[1] == V.ARRAY:
        return None
    v = f.contents()
    return v


def read_back(path):
    """Every key and tensor as GGUFReader reads them: {key: value}, {tensor: (type, shape)}, arrays."""
    import gguf
    r = gguf.GGUFReader(path)
    keys = {k: field_json(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, [int(d) for d in t.shape]) for t in r.tensors}
    data = {t.name: (t.tensor_type, np.array(t.data)) for t in r.tensors}
    for t in r.tensors:
        gguf.quants.dequantize(t.data, t.tensor_type)  # every tensor dequantises
    return keys, tensors, data


def expected_tokenizer(base, vocab_size):
    """convert_hf_to_gguf.py's get_vocab_base (tokens, types) and gguf.SpecialVocab for `base`."""
    import gguf
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base)
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.get_added_vocab()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        t = reverse[i]
        if t in added:
            special = tok.added_tokens_decoder[i].special or (t.startswith("<|") and t.endswith("|>"))
            types.append(int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(t)
    sv = gguf.SpecialVocab(base, load_merges=True, n_vocab=vocab_size)
    want = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": sv.merges}
    names = {"bos": "bos", "eos": "eos", "unk": "unknown", "sep": "seperator", "pad": "padding", "mask": "mask"}
    for typ, tid in sv.special_token_ids.items():
        want[f"tokenizer.ggml.{names[typ]}_token_id"] = tid
    for typ, value in sv.add_special_token.items():
        want[f"tokenizer.ggml.add_{typ}_token"] = value
    if sv.chat_template is not None:
        want["tokenizer.chat_template"] = sv.chat_template
    return want


def check(out, arch):
    import gguf
    d = os.path.join(out, arch)
    base, adapter = os.path.join(d, "base"), os.path.join(d, "adapter")
    merged = merged_reference(base, adapter)
    ids, mask = batch(merged.config.vocab_size)
    f32_keys, f32_tensors, f32_data = read_back(os.path.join(d, "f32.gguf"))
    want_tok = expected_tokenizer(base, merged.config.vocab_size)
    results = {}
    for outtype in TYPES:
        path = os.path.join(d, f"{outtype}.gguf")
        keys, tensors, data = read_back(path)
        ref = merged if outtype == "f32" else quantised_like(merged, outtype)
        ours = load_gguf(path)
        diff = (logits(ours, ids, mask) - logits(ref, ids, mask)).abs().max().item()
        ref_sd, our_sd = ref.state_dict(), ours.state_dict()
        wdiff = max((our_sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd if k in our_sd)
        not_quantised = []  # tensors that are not gguf-py's quantisation of the f32 file's
        for name, (qtype, raw) in data.items():
            src = f32_data[name][1]
            want_type = qtype_of(gguf, name, src.shape, outtype)
            if qtype != want_type or not np.array_equal(
                    np.asarray(gguf.quants.quantize(src, want_type)).view(np.uint8).reshape(-1), raw.view(np.uint8).reshape(-1)):
                not_quantised.append(f"{name} ({qtype.name})")
        tok_diff = [k for k, v in want_tok.items() if keys.get(k) != v]
        results[outtype] = {
            "logit_diff": diff, "weight_diff": wdiff, "not_quantised": not_quantised, "tokenizer_diff": tok_diff,
            "file_type": keys.get("general.file_type"), "size": os.path.getsize(path),
            "tensor_types": sorted({t for t, _ in tensors.values()}), "tensors": sorted(tensors),
            "keys": sorted(keys), "pre": keys.get("tokenizer.ggml.pre"),
        }
    report(arch=arch, results=results, tie=bool(merged.config.tie_word_embeddings))


def smol_make(out, path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    lcfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                      task_type="CAUSAL_LM")
    peft = get_peft_model(model, lcfg)
    peft.save_pretrained(os.path.join(out, "adapter"))
    merged = peft.merge_and_unload().eval()  # the reference, computed now: loading the Q4_1 file twice is slow
    ids, mask = batch(merged.config.vocab_size)
    torch.save({"input_ids": ids, "attention_mask": mask, "logits": logits(merged, ids, mask)},
               os.path.join(out, "reference.pt"))
    report(made=os.path.join(out, "adapter"))


def smol_check(out, path, ours_path):
    import gguf
    ref = torch.load(os.path.join(out, "reference.pt"))
    ours = load_gguf(ours_path)
    diff = (logits(ours, ref["input_ids"], ref["attention_mask"]) - ref["logits"]).abs().max().item()
    base, written = gguf.GGUFReader(path), gguf.GGUFReader(ours_path)
    tok_keys = [k for k in base.fields if k.startswith("tokenizer.")]
    differ = [k for k in tok_keys if k not in written.fields or written.fields[k].types != base.fields[k].types
              or field_json(written.fields[k]) != field_json(base.fields[k])]
    extra = [k for k in written.fields if k.startswith("tokenizer.") and k not in base.fields]
    report(logit_diff=diff, tokenizer_keys=len(tok_keys), tokenizer_differ=differ + extra,
           size=os.path.getsize(ours_path), tensors=len(written.tensors))


def smol_check_dir(out, path, ours_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tokenizer"))
    import corpus
    ref = torch.load(os.path.join(out, "reference.pt"))
    ours = AutoModelForCausalLM.from_pretrained(ours_dir, dtype=torch.float32).eval()
    diff = (logits(ours, ref["input_ids"], ref["attention_mask"]) - ref["logits"]).abs().max().item()
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    mine = AutoTokenizer.from_pretrained(ours_dir)
    texts = corpus.corpus()
    differ = sum(mine(t)["input_ids"] != theirs(t)["input_ids"] for t in texts)
    report(logit_diff=diff, strings=len(texts), ids_differ=differ,
           chat_template_equal=mine.chat_template == theirs.chat_template, eos_equal=mine.eos_token == theirs.eos_token)


def main():
    torch.set_num_threads(2)
    mode = sys.argv[1]
    if mode == "make":
        return make(sys.argv[2])
    if mode == "check":
        return check(sys.argv[2], sys.argv[3])
    if mode == "smol-make":
        return smol_make(sys.argv[2], sys.argv[3])
    if mode == "smol-check":
        return smol_check(sys.argv[2], sys.argv[3], sys.argv[4])
    if mode == "smol-check-dir":
        return smol_check_dir(sys.argv[2], sys.argv[3], sys.argv[4])
    sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
