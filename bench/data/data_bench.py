#!/usr/bin/env python3
"""Documents/s per rank, fetched + rendered + tokenized: lorarun's ShardReader against pymongo +
HF tokenizers doing the same work in Python, on the same collection, in the same run.

  .venv/bin/python bench/data/data_bench.py --bench-bin build/bin/data_bench --uri mongodb://…

Both: list the sorted _ids, permute, fetch 256 at a time by {_id: {$in: …}} with a projection of
the template's fields, render the Alpaca prompt, tokenize prompt and response (labels masked),
append EOS. HF runs encode_batch per chunk with RAYON_NUM_THREADS=1 (ours is one thread too).

With --mixture, instead: the same documents as 1 collection and as data.sources of 3 collections
(50/30/20% of them, weight 1 each), lorarun's pipeline on each, 5 runs alternating: documents/s,
medians and spread, and the ratio 3 sources / 1 source.

With --train-bin, also what training consumes from the same collection: lora-train (1 rank, 2
threads) on a random llama with the same tokenizer (hidden 512, 4 layers, fp32, LoRA r=16
all-linear, batch 8, max_length 1024), documents/s over 8 steps after the first, and each
pipeline's rate as a multiple of it (the aim: at least 5x).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SUPPORT = os.path.join(ROOT, "tests", "support")
sys.path.insert(0, SUPPORT)
import oracle  # noqa: E402  (tests/support/oracle.py: what the reference process reports, and nothing else)
# The reference processes report through it too.
CHILD = f"import sys; sys.path.insert(0, {SUPPORT!r}); import oracle\n"
TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")

PY_TIMER = r"""
import json, random, sys, time
from pymongo import MongoClient
from tokenizers import Tokenizer
uri, db, coll, tok_file, template = sys.argv[1:6]
tok = Tokenizer.from_file(tok_file)
eos = tok.token_to_id("<|end_of_text|>") or tok.token_to_id("</s>") or 0
t0 = time.perf_counter()
c = MongoClient(uri)[db][coll]
ids = [d["_id"] for d in c.find({}, {"_id": 1}).sort("_id", 1)]
random.Random(42).shuffle(ids)
n = examples = tokens = 0
for s in range(0, len(ids), 256):
    chunk = ids[s:s + 256]
    by_id = {d["_id"]: d for d in c.find({"_id": {"$in": chunk}}, {"instruction": 1, "input": 1, "output": 1})}
    docs = [by_id[i] for i in chunk]
    prompts = [template.format(instruction=d["instruction"], input=d["input"]) for d in docs]
    p = tok.encode_batch(prompts)
    r = tok.encode_batch([d["output"] for d in docs], add_special_tokens=False)
    for a, b in zip(p, r):
        ex = a.ids + b.ids + [eos]
        labels = [-100] * len(a.ids) + b.ids + [eos]
        n += 1; examples += 1; tokens += len(ex[:1024])
oracle.report(documents=n, examples=examples, tokens=tokens, seconds=time.perf_counter() - t0)
"""


def make_collection(uri, db, coll, n):
    from pymongo import MongoClient
    c = MongoClient(uri)[db][coll]
    c.drop()
    rng = random.Random(0)
    words = "the of and to in is that for it as with was on be by this are from or an which model data".split()
    text = lambda k: " ".join(rng.choice(words) for _ in range(k))
    docs = [{"instruction": text(rng.randint(8, 40)), "input": text(rng.randint(0, 30)),
             "output": text(rng.randint(20, 150)), "meta": {"source": "bench", "blob": text(50)}} for _ in range(n)]
    for s in range(0, n, 5000):
        c.insert_many(docs[s:s + 5000])


def consumption(train_bin, uri, db, coll, tokenizer_dir, work):
    """Documents/s lora-train consumes on this collection (median step time, steps 2..)."""
    import shutil
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    model_dir = os.path.join(work, "llama-bench")
    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        os.makedirs(model_dir, exist_ok=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if os.path.exists(os.path.join(tokenizer_dir, f)):
                shutil.copy(os.path.join(tokenizer_dir, f), model_dir)
        from tokenizers import Tokenizer
        vocab = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
                         ).save_pretrained(model_dir)
    out = os.path.join(work, "train")
    recipe = os.path.join(work, "train.yaml")
    template = json.dumps(TEMPLATE)
    with open(recipe, "w") as f:
        f.write(f"""model: {{path: {model_dir}, dtype: fp32, device: cpu}}
lora: {{r: 16, alpha: 32, target_modules: all-linear}}
data: {{uri: "{uri}", database: {db}, collection: {coll}, format: instruction, prompt_template: {template},
        response_field: output, max_length: 1024, batch_size: 8}}
