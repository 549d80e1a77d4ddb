"""dist.shard_base on CPU (Gloo): per-rank base-weight bytes, resident memory and step time for 1, 2 and 3
ranks, without sharding and with it (the next block's gather started ahead, and not), on
SmolLM2-135M-Instruct (the Q4_1 GGUF scripts/fetch-models keeps, dequantised to fp32: 135M
parameters, 30 decoder blocks), in one run; on 2 ranks also with activation checkpointing.

usage: .venv/bin/python bench/train/shard_base_bench.py BUILD_DIR WORK_DIR [STEPS]

Each run: LoRA r=8 on all linear layers, batch 1 per rank, 128-token documents, STEPS optimizer
steps (default 6); step time is the median after the first two steps. Base bytes are what rank 0
holds: at start (its log line) and the most while training (slices + blocks gathered whole,
metrics.jsonl base_mb); RSS is rank 0's resident memory while it trains (the largest after a step,
the first step excluded) and peak RSS its high-water mark, load included (both from
metrics.jsonl). Prints one JSON line per run, then a table.
"""
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, ".fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def run(build, work, world, variant, steps, extra=()):
    out = os.path.join(work, f"w{world}-{variant}{'-' + '-'.join(extra) if extra else ''}")
    recipe = os.path.join(work, "r.yaml")
    shard = variant != "whole"
    cmd = [os.path.join(build, "bin/lorarun"), "--nproc-per-node", str(world), recipe,
           f"dist.shard_base={'true' if shard else 'false'}",
           f"dist.shard_base_prefetch={'false' if variant == 'no-prefetch' else 'true'}",
           f"checkpoint.output_dir={out}", "checkpoint.overwrite=true", f"train.max_steps_per_epoch={steps}", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"run failed: {' '.join(cmd)}\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    m = re.search(r"base weights on this rank ([0-9.]+) MiB of ([0-9.]+) MiB", p.stdout)
    return {"world": world, "variant": variant + (" " + " ".join(extra) if extra else ""),
            "base_mib_rank0": float(m.group(1)) if m else None,
            "base_mib_whole": float(m.group(2)) if m else None,
            "base_mib_peak_rank0": max(r["base_mb"] for r in rows) if shard else None,
            "peak_rss_mb_rank0": max(r["peak_rss_mb"] for r in rows),
            "rss_mb_rank0": max(r["rss_mb"] for r in rows[1:]),
            "step_s": statistics.median(r["seconds"] for r in rows[2:]) if len(rows) > 2 else rows[-1]["seconds"]}


def main():
    build, work = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    if not os.path.exists(MODEL):
        sys.exit(f"{MODEL} is missing: run scripts/fetch-models")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "data.jsonl"), "w") as f:
        for i in range(96):
            f.write(json.dumps({"text": " ".join(f"word{(i * 7 + j) % 113}" for j in range(200))}) + "\n")
    with open(os.path.join(work, "r.yaml"), "w") as f:
        f.write(f"model: {{path: {MODEL}, dtype: fp32, device: cpu}}\n"
                "lora: {r: 8, alpha: 16, target_modules: all-linear}\n"
                f"data: {{source: jsonl, path: {work}/data.jsonl, format: text, batch_size: 1, max_length: 128, "
                "overlong: truncate}\n"
                "train: {epochs: 1, lr: 1.0e-4}\n"
                "track: {mongodb: false}\n")
    ckpt = ("train.activation_checkpointing=true",)
    runs = [(1, "whole", ()), (2, "whole", ()), (2, "prefetch", ()), (2, "no-prefetch", ()), (2, "whole", ckpt),
            (2, "prefetch", ckpt), (2, "no-prefetch", ckpt), (3, "whole", ()), (3, "prefetch", ()),
            (3, "no-prefetch", ())]
    results = []
    for world, variant, extra in runs:
        r = run(build, work, world, variant, steps, extra)
        print(json.dumps(r), flush=True)
        results.append(r)
    whole = next(r for r in results if r["base_mib_whole"])["base_mib_whole"]
    print(f"\nbase weights whole: {whole:.1f} MiB")
    print("| ranks | run | base MiB rank 0 at start | most while training | RSS MiB rank 0 (training) "
          "| peak RSS MiB rank 0 | step s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        base = r["base_mib_rank0"] or whole
        most = r["base_mib_peak_rank0"] or whole
        print(f"| {r['world']} | {r['variant']} | {base:.1f} | {most:.1f} | {r['rss_mb_rank0']:.0f} | "
              f"{r['peak_rss_mb_rank0']:.0f} | {r['step_s']:.3f} |")


if __name__ == "__main__":
    main()
