"""Preference training on CPU: lora-train's DPO, SimPO and KTO steps against an SFT step of the same
model and batch (time and peak memory: DPO's and KTO's reference is the same model with its adapters
off, never a second copy; SimPO has none), DPO and KTO with preference.precompute_reference (their
step, and the pass before training that computes the reference log-probs), and DPO and KTO against
TRL's DPOTrainer and KTOTrainer on the same documents, same torch, 2 threads each, in one run, REPEATS times.

usage: .venv/bin/python bench/train/dpo_bench.py BUILD_DIR WORK_DIR [STEPS [REPEATS]]

Config: bench/train/bench.py's random llama (hidden 256, 4 layers, vocab ~2k, fp32), 4 pairs a step,
prompts of ~96 tokens and completions of ~96 (chosen) and ~64 (rejected), LoRA r=16 alpha=32 on all
linear layers, constant LR. The SFT run trains the prompt + chosen sequences of the same pairs
(format: instruction, batch 4); the KTO run the pairs' answers as labelled examples (answers.jsonl:
each pair's chosen, labelled desirable, then its rejected), 4 a step. Step time is the median over the steps after the first two;
peak RSS the process's high-water mark (lora-train: metrics.jsonl's peak_rss_mb; TRL: ru_maxrss of
its own process). Prints each repeat's figures, then the median and spread (min-max) of each ratio.
"""
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import make_assets  # noqa: E402  (the same model and vocabulary as bench.py)

BATCH, THREADS = 4, 2


def make_pairs(work, n):
    rng = random.Random(1)
    words = [line for line in open(os.path.join(work, "data.jsonl"))]
    text = " ".join(json.loads(w)["text"] for w in words).split()
    pick = lambda k: " ".join(rng.choice(text) for _ in range(k))  # noqa: E731
    path = os.path.join(work, "pairs.jsonl")
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": pick(40) + "\n", "chosen": pick(40), "rejected": pick(26)}) + "\n")
    with open(path) as f, open(os.path.join(work, "answers.jsonl"), "w") as out:
        for line in f:
            d = json.loads(line)
            for key, label in (("chosen", True), ("rejected", False)):
                out.write(json.dumps({"prompt": d["prompt"], "completion": d[key], "label": label}) + "\n")
    return path


