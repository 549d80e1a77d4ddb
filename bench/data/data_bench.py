#!/usr/bin/env python3
"""Documents/s per rank, fetched + rendered + tokenized: lorarun's ShardReader against pymongo +
HF tokenizers doing the same work in Python, on the same collection, in the same run.

  .venv/bin/python bench/data/data_bench.py --bench-bin build/bin/data_bench --uri mongodb://…

Both: list the sorted _ids, permute, fetch 256 at a time by {_id: {$in: …}} with a projection of
the template's fields, render the Alpaca prompt, tokenize prompt and response (labels masked),
append EOS. HF runs encode_batch per chunk with RAYON_NUM_THREADS=1 (ours is one thread too).
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
print(json.dumps({"documents": n, "examples": examples, "tokens": tokens, "seconds": time.perf_counter() - t0}))
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-bin", required=True)
    ap.add_argument("--uri", required=True)
    ap.add_argument("--documents", type=int, default=20000)
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, ".fixtures", "tokenizers", "llama3"))
    a = ap.parse_args()
    db, coll = "lorarun_bench", "alpaca"
    make_collection(a.uri, db, coll, a.documents)
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="true")
    rows = []
    for mode, prefetch in (("global", 4), ("global", 0), ("stream", 4)):
        out = subprocess.run([a.bench_bin, a.uri, db, coll, a.tokenizer, mode, str(prefetch)],
                             capture_output=True, text=True, check=True, env=env)
        rows.append((f"lorarun {mode} prefetch={prefetch}", json.loads(out.stdout)))
    out = subprocess.run([sys.executable, "-c", PY_TIMER, a.uri, db, coll,
                          os.path.join(a.tokenizer, "tokenizer.json"), TEMPLATE],
                         capture_output=True, text=True, check=True, env=env)
    py = json.loads(out.stdout)
    rows.append(("pymongo + HF tokenizers", py))
    py_rate = py["documents"] / py["seconds"]
    print(f"{a.documents} documents, one rank, tokenizer {os.path.basename(a.tokenizer)}")
    print(f"{'pipeline':32} {'docs':>7} {'seconds':>8} {'docs/s':>9} {'ratio':>6}")
    for name, r in rows:
        rate = r["documents"] / r["seconds"]
        print(f"{name:32} {r['documents']:>7} {r['seconds']:>8.2f} {rate:>9.0f} {rate / py_rate:>5.2f}x")


if __name__ == "__main__":
    main()
