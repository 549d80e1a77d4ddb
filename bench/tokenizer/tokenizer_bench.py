#!/usr/bin/env python3
"""Tokens per second of lorarun's tokenizer against HF tokenizers, on the same texts, same run.

  .venv/bin/python bench/tokenizer/tokenizer_bench.py --bench-bin build/bin/tokenizer_bench

Texts: the test corpus (tests/tokenizer/corpus.py: many scripts, emoji, code, long runs) and
the repository's own Markdown and C++ files, paragraph by paragraph (ordinary prose and code).
Single-thread: ours is a loop of encode(); HF's is encode_batch under RAYON_NUM_THREADS=1
(no Python call per text). Batched: encode_batch on every core, for both. Each measurement
starts from a freshly loaded tokenizer (empty word caches).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "tokenizer"))
import corpus  # noqa: E402
SUPPORT = os.path.join(ROOT, "tests", "support")
sys.path.insert(0, SUPPORT)
import oracle  # noqa: E402  (tests/support/oracle.py: what the reference process reports, and nothing else)
# The reference processes report through it too.
CHILD = f"import sys; sys.path.insert(0, {SUPPORT!r}); import oracle\n"

HF_TIMER = r"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(l) for l in open(sys.argv[2], encoding="utf-8")]
repeat = int(sys.argv[3])
t0 = time.perf_counter()
n = sum(len(e.ids) for _ in range(repeat) for e in tok.encode_batch(texts, add_special_tokens=False))
oracle.report(tokens=n, seconds=time.perf_counter() - t0)
"""


def texts():
    out = corpus.corpus()
    files = sorted(glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True)
                   + glob.glob(os.path.join(ROOT, "lib", "**", "*.[ch]pp"), recursive=True))
    for path in files:
        if "/.venv/" in path or "/build" in path or "/.fixtures/" in path:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            out += [p for p in f.read().split("\n\n") if p.strip()]
    return out


def hf_time(tokenizer_json, corpus_file, repeat, threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    p = subprocess.run([sys.executable, "-c", CHILD + HF_TIMER, tokenizer_json, corpus_file, str(repeat)],
                       env=env, capture_output=True, text=True, check=True)
    return oracle.reported(p.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-bin", required=True, help="build/bin/tokenizer_bench")
    ap.add_argument("--fixtures", default=os.path.join(ROOT, ".fixtures", "tokenizers"))
    ap.add_argument("--tokenizers", default="gpt2,llama3,llama2,qwen3,gpt4o")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as f:
        data = texts()
        for t in data:
            f.write(json.dumps(t) + "\n")
        corpus_file = f.name
    print(f"{len(data)} texts, {sum(map(len, data))} characters, x{a.repeat}; batched on {a.threads} threads")
    print(f"{'tokenizer':10} {'tokens':>9} | {'ours 1T':>11} {'HF 1T':>11} {'ratio':>6} | "
          f"{'ours batch':>11} {'HF batch':>11} {'ratio':>6}   (tokens/s)")
    for name in a.tokenizers.split(","):
        model = os.path.join(a.fixtures, name)
        with open(corpus_file, encoding="utf-8") as stdin:
            p = subprocess.run([a.bench_bin, model, str(a.threads), str(a.repeat)], stdin=stdin,
                               capture_output=True, text=True, check=True)
        ours = json.loads(p.stdout)
        hf1 = hf_time(os.path.join(model, "tokenizer.json"), corpus_file, a.repeat, 1)
        hfn = hf_time(os.path.join(model, "tokenizer.json"), corpus_file, a.repeat, a.threads)
        assert ours["tokens"] == hf1["tokens"] == hfn["tokens"], (ours, hf1, hfn)
        o1, h1 = ours["tokens"] / ours["single_s"], hf1["tokens"] / hf1["seconds"]
        on, hn = ours["batch_tokens"] / ours["batch_s"], hfn["tokens"] / hfn["seconds"]
        print(f"{name:10} {ours['tokens']:>9} | {o1:>11,.0f} {h1:>11,.0f} {o1 / h1:>6.2f} | "
              f"{on:>11,.0f} {hn:>11,.0f} {on / hn:>6.2f}")
    os.unlink(corpus_file)


if __name__ == "__main__":
    main()
