#!/usr/bin/env python3
"""How the data path's start-up, memory and rate grow with the collection: lorarun's ShardReader
(build/bin/data_bench) on collections of growing size, at 1, 2 and 4 ranks run side by side.

  .venv/bin/python bench/data/scale_bench.py --bench-bin build/bin/data_bench --uri mongodb://… \
      [--sizes 100000,1000000] [--worlds 1,2,4] [--modes global,none] [--read 512]

Each size is a collection lorarun_bench.scale_<N> of N small Alpaca documents (written once with
pymongo's insert_many, kept when it already holds N). For each mode and world size W, W data_bench
processes (ranks 0..W-1) start together and each reads its first --read documents. Per rank:
start-up seconds (selection, id listing, order, first chunk delivered), the resident memory the
start-up added (anonymous and file-backed MiB, after malloc_trim), and documents/s after start-up.
Printed: one JSON line per run, then per size and mode the medians over ranks, and the growth of
start-up and memory between the smallest and the largest size (a growth law: 1.0 per tenfold of
documents is linear). The reference is the server itself: pymongo listing the sorted ids of each
size, timed in the same run (what any client pays to know the selection).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from pymongo import MongoClient

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def ensure(coll, n):
    if coll.estimated_document_count() == n:
        return 0.0
    coll.drop()
    t = time.perf_counter()
    for s in range(0, n, 10000):
        coll.insert_many([{"instruction": f"Repeat the number {i}.", "input": "", "output": f"{i}"}
                          for i in range(s, min(n, s + 10000))], ordered=False)
    return time.perf_counter() - t


def run_world(args, coll, mode, world):
    procs = [subprocess.Popen([args.bench_bin, args.uri, "lorarun_bench", coll, args.tokenizer, mode, "4",
                               f"world={world}", f"rank={r}", f"max={args.read}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    out = []
    for r, p in enumerate(procs):
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            sys.exit(f"scale_bench: data_bench rank {r} failed: {stderr.strip()}")
        row = json.loads(stdout.strip().splitlines()[-1])
        row["rate"] = row["documents"] / max(row["seconds"] - row["startup_seconds"], 1e-9)
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-bin", default=os.path.join(ROOT, "build", "bin", "data_bench"))
    ap.add_argument("--uri", required=True)
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, ".fixtures", "tokenizers", "llama3"))
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--modes", default="global,none")
    ap.add_argument("--read", type=int, default=512)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    db = MongoClient(args.uri)["lorarun_bench"]
    summary = {}
    for n in sizes:
        coll = f"scale_{n}"
        loaded = ensure(db[coll], n)
        t = time.perf_counter()
        listed = sum(1 for _ in db[coll].find({}, {"_id": 1}).sort("_id", 1))
        ref = time.perf_counter() - t
        print(json.dumps({"documents": n, "insert_seconds": round(loaded, 1), "pymongo_list_seconds": round(ref, 2),
                          "listed": listed}), flush=True)
        for mode in args.modes.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                rows = run_world(args, coll, mode, world)
                for r, row in enumerate(rows):
                    print(json.dumps({"documents": n, "mode": mode, "world": world, "rank": r, **row}), flush=True)
                med = {k: statistics.median(row[k] for row in rows)
                       for k in ("startup_seconds", "order_anon_mib", "order_file_mib", "rate")}
                summary[(n, mode, world)] = {**med, "ref": ref}
    print()
    print(f"{'documents':>10} {'mode':>7} {'ranks':>5} {'start-up s':>10} {'pymongo list s':>14} "
          f"{'order anon MiB':>14} {'file MiB':>8} {'docs/s':>8}")
    for (n, mode, world), m in summary.items():
        print(f"{n:>10} {mode:>7} {world:>5} {m['startup_seconds']:>10.2f} {m['ref']:>14.2f} "
              f"{m['order_anon_mib']:>14.1f} {m['order_file_mib']:>8.1f} {m['rate']:>8.0f}")
    lo, hi = min(sizes), max(sizes)
    if hi > lo:
        print(f"\ngrowth from {lo} to {hi} documents (exponent of the size: 1.0 is linear)")
        for (n, mode, world), m in summary.items():
            if n != hi or (lo, mode, world) not in summary:
                continue
            base = summary[(lo, mode, world)]
            law = lambda a, b: math.log(b / a) / math.log(hi / lo) if a > 0 and b > 0 else float("nan")
            print(f"  {mode} x{world}: start-up {law(base['startup_seconds'], m['startup_seconds']):.2f}, "
                  f"anonymous memory {law(base['order_anon_mib'], m['order_anon_mib']):.2f}")


if __name__ == "__main__":
    main()
