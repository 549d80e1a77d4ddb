"""Where a CPU training step's time goes, lora-train against transformers + PEFT: both sides traced by
LibTorch's profiler (lora-train's train.profile_steps, torch.profiler in the reference) over the same
steps, each operator's self time summed per kind of work, per step.

usage: .venv/bin/python bench/train/profile_bench.py BUILD_DIR WORK_DIR [smollm2|tiny] [STEPS]

smollm2 (default): SmolLM2-135M-Instruct (the Q4_1 GGUF scripts/fetch-models keeps, dequantised to
fp32 on both sides), 8 sequences of 128 tokens a step. tiny: bench/train/bench.py's random llama
(hidden 256, 4 layers), 4 sequences of 256 tokens. Both: LoRA r=16 alpha=32 on every linear layer,
AdamW, clipping at 1.0, one process with 2 threads each side. Two steps warm up, then STEPS (default
3) are traced. Kinds: GEMMs split into the base's and LoRA's (an operand with a dimension of r),
attention, the loss, the optimizer (clipping, AdamW and zero_grad: the "optimizer" scope both sides
record), autograd's own bookkeeping (its engine and nodes), copies and allocation, other elementwise
work (norms, rope, activations, dropout, sums), and the step time no operator covers (the host
language between operators: Python on PEFT's side). The intra-op threads' idle time is inside the
operators' times. Prints the table (ms a step; ours / PEFT), then each side's costliest operators.
Each trace stays in WORK_DIR (Perfetto opens it).
"""
import json
import os
import re
import subprocess
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import THREADS, make_assets  # noqa: E402
from dora_bench import SMOLLM2, loading, run_ours  # noqa: E402

RANK = 16
WARM = 2  # lora-train's train.profile_steps traces after its first two steps
SHAPES = {"smollm2": (8, 128), "tiny": (4, 256)}  # sequences a step, tokens a sequence

KINDS = ["GEMM, base", "GEMM, LoRA", "attention", "loss", "optimizer", "autograd engine", "copies, allocation",
         "elementwise, norms, rope", "collectives", "outside operators"]
LOSS = re.compile(r"cross_entropy|log_softmax|nll_loss")  # lorarun::softmax_cross_entropy too
ATTENTION = re.compile(r"scaled_dot_product|flash_attention|efficient_attention")
GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"}
COPY = re.compile(r"^aten::(empty|empty_strided|empty_like|zeros|zeros_like|ones_like|full|copy_|clone|_to_copy|to|"
                  r"contiguous|cat|stack|new_empty|new_empty_strided|new_zeros|resize_|fill_|zero_|detach|"
                  r"index_select|embedding.*)$")
ENGINE = re.compile(r"^autograd::|Backward\d*$|^torch::autograd::")
COLLECTIVE = re.compile(r"c10d|gloo|nccl|allreduce|all_reduce", re.I)


def kind_of(event, ancestors):
    name = event["name"]
    if any(a == "optimizer" or a.startswith("Optimizer.") for a in ancestors):
        return "optimizer"
    if COLLECTIVE.search(name):
        return "collectives"
    if name in GEMM:
        dims = [d for shape in event.get("args", {}).get("Input Dims", []) for d in (shape or [])]
        return "GEMM, LoRA" if RANK in dims else "GEMM, base"
    if ATTENTION.search(name) or any(ATTENTION.search(a) for a in ancestors):
        return "attention"
    if LOSS.search(name) or any(LOSS.search(a) for a in ancestors):
        return "loss"
    if ENGINE.search(name):
        return "autograd engine"
    if COPY.match(name):
        return "copies, allocation"
    return "elementwise, norms, rope"


def self_times(trace):
    """{kind: µs}, {operator: µs} summed over the trace; each event's self time is its duration less
    its children's on the same thread."""
    events = [e for e in json.load(open(trace))["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    kinds, ops = defaultdict(float), defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, children's µs]
        def close(until):
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= until:
                e, children = stack.pop()
                own = max(e["dur"] - children, 0.0)
                if e.get("cat") == "cpu_op":
                    kinds[kind_of(e, [s[0]["name"] for s in stack])] += own
                    ops[e["name"]] += own
                if stack:
                    stack[-1][1] += e["dur"]
        for e in evs:
            close(e["ts"])
            stack.append([e, 0.0])
        close(float("inf"))
    return kinds, ops


def ours(build, work, model, data, shape, steps):
    out, rows = run_ours(build, work, "ours", model, data, shape, WARM + steps, train=f", profile_steps: {steps}")
    return os.path.join(out, "profile", "rank_0.json"), sum(r["seconds"] for r in rows[WARM:WARM + steps])


def reference(work, model, data, shape, steps):
    batch, seq = shape
    load = loading(model)
    trace = os.path.join(work, "peft.json")
    code = f"""
import json, time, torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads({THREADS})
tok = {load[1]}
seqs = [tok.encode(json.loads(line)["text"]).ids[:{seq}] for line in open({data!r})]
model = get_peft_model({load[0]}, LoraConfig(r={RANK}, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
model.train()
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4)
prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
seconds = 0.0
for s in range({WARM + steps}):
    if s == {WARM}:
        prof.start()
    ids = torch.tensor(seqs[s * {batch}:(s + 1) * {batch}])
    t0 = time.perf_counter()
    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    with record_function("optimizer"):
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
    if s >= {WARM}:
        seconds += time.perf_counter() - t0
prof.stop()
prof.export_chrome_trace({trace!r})
print(seconds)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return trace, float(out.strip().splitlines()[-1])


def main():
    build, work = sys.argv[1], sys.argv[2]
    which = sys.argv[3] if len(sys.argv) > 3 else "smollm2"
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    os.makedirs(work, exist_ok=True)
    model, data = make_assets(work)
    if which == "smollm2":
        model = SMOLLM2
    sides = {"ours": ours(build, work, model, data, SHAPES[which], steps),
             "PEFT": reference(work, model, data, SHAPES[which], steps)}
    table, top = {}, {}
    for side, (trace, seconds) in sides.items():
        kinds, ops = self_times(trace)
        kinds["outside operators"] = max(seconds * 1e6 - sum(kinds.values()), 0.0)
        table[side] = {k: kinds.get(k, 0.0) / 1e3 / steps for k in KINDS}  # ms a step
        top[side] = sorted(ops.items(), key=lambda kv: -kv[1])[:12]
    print(f"{which}: {SHAPES[which][0]} x {SHAPES[which][1]} tokens a step, r {RANK} on every linear, fp32, "
          f"{THREADS} threads; ms a step (self time), {steps} traced steps")
    print("| kind | ours | PEFT | ours / PEFT |\n|---|---|---|---|")
    for k in KINDS + ["step"]:
        o = sum(table["ours"].values()) if k == "step" else table["ours"][k]
        p = sum(table["PEFT"].values()) if k == "step" else table["PEFT"][k]
        print(f"| {k} | {o:.1f} | {p:.1f} | {o / p:.2f} |" if p else f"| {k} | {o:.1f} | {p:.1f} | - |")
    for side, rows in top.items():
        print(f"\n{side}: costliest operators (self ms a step)")
        for name, us in rows:
            print(f"  {us / 1e3 / steps:9.1f}  {name}")


if __name__ == "__main__":
    main()
