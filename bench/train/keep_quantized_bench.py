"""model.keep_quantized on CPU: base bytes, peak RSS and step time of training on SmolLM2-135M-Instruct's
Q4_1 GGUF (the file scripts/fetch-models keeps) held as its own blocks, against the same file
dequantised at load to fp32 and to bf16, and quantised again to NF4 (QLoRA), in one run.

usage: .venv/bin/python bench/train/keep_quantized_bench.py BUILD_DIR WORK_DIR [REPEATS] [STEPS]

Each run: one rank (lora-train, 2 intra-op threads), LoRA r=8 on all linear layers, batch 1 x 128
tokens, STEPS optimizer steps (default 6); its step time is the median after the first two steps.
The variants run interleaved, REPEATS times (default 3): the table gives, per variant, the median
over the repeats and their range. base MiB is metrics.jsonl's base_mb (the base weight bytes the
rank holds, embedding and norms included); peak RSS is the rank's high-water mark, load included.
Ratios are against fp32 dequantised at load (step time: the variant's median / fp32's median).
Prints one JSON line per run, then the table.
"""
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, ".fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

VARIANTS = {  # name: overrides
    "fp32 (dequantised at load)": ["model.dtype=fp32"],
    "bf16 (dequantised at load)": ["model.dtype=bf16"],
    "NF4 (QLoRA, fp32 compute)": ["model.dtype=fp32", "lora.quantize_base=true"],
    "keep_quantized, fp32": ["model.dtype=fp32", "model.keep_quantized=true"],
    "keep_quantized, bf16": ["model.dtype=bf16", "model.keep_quantized=true"],
}


def run(build, work, name, overrides, steps, repeat):
    out = os.path.join(work, f"{len(os.listdir(work))}-r{repeat}")
    cmd = [os.path.join(build, "bin/lora-train"), os.path.join(work, "r.yaml"), *overrides,
           f"checkpoint.output_dir={out}", f"train.max_steps_per_epoch={steps}"]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"run failed: {' '.join(cmd)}\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    return {"variant": name, "repeat": repeat, "base_mb": rows[-1]["base_mb"],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rows),
            "step_s": statistics.median(r["seconds"] for r in rows[2:]), "loss": [r["loss"] for r in rows]}


def main():
    build, work = sys.argv[1], sys.argv[2]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    if not os.path.exists(MODEL):
        sys.exit(f"{MODEL} is missing: run scripts/fetch-models")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "data.jsonl"), "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": " ".join(f"word{(i * 7 + j) % 113}" for j in range(200))}) + "\n")
    with open(os.path.join(work, "r.yaml"), "w") as f:
        f.write(f"model: {{path: {MODEL}, device: cpu}}\n"
                "lora: {r: 8, alpha: 16, target_modules: all-linear}\n"
                f"data: {{source: jsonl, path: {work}/data.jsonl, format: text, batch_size: 1, max_length: 128, "
                "overlong: truncate, shuffle: none}\n"
                "train: {epochs: 1, lr: 1.0e-4}\n"
                "checkpoint: {epochs_to_save: none}\n"
                "track: {mongodb: false}\n")
    results = {name: [] for name in VARIANTS}
    for repeat in range(repeats):
        for name, overrides in VARIANTS.items():
            r = run(build, work, name, overrides, steps, repeat)
            print(json.dumps(r), flush=True)
            results[name].append(r)

    def med(name, key):
        return statistics.median(r[key] for r in results[name])

    ref = next(iter(VARIANTS))
    print(f"\n{repeats} runs each, {steps} steps of 1 x 128 tokens; ratios against {ref}")
    print("| base | base MiB | x fp32 | peak RSS MiB | x fp32 | step s (median, range) | x fp32 |")
    print("|---|---|---|---|---|---|---|")
    for name in VARIANTS:
        steps_s = [r["step_s"] for r in results[name]]
        print(f"| {name} | {med(name, 'base_mb'):.1f} | {med(name, 'base_mb') / med(ref, 'base_mb'):.3f} "
              f"| {med(name, 'peak_rss_mb'):.0f} | {med(name, 'peak_rss_mb') / med(ref, 'peak_rss_mb'):.3f} "
              f"| {med(name, 'step_s'):.3f} ({min(steps_s):.3f}-{max(steps_s):.3f}) "
              f"| {med(name, 'step_s') / med(ref, 'step_s'):.2f} |")


if __name__ == "__main__":
    main()
