"""A mixture of experts on CPU: lora-train against transformers + PEFT on a tiny random qwen3_moe, and
the expert-grouped product (what lib/model/moe.cpp does) against a dense loop over every expert.

usage: .venv/bin/python bench/train/moe_bench.py BUILD_DIR WORK_DIR [STEPS [REPEATS]]

Training: qwen3_moe with hidden 256, 4 layers, 8 experts of 128 (top 2, renormalised), vocab ~2k,
fp32, 4 sequences of 256 tokens a step, LoRA r=16 alpha=32 on all-linear (PEFT's reading on a mixture
of experts: attention, routers, and per-expert adapters on both expert tensors, gate_up_proj at
rank 32), AdamW, no router loss, 1 process x 2 threads each, STEPS steps (default 10), REPEATS times
(default 3). Step time is the median over the steps after the first two; peak RSS the process's
high-water mark. transformers runs its default experts implementation (grouped_mm).

Expert compute: one MoE layer's forward and backward on 1024 tokens (hidden 256, 8 experts of 512,
top 2), in torch with lorarun's algorithm (sort the N·k assignments by expert once, one product per
expert on its rows, one index_add) against a dense loop (every expert on every token, weighted by
the router's zero-or-weight): the choice lorarun's code makes, on the same torch kernels.
Prints each repeat's figures, then the median and spread (min-max) of each ratio.
"""
import importlib.util
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import GLOBAL_BATCH, SEQ, THREADS, make_assets  # noqa: E402
from dora_bench import reference_run, run_ours  # noqa: E402

# gpu-check's layer timing (lorarun's grouping vs the dense loop), loaded under a name of its own
_spec = importlib.util.spec_from_file_location(
    "gpu_bench", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "bench.py"))
gpu_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_bench)


def make_moe(work):
    """The tiny qwen3_moe (bench.py's tokenizer and texts) in WORK/qwen3_moe."""
    llama, data = make_assets(work)
    out = os.path.join(work, "qwen3_moe")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out, data
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    os.makedirs(out, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(llama, f)) as src, open(os.path.join(out, f), "w") as dst:
            dst.write(src.read())
    eos = json.load(open(os.path.join(llama, "config.json")))["eos_token_id"]
    vocab = json.load(open(os.path.join(llama, "config.json")))["vocab_size"]
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=256, intermediate_size=704, moe_intermediate_size=128,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=512,
                         bos_token_id=eos, eos_token_id=eos)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers away from uniform, as trained ones are
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out, data


def main():
    build, work = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    os.makedirs(work, exist_ok=True)
    model_dir, data = make_moe(work)
    torch.set_num_threads(THREADS)
    shape = (GLOBAL_BATCH, SEQ)
    ratios = {k: [] for k in ("PEFT/ours step time", "PEFT/ours peak RSS", "dense loop/grouped layer time")}
    for rep in range(repeats):
        _, rows = run_ours(build, work, "ours-moe", model_dir, data, shape, steps)
        ot, orss = statistics.median(r["seconds"] for r in rows[2:]), max(r["peak_rss_mb"] for r in rows)
        times, _, prss = reference_run(model_dir, data, False, steps, shape)
        pt = statistics.median(times[2:])
        layer = dict(n=1024, hidden=256, inter=512, experts=8, k=2, reps=20)
        gt, dt = (gpu_bench.moe_layer_seconds(torch.device("cpu"), g, **layer) for g in (True, False))
        print(f"repeat {rep}: step s: ours {ot:.3f}, PEFT {pt:.3f}; peak RSS MB: ours {orss:.0f}, PEFT {prss:.0f}; "
              f"MoE layer fwd+bwd s: grouped {gt:.4f}, dense loop {dt:.4f}")
        for k, v in zip(ratios, (pt / ot, prss / orss, dt / gt)):
            ratios[k].append(v)
    for k, v in ratios.items():
        print(f"{k:32} median {statistics.median(v):.2f}x  (spread {min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
