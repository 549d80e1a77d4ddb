"""Loads what lorarun wrote with transformers / PEFT and compares logits on real tokens.

usage: check.py adapter BASE_DIR ADAPTER_DIR EXPECTED.safetensors   (PeftModel.from_pretrained)
       check.py model MODEL_DIR EXPECTED.safetensors KEY             (AutoModelForCausalLM)
EXPECTED holds input_ids, attention_mask and the logits to compare against (KEY, default 'logits').
Exits 1 when the largest difference on real tokens exceeds 1e-4.
"""
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    mode = sys.argv[1]
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
