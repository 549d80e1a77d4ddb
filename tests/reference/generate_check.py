"""transformers' side of generation: its sampling warpers on given logits, its batched greedy generate.

usage: generate_check.py sampling OUT.safetensors
         seeded logits [rows, vocab] (ties and a peaked row among them) and, for each of CONFIGS, the
         probabilities transformers' generate draws from (the warpers its _get_logits_processor
         builds for do_sample=True, in its order, then softmax): logits, probs_<i>; reports configs
       generate_check.py batch MODEL PROMPTS_JSON N [ADAPTER_DIR]
         MODEL a HF directory or a .gguf file; PROMPTS_JSON a list of strings, tokenized by the model's
         tokenizer and generated together, left-padded, greedy, N new tokens at most; reports
         prompt_ids and ids (each row's new ids, up to and including its first eos)
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from oracle import report  # noqa: E402  (first: see oracle.py)
import torch  # noqa: E402

# (temperature, top_k, top_p): each warper alone, together, and the edges (top_k past the vocabulary,
# a top_p that keeps one token)
CONFIGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 50, 1.0), (1.0, 0, 0.9), (0.7, 20, 0.8), (1.3, 5, 0.5),
           (0.5, 0, 0.05), (1.0, 1000, 1.0), (0.9, 1, 1.0), (2.0, 0, 0.95)]


def load(model, adapter=""):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if model.endswith(".gguf"):
        where, name = os.path.dirname(os.path.abspath(model)), os.path.basename(model)
        m = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
    else:
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(model)
    if adapter:
        from peft import PeftModel
        m = PeftModel.from_pretrained(m, adapter)
    return m.eval(), tok


def sampling(out):
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    g = torch.Generator().manual_seed(7)
    vocab = 300
    logits = torch.randn(6, vocab, generator=g) * 3
    logits[1, :40] = 2.5  # a plateau of ties at the top
    logits[2, 7] = 30.0  # one token holds nearly all the mass
    logits[3] = torch.round(logits[3])  # many ties everywhere
    logits[4] *= 0.05  # nearly flat
    # The processors generate builds, from a model instance's own method (a tiny one: only its
    # generation code is used).
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1))
    tensors = {"logits": logits.contiguous()}
    ids = torch.zeros(6, 1, dtype=torch.long)
    names = []
    for i, (t, k, p) in enumerate(CONFIGS):
        cfg = GenerationConfig(do_sample=True, temperature=t, top_k=k, top_p=p)
        procs = model._get_logits_processor(generation_config=cfg, input_ids_seq_length=1, encoder_input_ids=ids,
                                            prefix_allowed_tokens_fn=None, logits_processor=None, device="cpu")
        names.append([type(x).__name__ for x in procs])
        tensors[f"probs_{i}"] = torch.softmax(procs(ids, logits.clone()), dim=-1).contiguous()
    save_file(tensors, out)
    report(configs=CONFIGS, processors=names, written=out)


def batch(model_path, prompts_json, n, adapter):
    model, tok = load(model_path, adapter)
    with open(prompts_json, encoding="utf-8") as f:
        prompts = json.load(f)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    width = enc.input_ids.size(1)
    ids, prompt_ids = [], []
    for row, mask in zip(out, enc.attention_mask):
        prompt_ids.append(row[:width][mask.bool()].tolist())
        new = row[width:].tolist()
        if eos is not None and eos in new:
            new = new[:new.index(eos) + 1]
        ids.append(new)
    report(prompt_ids=prompt_ids, ids=ids, eos=eos)


def main():
    mode = sys.argv[1]
    if mode == "sampling":
        return sampling(sys.argv[2])
    if mode == "batch":
        return batch(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "")
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
