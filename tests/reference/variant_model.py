"""A fixture model with some config.json keys changed, its weights made anew by transformers.

usage: variant_model.py SRC DST KEY=JSON_VALUE ...   (e.g. n_positions=16, vocab_size=200)

DST gets SRC's tokenizer files, and a random model of SRC's config with the changes, as
transformers saves it: a real HF directory that disagrees with itself only where asked.
"""
import json
import os
import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    src, dst, changes = sys.argv[1], sys.argv[2], sys.argv[3:]
    config = AutoConfig.from_pretrained(src)
    for change in changes:
        key, value = change.split("=", 1)
        setattr(config, key, json.loads(value))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    os.makedirs(dst, exist_ok=True)
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))


if __name__ == "__main__":
    main()