def ours(build, work, model_dir, pairs, objective, steps, precompute=False):
    """Median step seconds, peak RSS (MB) and the seconds of the precompute pass (0 without it)."""
    out = os.path.join(work, f"ours-{objective}{'-pre' if precompute else ''}")
    recipe = os.path.join(work, f"{objective}.yaml")
    data = ("format: instruction, prompt_template: \"{prompt}\", response_field: chosen" if objective == "sft" else
            "format: unpaired" if objective == "kto" else "format: preference")
    if objective == "kto":
        pairs = os.path.join(work, "answers.jsonl")
    with open(recipe, "w") as f:
        f.write(f"""model: {{path: {model_dir}, dtype: fp32, device: cpu}}
lora: {{r: 16, alpha: 32, target_modules: all-linear}}
data: {{source: jsonl, path: {pairs}, {data}, shuffle: none, batch_size: {BATCH}, max_length: 512}}
train: {{objective: {objective}, epochs: 1, lr: 1.0e-4, max_steps_per_epoch: {steps}, lr_scheduler: constant}}
checkpoint: {{output_dir: {out}, resume: never, epochs_to_save: none, overwrite: true}}
track: {{mongodb: false}}
""")
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    extra = ["preference.precompute_reference=true"] if precompute else []
    run = subprocess.run([f"{build}/bin/lora-train", recipe, *extra], env=env, check=True, capture_output=True,
                         text=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    found = re.search(r"the reference's log-probs of \d+ examples of epoch \d+ in ([0-9.]+) s", run.stdout + run.stderr)
    assert found or not precompute, "no precompute pass reported"
    return (statistics.median(r["seconds"] for r in rows[2:]), max(r["peak_rss_mb"] for r in rows),
            float(found.group(1)) if found else 0.0)


TRL = r"""
import json, resource, statistics, sys, tempfile, time
import pyarrow as pa, torch
from datasets import Dataset
from datasets.table import InMemoryTable
from peft import LoraConfig
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
model_dir, pairs, steps, batch, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
kto = sys.argv[6] == "kto"
torch.set_num_threads(threads)
docs = [json.loads(l) for l in open(pairs)]
keys = ("prompt", "completion", "label") if kto else ("prompt", "chosen", "rejected")
ds = Dataset(InMemoryTable(pa.table({k: [d[k] for d in docs] for k in keys})), fingerprint="lorarun-dpo-bench")
tok = AutoTokenizer.from_pretrained(model_dir)
tok.pad_token = tok.pad_token or tok.eos_token
class InOrder(KTOTrainer if kto else DPOTrainer):
    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(self.train_dataset)
class Clock(TrainerCallback):
    times = []
    def on_step_begin(self, *a, **k): self.t0 = time.perf_counter()
    def on_step_end(self, *a, **k): self.times.append(time.perf_counter() - self.t0)
with tempfile.TemporaryDirectory() as out:
    args = (KTOConfig if kto else DPOConfig)(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-4,
                     lr_scheduler_type="constant", report_to="none", save_strategy="no", logging_steps=1000,
                     max_length=512, bf16=False, fp16=False, use_cpu=True, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    InOrder(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=peft,
            callbacks=[Clock()]).train()
print(json.dumps({"step_s": statistics.median(Clock.times[2:]),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def trl(model_dir, pairs, steps, kind="dpo"):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(TRL)
    run = subprocess.run([sys.executable, f.name, model_dir, pairs, str(steps), str(BATCH), str(THREADS), kind],
                         check=True, capture_output=True, text=True)
    os.unlink(f.name)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    return got["step_s"], got["peak_rss_mb"]


def main():
    build, work = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    os.makedirs(work, exist_ok=True)
    model_dir, _ = make_assets(work)
    pairs = make_pairs(work, steps * BATCH)
    ratios = {"DPO/SFT step time": [], "DPO/SFT peak RSS": [], "SimPO/SFT step time": [], "SimPO/SFT peak RSS": [],
              "KTO/SFT step time": [], "KTO/SFT peak RSS": [],
              "DPO precomputed/SFT step time": [], "DPO precomputed/SFT peak RSS": [],
              "DPO precompute pass/DPO steps' time": [],
              "KTO precomputed/SFT step time": [], "KTO precompute pass/KTO steps' time": [],
              "TRL/lora-train DPO step time": [], "TRL/lora-train DPO peak RSS": [],
              "TRL/lora-train KTO step time": [], "TRL/lora-train KTO peak RSS": []}
    for k in range(repeats):
        sft_s, sft_rss, _ = ours(build, work, model_dir, pairs, "sft", steps)
        dpo_s, dpo_rss, _ = ours(build, work, model_dir, pairs, "dpo", steps)
        pre_s, pre_rss, pre_pass = ours(build, work, model_dir, pairs, "dpo", steps, precompute=True)
        simpo_s, simpo_rss, _ = ours(build, work, model_dir, pairs, "simpo", steps)
        kto_s, kto_rss, _ = ours(build, work, model_dir, pairs, "kto", steps)
        kpre_s, _, kpre_pass = ours(build, work, model_dir, pairs, "kto", steps, precompute=True)
        trl_s, trl_rss = trl(model_dir, pairs, steps)
        trl_kto_s, trl_kto_rss = trl(model_dir, os.path.join(work, "answers.jsonl"), steps, "kto")
        print(f"repeat {k + 1}: lora-train SFT {sft_s * 1e3:.1f} ms/step {sft_rss:.0f} MB; "
              f"DPO {dpo_s * 1e3:.1f} ms/step {dpo_rss:.0f} MB; SimPO {simpo_s * 1e3:.1f} ms/step {simpo_rss:.0f} MB; "
              f"KTO {kto_s * 1e3:.1f} ms/step {kto_rss:.0f} MB; TRL DPO {trl_s * 1e3:.1f} ms/step {trl_rss:.0f} MB; "
              f"TRL KTO {trl_kto_s * 1e3:.1f} ms/step {trl_kto_rss:.0f} MB; DPO precomputed {pre_s * 1e3:.1f} "
              f"ms/step {pre_rss:.0f} MB after a {pre_pass:.2f} s pass; KTO precomputed {kpre_s * 1e3:.1f} ms/step "
              f"after a {kpre_pass:.2f} s pass",
              flush=True)
        ratios["DPO precomputed/SFT step time"].append(pre_s / sft_s)
        ratios["DPO precomputed/SFT peak RSS"].append(pre_rss / sft_rss)
        ratios["DPO precompute pass/DPO steps' time"].append(pre_pass / (steps * dpo_s))
        ratios["KTO precomputed/SFT step time"].append(kpre_s / sft_s)
        ratios["KTO precompute pass/KTO steps' time"].append(kpre_pass / (steps * kto_s))
        ratios["KTO/SFT step time"].append(kto_s / sft_s)
        ratios["KTO/SFT peak RSS"].append(kto_rss / sft_rss)
        ratios["TRL/lora-train KTO step time"].append(trl_kto_s / kto_s)
        ratios["TRL/lora-train KTO peak RSS"].append(trl_kto_rss / kto_rss)
        ratios["DPO/SFT step time"].append(dpo_s / sft_s)
        ratios["DPO/SFT peak RSS"].append(dpo_rss / sft_rss)
        ratios["SimPO/SFT step time"].append(simpo_s / sft_s)
        ratios["SimPO/SFT peak RSS"].append(simpo_rss / sft_rss)
        ratios["TRL/lora-train DPO step time"].append(trl_s / dpo_s)
        ratios["TRL/lora-train DPO peak RSS"].append(trl_rss / dpo_rss)
    for name, values in ratios.items():
        print(f"{name:36} median {statistics.median(values):.2f}x (min {min(values):.2f}, max {max(values):.2f})")


if __name__ == "__main__":
    main()
