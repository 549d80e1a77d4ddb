"""Generation on CPU: lora-generate's tokens/s against transformers' generate on the same model and
prompts, greedy, with a KV cache on both sides, same torch, 2 threads each, in one run, REPEATS times.

usage: .venv/bin/python bench/generate/bench.py BUILD_DIR WORK_DIR [NEW_TOKENS (default 32) [REPEATS (default 3)]]

Model: SmolLM2-135M-Instruct's Q4_1 GGUF (.fixtures/models/smollm2), fp32 on both sides (transformers
dequantises it at load, as lorarun does). Prompts: 16 short chat questions; two shapes: all 16 in one
left-padded batch, and the first alone. Time: lora-generate's own figure (--stats: the generation
call, loading excluded) and transformers' generate call (loading excluded); tokens: the new tokens
each side made (up to each row's eos; both sides make the same ids, tests/model/test_generate.cpp).
Prints each repeat's tokens/s, then the median and spread (min-max) of ours / transformers'.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, ".fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
THREADS = 2
QUESTIONS = ["What is 2 + 3?", "Name a colour.", "Write a haiku about the sea.", "What is the capital of France?",
             "Say hello.", "Count to five.", "What is LoRA?", "Give me a word that rhymes with cat.",
             "Is the sun a star?", "What day comes after Monday?", "Translate 'thank you' into French.",
             "What is 12 times 12?", "Describe a cat in one sentence.", "Why is the sky blue?",
             "Spell 'apple' backwards.", "What is the opposite of hot?"]
PROMPTS = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]


def ours(build, work, prompts, n):
    path = os.path.join(work, f"prompts-{len(prompts)}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in prompts)
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    r = subprocess.run([os.path.join(build, "bin/lora-generate"), "--model", MODEL, "--prompts", path,
                        "--max-new-tokens", str(n), "--ids", "--stats"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"lora-generate failed:\n{r.stderr}")
    m = re.search(r"(\d+) new tokens in ([\d.]+) s", r.stderr)
    return int(m.group(1)) / float(m.group(2))


def theirs(model, tok, prompts, n):
    import torch
    enc = tok(prompts, return_tensors="pt", padding=True)
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
        seconds = time.perf_counter() - start
    tokens = 0
    for row in out[:, enc.input_ids.size(1):].tolist():
        tokens += row.index(eos) + 1 if eos in row else len(row)
    return tokens / seconds


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    build, work = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    os.makedirs(work, exist_ok=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(THREADS)
    where, name = os.path.dirname(MODEL), os.path.basename(MODEL)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ratios = {}
    for rep in range(repeats):
        for label, prompts in (("batch of 16", PROMPTS), ("one prompt", PROMPTS[:1])):
            a, b = ours(build, work, prompts, n), theirs(model, tok, prompts, n)
            ratios.setdefault(label, []).append(a / b)
            print(f"repeat {rep + 1}, {label}: ours {a:.1f} tokens/s, transformers {b:.1f} tokens/s, ratio {a / b:.2f}x",
                  flush=True)
    for label, r in ratios.items():
        print(f"{label}: tokens/s ours / transformers' {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f}), "
              f"{len(r)} repeats")


if __name__ == "__main__":
    main()
