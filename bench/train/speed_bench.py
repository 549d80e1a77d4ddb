"""CPU step time, lora-train against transformers + PEFT + torch AdamW on the same model and batches,
one process with 2 threads each side, the two run alternately REPEATS times.

usage: .venv/bin/python bench/train/speed_bench.py BUILD_DIR WORK_DIR [smollm2|tiny] [STEPS] [REPEATS]

smollm2 (default): SmolLM2-135M-Instruct (the Q4_1 GGUF scripts/fetch-models keeps, dequantised to
fp32 on both sides), 8 sequences of 128 tokens a step. tiny: bench/train/bench.py's random llama
(hidden 256, 4 layers), 4 sequences of 256 tokens. LoRA r=16 alpha=32 on every linear layer, no
dropout, AdamW, clipping at 1.0. A run's step time is its median over the steps after the first two
(STEPS in all, default 6); REPEATS defaults to 5. Prints each repeat, then PEFT's step time as a
multiple of ours: median and spread (min-max) over the repeats; then the step's matrix products
timed alone (gemm_floor.py) and PEFT's median step over them: the most any implementation on these
kernels could show.
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import make_assets  # noqa: E402
from dora_bench import SMOLLM2, ours, reference  # noqa: E402
from gemm_floor import median_floor  # noqa: E402
from profile_bench import SHAPES  # noqa: E402


def main():
    build, work = sys.argv[1], sys.argv[2]
    which = sys.argv[3] if len(sys.argv) > 3 else "smollm2"
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    os.makedirs(work, exist_ok=True)
    model, data = make_assets(work)
    if which == "smollm2":
        model = SMOLLM2
    shape = SHAPES[which]
    ratios, peft = [], []
    for rep in range(repeats):
        mine, _ = ours(build, work, model, data, False, steps, shape)
        theirs, _ = reference(model, data, False, steps, shape)
        ratios.append(theirs / mine)
        peft.append(theirs)
        print(f"repeat {rep}: step s: ours {mine:.3f}, PEFT {theirs:.3f}: PEFT / ours {theirs / mine:.2f}x", flush=True)
    print(f"{which} ({shape[0]} x {shape[1]} tokens a step, {steps} steps, {repeats} repeats): PEFT's step time / "
          f"ours: median {statistics.median(ratios):.2f}x (spread {min(ratios):.2f}-{max(ratios):.2f})")
    _, floor, (lo, hi) = median_floor(model, shape, 3)
    print(f"the step's products alone: {floor:.3f} s (spread {lo:.3f}-{hi:.3f}); PEFT's median step over them: "
          f"{statistics.median(peft) / floor:.2f}x, the most any implementation on these kernels could show")


if __name__ == "__main__":
    main()
