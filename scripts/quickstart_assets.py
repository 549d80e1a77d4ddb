"""Makes the quickstart's inputs (run with .venv's python; fixture preparation, not product):
a JSONL dataset of a small learnable task written by us, and a tiny random llama in real HF
format with a byte-level BPE tokenizer trained on that data.

usage: quickstart_assets.py OUT_DIR   ->  OUT_DIR/data.jsonl, OUT_DIR/tiny-llama/
"""
import json
import os
import random
import sys

WORDS = ("apple river stone cloud light green table music paper water house bread smile north "
         "tiger plant sugar glass storm candle forest silver garden pocket winter").split()


def examples(n, seed=0):
    rng = random.Random(seed)
    for i in range(n):
        if i % 2 == 0:
            w = rng.choice(WORDS)
            yield {"instruction": f"Reverse the letters of the word: {w}", "output": w[::-1]}
        else:
            a, b = rng.randint(0, 49), rng.randint(0, 49)
            yield {"instruction": f"Add the numbers: {a} + {b}", "output": str(a + b)}


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rows = list(examples(3000))
    with open(os.path.join(out, "data.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    model_dir = os.path.join(out, "tiny-llama")
    if os.path.exists(os.path.join(model_dir, "model.safetensors")):
        return
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM
    os.makedirs(model_dir, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    texts = [f"### Instruction:\n{r['instruction']}\n\n### Response:\n{r['output']}" for r in rows]
    tok.train_from_iterator(texts, vocab_size=512, min_frequency=2, special_tokens=["<|endoftext|>"])
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "bos_token": "<|endoftext|>", "model_max_length": 256}, f)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(model_dir)


if __name__ == "__main__":
    main()
