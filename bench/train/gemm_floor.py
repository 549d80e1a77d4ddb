"""The matrix products of one LoRA training step, timed alone: the floor under any step on this CPU.

usage: .venv/bin/python bench/train/gemm_floor.py WORK_DIR [smollm2|tiny] [REPEATS]

Both lora-train and transformers + PEFT must run these products in every step, with the same
kernels (LibTorch's MKL sgemm, its CPU flash attention): per decoder linear the base forward
x W^T and the input gradient dY W (none for the first layer's q/k/v, whose input needs no
gradient), LoRA's x A^T, (xA^T) B^T, dB, dA and the input gradient through A, the attention's
forward and backward (k and v repeated per query head, as transformers does), and the output
projection with its input gradient over the trained rows. Each is timed on its own with fresh
random operands, 2 threads, in float32, at speed_bench's shapes, so caches are warmer than inside a
step: the sum is a lower bound on the step, and PEFT's step / this floor is an upper bound on the
ratio speed_bench can show. Prints each part and the sum (median over REPEATS, default 5).
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import THREADS, make_assets  # noqa: E402
from dora_bench import SMOLLM2  # noqa: E402
from profile_bench import RANK, SHAPES  # noqa: E402

LINEARS = ["q", "k", "v", "o", "gate", "up", "down"]


def config(model):
    from transformers import AutoConfig
    if model.endswith(".gguf"):
        return AutoConfig.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model))
    return AutoConfig.from_pretrained(model)


def seconds(fn, reps=3):
    """Median seconds of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def linear_parts(m, i, o, input_grad):
    """(base seconds, LoRA seconds) of one linear [i -> o] over m rows, forward and backward."""
    x, w, dy = torch.randn(m, i), torch.randn(o, i), torch.randn(m, o)
    a, b = torch.randn(RANK, i), torch.randn(o, RANK)
    base = seconds(lambda: F.linear(x, w)) + (seconds(lambda: dy @ w) if input_grad else 0.0)
    xa, dxa = x @ a.t(), dy @ b
    lora = seconds(lambda: (F.linear(xa, b), x @ a.t()))  # forward: x A^T, then (x A^T) B^T
    lora += seconds(lambda: (dy.t() @ xa, dy @ b, dxa.t() @ x))  # dB, d(x A^T), dA
    if input_grad:
        lora += seconds(lambda: dxa @ a)
    return base, lora


def attention_seconds(c, batch, seq):
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    q = torch.randn(batch, heads, seq, hd, requires_grad=True)
    k = torch.randn(batch, kv, seq, hd, requires_grad=True)
    v = torch.randn(batch, kv, seq, hd, requires_grad=True)
    g = torch.randn(batch, heads, seq, hd)

    def step():
        rep = heads // kv
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             is_causal=True)
        out.backward(g)
    return seconds(step)


def floor(model, shape):
    """{part: seconds} of one step's products for `model` (a HF dir or GGUF) at `shape`."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    c = config(model)
    batch, seq = shape
    m = batch * seq
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, f = c.hidden_size, c.intermediate_size
    dims = {"q": (h, c.num_attention_heads * hd), "k": (h, c.num_key_value_heads * hd),
            "v": (h, c.num_key_value_heads * hd), "o": (c.num_attention_heads * hd, h), "gate": (h, f), "up": (h, f),
            "down": (f, h)}
    parts = {"base linears": 0.0, "LoRA": 0.0}
    for name in LINEARS:  # the first layer's q/k/v need no input gradient
        first = linear_parts(m, *dims[name], input_grad=name not in ("q", "k", "v"))
        rest = linear_parts(m, *dims[name], input_grad=True)
        parts["base linears"] += first[0] + rest[0] * (c.num_hidden_layers - 1)
        parts["LoRA"] += first[1] + rest[1] * (c.num_hidden_layers - 1)
    parts["attention"] = attention_seconds(c, batch, seq) * c.num_hidden_layers
    rows = batch * (seq - 1)
    hs, head, dz = torch.randn(rows, h), torch.randn(c.vocab_size, h), torch.randn(rows, c.vocab_size)
    parts["output projection"] = seconds(lambda: F.linear(hs, head)) + seconds(lambda: dz @ head)
    return parts


def median_floor(model, shape, repeats):
    runs = [floor(model, shape) for _ in range(repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    totals = [sum(r.values()) for r in runs]
    return med, statistics.median(totals), (min(totals), max(totals))


def main():
    work = sys.argv[1]
    which = sys.argv[2] if len(sys.argv) > 2 else "smollm2"
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    os.makedirs(work, exist_ok=True)
    model = SMOLLM2 if which == "smollm2" else make_assets(work)[0]
    med, total, (lo, hi) = median_floor(model, SHAPES[which], repeats)
    for k, v in med.items():
        print(f"{k}: {v:.3f} s")
    print(f"{which} ({SHAPES[which][0]} x {SHAPES[which][1]} tokens): the step's products alone {total:.3f} s "
          f"(spread {lo:.3f}-{hi:.3f}, {repeats} repeats)")


if __name__ == "__main__":
    main()
