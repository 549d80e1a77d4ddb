"""adapters: (many adapters on one base in one job) on CPU: the wall time of one job training N
adapters on SmolLM2-135M-Instruct (the Q4_1 GGUF scripts/fetch-models keeps, in bf16) against the
same N adapters trained by their own runs one after another, and the job's peak RSS against one
own run's, in one run of this script.

usage: .venv/bin/python bench/train/adapters_bench.py BUILD_DIR WORK_DIR [REPEATS] [TENANTS...]

Each adapter: 16 documents of its own (about 60 tokens each), LoRA r=8 on every linear, batch 2,
1 epoch (8 optimizer steps), one rank (lora-train, 2 intra-op threads). The job trains TENANTS
adapters (default 4 and 8) from one JSONL file per adapter (adapters.list); "own runs" are the
same adapters' recipes (the job's without adapters:, each one's file) run one after another. Wall
times and peak RSS are whole processes' (loading the model and saving the adapters included).
With the activations kept and with activation checkpointing (the job in passes of one adapter,
the CPU default), and with every adapter in one pass (adapters.per_pass: all, the GPU default, its
own runs as the first variant's). The variants run interleaved,
REPEATS times (default 3): the table gives medians and ranges, and checks that every adapter of the
job is its own run's bit for bit.
Prints one JSON line per measurement, then the table.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# variant: (overrides of the job and the own runs, of the job alone)
VARIANTS = {
    "activations kept": ([], []),
    "activation checkpointing": (["train.activation_checkpointing=true"], []),
    "activations kept, one pass of all": ([], ["adapters.per_pass=64"]),
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, ".fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
WORDS = ["red", "blue", "chair", "lamp", "table", "green", "rug", "yellow", "order", "code"]


def write_tenant(work, t):
    path = os.path.join(work, f"t{t}.jsonl")
    with open(path, "w") as f:
        for i in range(16):
            words = " ".join(WORDS[(i * 3 + j * (t + 1)) % len(WORDS)] for j in range(24))
            f.write(json.dumps({"instruction": f"Tenant {t} item {i}: {words}", "output": f"T{t}-{i * 7 % 13} {words}"})
                    + "\n")
    return path


def recipe(work, name, data_path, adapters=None):
    path = os.path.join(work, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(f"model: {{path: {MODEL}, dtype: bf16, device: cpu}}\n"
                "lora: {r: 8, alpha: 16, target_modules: all-linear}\n"
                f"data: {{source: jsonl, {f'path: {data_path}, ' if data_path else ''}format: instruction, "
                "prompt_template: \"Q: {instruction}\\nA: \", batch_size: 2, max_length: 128}\n"
                "train: {epochs: 1, lr: 1.0e-4}\n"
                "checkpoint: {overwrite: true}\n"
                "track: {mongodb: false}\n")
        if adapters:
            f.write("adapters: {list: [" + ", ".join(f"{{name: {n}, path: {p}}}" for n, p in adapters) + "]}\n")
    return path


def run(build, recipe_path, out, overrides):
    """The run's wall time and its process's peak RSS in MiB (its whole life: loading, steps, saving)."""
    cmd = [os.path.join(build, "bin/lora-train"), recipe_path, f"checkpoint.output_dir={out}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    with tempfile.TemporaryFile() as log:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.monotonic() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            log.seek(0)
            sys.exit(f"run failed: {' '.join(cmd)}\n{log.read()[-6000:].decode(errors='replace')}")
    return wall, usage.ru_maxrss / 1024


def same_files(a, b):
    with open(a, "rb") as x, open(b, "rb") as y:
        return x.read() == y.read()


def main():
    build, work = sys.argv[1], sys.argv[2]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    tenants = [int(n) for n in sys.argv[4:]] or [4, 8]
    if not os.path.exists(MODEL):
        sys.exit(f"{MODEL} is missing: run scripts/fetch-models")
    os.makedirs(work, exist_ok=True)
    paths = [write_tenant(work, t) for t in range(max(tenants))]
    keys = [(v, n) for v in VARIANTS for n in tenants]
    results = {k: {"job": [], "own": [], "one_rss": [], "job_rss": [], "identical": True} for k in keys}
    for repeat in range(repeats):
        own_this_repeat = {}
        for variant, n in keys:
            overrides, job_only = VARIANTS[variant]
            names = [(f"t{t}", paths[t]) for t in range(n)]
            job_out = os.path.join(work, f"job{n}")
            job_wall, job_rss = run(build, recipe(work, f"job{n}", None, names), job_out, overrides + job_only)
            own_key = (tuple(overrides), n)
            if own_key not in own_this_repeat:  # own runs shared by variants that differ in the job alone
                own_wall, own_rss = 0.0, []
                for name, path in names:
                    w, rss = run(build, recipe(work, f"own-{len(own_this_repeat)}", path),
                                 os.path.join(work, f"own-{len(own_this_repeat)}-{name}"), overrides)
                    own_wall += w
                    own_rss.append(rss)
                own_this_repeat[own_key] = (own_wall, own_rss, len(own_this_repeat))
            own_wall, own_rss, own_index = own_this_repeat[own_key]
            for name, _ in names:
                a = os.path.join(job_out, name, "epoch_0", "adapter_model.safetensors")
                b = os.path.join(work, f"own-{own_index}-{name}", "epoch_0", "adapter_model.safetensors")
                results[(variant, n)]["identical"] &= same_files(a, b)
            r = results[(variant, n)]
            r["job"].append(job_wall), r["own"].append(own_wall)
            r["job_rss"].append(job_rss), r["one_rss"].append(statistics.median(own_rss))
            print(json.dumps({"variant": variant, "adapters": n, "repeat": repeat, "job_s": job_wall,
                              "own_runs_s": own_wall, "job_peak_rss_mb": job_rss, "own_peak_rss_mb": own_rss}),
                  flush=True)

    def cell(values):
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    print(f"\n{repeats} runs each; SmolLM2-135M Q4_1 in bf16, 16 documents x batch 2 x 1 epoch per adapter, one rank")
    print("| variant | adapters | own runs, one after another: s | one job: s | x less wall time "
          "| one own run peak RSS MiB | job peak RSS MiB | x one own run | job = own runs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for variant, n in keys:
        r = results[(variant, n)]
        speed = [o / j for o, j in zip(r["own"], r["job"])]
        mem = [j / o for j, o in zip(r["job_rss"], r["one_rss"])]
        print(f"| {variant} | {n} | {cell(r['own'])} | {cell(r['job'])} | {statistics.median(speed):.2f} "
              f"({min(speed):.2f}-{max(speed):.2f}) | {statistics.median(r['one_rss']):.0f} "
              f"| {statistics.median(r['job_rss']):.0f} | {statistics.median(mem):.2f} "
              f"| {'bit for bit' if r['identical'] else 'DIFFERENT'} |")


if __name__ == "__main__":
    main()