train: {{epochs: 1, max_steps_per_epoch: 9, lr_scheduler: constant}}
checkpoint: {{output_dir: {out}, resume: never, epochs_to_save: none}}
track: {{mongodb: false}}
""")
    subprocess.run([train_bin, recipe], check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="2"))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    seconds = sorted(r["seconds"] for r in rows[1:])[len(rows[1:]) // 2]
    return 8 / seconds, max(r["data_wait_share"] for r in rows[1:])


def mixture(a, env):
    """1 collection vs the same documents in 3 collections mixed (data.sources), lorarun only."""
    from pymongo import MongoClient
    db = "lorarun_bench"
    make_collection(a.uri, db, "alpaca", a.documents)
    c = MongoClient(a.uri)[db]
    docs = list(c["alpaca"].find({}))
    cut = [0, a.documents // 2, a.documents * 8 // 10, a.documents]
    for i in range(3):
        c[f"part{i}"].drop()
        part = docs[cut[i]:cut[i + 1]]
        for s in range(0, len(part), 5000):
            c[f"part{i}"].insert_many(part[s:s + 5000])
    rates = {"1 source": [], "3 sources": []}
    for _ in range(5):
        for name, coll in (("1 source", "alpaca"), ("3 sources", "part0,part1,part2")):
            out = subprocess.run([a.bench_bin, a.uri, db, coll, a.tokenizer, "global", "4"],
                                 capture_output=True, text=True, check=True, env=env)
            r = json.loads(out.stdout)
            rates[name].append(r["documents"] / r["seconds"])
    med = {k: sorted(v)[2] for k, v in rates.items()}
    print(f"{a.documents} documents, one rank, shuffle global, prefetch 4, 5 runs each (docs/s)")
    for k, v in rates.items():
        print(f"{k:10} median {med[k]:8.0f}  min {min(v):8.0f}  max {max(v):8.0f}")
    ratios = sorted(x / y for x, y in zip(rates["3 sources"], rates["1 source"]))
    print(f"3 sources / 1 source: median {med['3 sources'] / med['1 source']:.2f}x "
          f"(per run {ratios[0]:.2f}x to {ratios[-1]:.2f}x)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-bin", required=True)
    ap.add_argument("--uri", required=True)
    ap.add_argument("--documents", type=int, default=20000)
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, ".fixtures", "tokenizers", "llama3"))
    ap.add_argument("--train-bin", help="lora-train: also measure what training consumes")
    ap.add_argument("--work", default="/tmp/lorarun-data-bench")
    ap.add_argument("--mixture", action="store_true", help="1 collection vs 3 collections as data.sources")
    a = ap.parse_args()
    if a.mixture:
        return mixture(a, dict(os.environ, RAYON_NUM_THREADS="1"))
    db, coll = "lorarun_bench", "alpaca"
    make_collection(a.uri, db, coll, a.documents)
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="true")
    rows = []
    for mode, prefetch in (("global", 4), ("global", 0), ("stream", 4)):
        out = subprocess.run([a.bench_bin, a.uri, db, coll, a.tokenizer, mode, str(prefetch)],
                             capture_output=True, text=True, check=True, env=env)
        rows.append((f"lorarun {mode} prefetch={prefetch}", json.loads(out.stdout)))
    out = subprocess.run([sys.executable, "-c", CHILD + PY_TIMER, a.uri, db, coll,
                          os.path.join(a.tokenizer, "tokenizer.json"), TEMPLATE],
                         capture_output=True, text=True, check=True, env=env)
    py = oracle.reported(out.stdout)
    rows.append(("pymongo + HF tokenizers", py))
    py_rate = py["documents"] / py["seconds"]
    consumed, wait = consumption(a.train_bin, a.uri, db, coll, a.tokenizer, a.work) if a.train_bin else (None, None)
    print(f"{a.documents} documents, one rank, tokenizer {os.path.basename(a.tokenizer)}")
    print(f"{'pipeline':32} {'docs':>7} {'seconds':>8} {'docs/s':>9} {'vs py':>6} {'tokens/s':>9}"
          + (f" {'vs training':>12}" if consumed else ""))
    for name, r in rows:
        rate = r["documents"] / r["seconds"]
        print(f"{name:32} {r['documents']:>7} {r['seconds']:>8.2f} {rate:>9.0f} {rate / py_rate:>5.2f}x "
              f"{r['tokens'] / r['seconds']:>9.0f}" + (f" {rate / consumed:>11.1f}x" if consumed else ""))
    if consumed:
        print(f"training consumes {consumed:.1f} documents/s (lora-train, 1 rank x 2 threads; "
              f"largest data-wait share {100 * wait:.1f}%)")


if __name__ == "__main__":
    main()
