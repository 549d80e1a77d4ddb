"""bf16 against fp32 on CPU: lora-train's step time and loss curve with the base held in bf16 and in
fp32, and the same for transformers + PEFT, on SmolLM2-135M-Instruct, in one run, REPEATS times.

usage: .venv/bin/python bench/train/bf16_bench.py BUILD_DIR WORK_DIR [STEPS (default 8)] [EPOCHS (default 2)] [REPEATS (default 3)]

SmolLM2 (the Q4_1 GGUF scripts/fetch-models keeps, dequantised at load to the dtype on both sides),
8 sequences of 128 tokens a step, LoRA r=16 alpha=32 on every linear (the adapter in fp32 on both
sides), AdamW at 1e-4, clipping at 1.0, one process with 2 threads; EPOCHS passes over the same
STEPS batches in file order, so that the four curves see the same tokens. A run's step time is the
median over its steps after the first two. Prints each repeat's step times, then bf16's step time
as a multiple of fp32's (median and spread over the repeats) for each side, and the loss curves of
the first repeat with the largest |bf16 - fp32| on each side.
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import make_assets  # noqa: E402
from dora_bench import SMOLLM2, reference_run, run_ours  # noqa: E402
from profile_bench import SHAPES  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # the recipe's name: torch's


def ours(build, work, data, dtype, steps, epochs):
    """(step seconds, losses) of lora-train with the base in `dtype`."""
    _, rows = run_ours(build, work, f"ours-{dtype}", SMOLLM2, data, SHAPES["smollm2"], steps,
                       dtype=dtype, data_keys=", shuffle: none", epochs=epochs)
    return [r["seconds"] for r in rows], [r["loss"] for r in rows]


def main():
    build, work = sys.argv[1], sys.argv[2]
    steps, epochs, repeats = (int(a) for a in (sys.argv[3:] + ["8", "2", "3"][len(sys.argv) - 3:])[:3])
    os.makedirs(work, exist_ok=True)
    _, data = make_assets(work)
    times = {(side, d): [] for side in ("ours", "PEFT") for d in DTYPES}
    curves = {}
    for rep in range(repeats):
        for d, torch_dtype in DTYPES.items():
            t, losses = ours(build, work, data, d, steps, epochs)
            times["ours", d].append(statistics.median(t[2:]))
            curves.setdefault(("ours", d), losses)
            t, losses, _ = reference_run(SMOLLM2, data, False, steps, SHAPES["smollm2"], torch_dtype, epochs)
            times["PEFT", d].append(statistics.median(t[2:]))
            curves.setdefault(("PEFT", d), losses)
        print(f"repeat {rep}: step s: " + ", ".join(f"{s} {d} {v[-1]:.3f}" for (s, d), v in times.items()), flush=True)
    for side in ("ours", "PEFT"):
        r = [b / f for b, f in zip(times[side, "bf16"], times[side, "fp32"])]
        print(f"{side}: bf16 step / fp32 step: median {statistics.median(r):.2f}x (spread {min(r):.2f}-{max(r):.2f})")
    r = [p / o for p, o in zip(times["PEFT", "bf16"], times["ours", "bf16"])]
    print(f"bf16: PEFT's step / ours: median {statistics.median(r):.2f}x (spread {min(r):.2f}-{max(r):.2f})")
    print("\n| step | " + " | ".join(f"{s} {d}" for s, d in curves) + " |\n" + "|---" * (len(curves) + 1) + "|")
    for i, row in enumerate(zip(*curves.values())):
        print(f"| {i} | " + " | ".join(f"{v:.4f}" for v in row) + " |")
    for side in ("ours", "PEFT"):
        gap = [abs(b - f) for b, f in zip(curves[side, "bf16"], curves[side, "fp32"])]
        print(f"{side}: |bf16 - fp32| loss: largest {max(gap):.4f} (step {gap.index(max(gap))}), last {gap[-1]:.4f}")


if __name__ == "__main__":
    main()
