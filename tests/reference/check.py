"""Loads what lorarun wrote with transformers / PEFT and compares logits on real tokens.

usage: check.py adapter BASE_DIR ADAPTER_DIR EXPECTED.safetensors   (PeftModel.from_pretrained)
       check.py model MODEL_DIR EXPECTED.safetensors KEY             (AutoModelForCausalLM)
       check.py eval MODEL_DIR ADAPTER_DIR|- DATA.jsonl MAX_LEN PER_DOC.jsonl
       check.py generate MODEL_DIR ADAPTER_DIR|- PROMPT N IDS_JSON
EXPECTED holds input_ids, attention_mask and the logits to compare against (KEY, default 'logits').
Exits 1 when the largest difference on real tokens exceeds 1e-4 (eval: per-document loss;
generate: the greedy ids must be identical).
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import oracle  # noqa: E402,F401  (first: LORARUN_TEST_FORCE_BNB_AVX512BF16 applies before bitsandbytes loads)
import torch  # noqa: E402
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def load(model_dir, adapter):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter != "-":
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def check_eval(model_dir, adapter, data, max_len, per_doc):
    from tokenizers import Tokenizer
    model = load(model_dir, adapter)
    tok = Tokenizer.from_file(model_dir + "/tokenizer.json")
    ours = [json.loads(line) for line in open(per_doc)]
    docs = [json.loads(line)["text"] for line in open(data) if line.strip()]
    worst = 0.0
    with torch.no_grad():
        for got in ours:
            ids = tok.encode(docs[got["index"]]).ids[:max_len]
            assert got["tokens"] == len(ids) - 1, (got, len(ids))
            x = torch.tensor([ids])
            ref = model(input_ids=x, labels=x).loss.item()
            worst = max(worst, abs(ref - got["loss"]))
    print(f"documents {len(ours)}, max abs per-document loss difference {worst:.3g}")
    sys.exit(0 if worst <= 1e-4 and len(ours) > 0 else 1)


def check_generate(model_dir, adapter, prompt, n, ids_json):
    from tokenizers import Tokenizer
    model = load(model_dir, adapter)
    ids = Tokenizer.from_file(model_dir + "/tokenizer.json").encode(prompt).ids
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n)
    ref = out[0, len(ids):].tolist()
    got = json.loads(ids_json)
    print(f"reference {ref}\nours      {got}")
    sys.exit(0 if ref == got else 1)


def main():
    mode = sys.argv[1]
    if mode == "eval":
        return check_eval(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    if mode == "generate":
        return check_generate(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    if mode == "adapter":
        from peft import PeftModel
        base = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
        model = PeftModel.from_pretrained(base, sys.argv[3])
        expected, key = load_file(sys.argv[4]), "logits"
    else:
        model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
        expected, key = load_file(sys.argv[3]), (sys.argv[4] if len(sys.argv) > 4 else "logits")
    model.eval()
    with torch.no_grad():
        got = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).logits
    real = expected["attention_mask"].bool()
    diff = (got[real] - expected[key][real]).abs().max().item()
    print(f"max abs logit difference on real tokens: {diff:.3g}")
    sys.exit(0 if diff <= 1e-4 else 1)


if __name__ == "__main__":
    main()
