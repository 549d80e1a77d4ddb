"""Model load time and peak host memory: lora-train's loader vs transformers.from_pretrained,
right after loading and after a first forward pass (when every weight has been read).

Makes (once) a ~1 GB float32 llama fixture with transformers, then loads it in fresh processes,
alternating ours and the reference, and prints the medians and their ratios.

usage: bench.py --bench-bin build/bin/model_load_bench [--dir build/bench-fixtures/llama-1g] [--repeat 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "support")
sys.path.insert(0, SUPPORT)
import oracle  # noqa: E402  (tests/support/oracle.py: what the reference process reports, and nothing else)
# The reference processes report through it too.
CHILD = f"import sys; sys.path.insert(0, {SUPPORT!r}); import oracle\n"

REFERENCE = r"""
import json, sys, time
import torch, transformers

def hwm_mb():  # VmHWM: peak RSS of this address space (ru_maxrss survives exec, this does not)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

torch.ones(1)
base = hwm_mb()
t0 = time.perf_counter()
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
s = time.perf_counter() - t0
rss_loaded = hwm_mb()
with torch.no_grad():  # one forward of 16 tokens touches every weight
    m(input_ids=torch.arange(16).unsqueeze(0))
oracle.report(seconds=s, peak_rss_mb=rss_loaded, ready_seconds=time.perf_counter() - t0, ready_rss_mb=hwm_mb(),
              base_rss_mb=base, params=sum(p.numel() for p in m.parameters()))
"""


def make_fixture(d):
    if os.path.exists(os.path.join(d, "model.safetensors")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(d)


def run(cmd):
    """model_load_bench's result: its last line."""
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_reference(path):
    out = subprocess.run([sys.executable, "-c", CHILD + REFERENCE, path], check=True, capture_output=True, text=True)
    return oracle.reported(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-bin", required=True)
    ap.add_argument("--dir", default="build/bench-fixtures/llama-1g")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    make_fixture(a.dir)
    size = os.path.getsize(os.path.join(a.dir, "model.safetensors")) / 1e9
    ours, ref = [], []
    for _ in range(a.repeat):
        ours.append(run([a.bench_bin, a.dir]))
        ref.append(run_reference(a.dir))
    med = lambda rows, k: statistics.median(r[k] for r in rows)
    net = lambda rows: statistics.median(r["peak_rss_mb"] - r["base_rss_mb"] for r in rows)
    print(f"fixture: {a.dir} ({size:.2f} GB float32, {ours[0]['params']:,} parameters), {a.repeat} runs each, medians")
    print(f"{'':28}{'lorarun':>12}{'transformers':>14}{'ratio':>8}")
    print(f"{'load seconds':28}{med(ours, 'seconds'):>12.2f}{med(ref, 'seconds'):>14.2f}"
          f"{med(ref, 'seconds') / med(ours, 'seconds'):>7.2f}x")
    print(f"{'peak RSS MB':28}{med(ours, 'peak_rss_mb'):>12.0f}{med(ref, 'peak_rss_mb'):>14.0f}"
          f"{med(ref, 'peak_rss_mb') / med(ours, 'peak_rss_mb'):>7.2f}x")
    print(f"{'peak RSS above baseline MB':28}{net(ours):>12.0f}{net(ref):>14.0f}")
    print("after one 16-token forward (every weight touched):")
    print(f"{'seconds from start':28}{med(ours, 'ready_seconds'):>12.2f}{med(ref, 'ready_seconds'):>14.2f}"
          f"{med(ref, 'ready_seconds') / med(ours, 'ready_seconds'):>7.2f}x")
    print(f"{'peak RSS MB':28}{med(ours, 'ready_rss_mb'):>12.0f}{med(ref, 'ready_rss_mb'):>14.0f}"
          f"{med(ref, 'ready_rss_mb') / med(ours, 'ready_rss_mb'):>7.2f}x")


if __name__ == "__main__":
    main()
