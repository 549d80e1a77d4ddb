"""GRPO on CPU: a lora-train step (train.objective: grpo: sampling with the KV cache, rewards, the
policy's forward and backward) against TRL 1.16's GRPOTrainer step on the same model, prompts, reward
and settings, same torch, 2 threads each, in one run, REPEATS times.

usage: .venv/bin/python bench/train/grpo_bench.py BUILD_DIR WORK_DIR [STEPS (default 6) [REPEATS (default 3)]]

Model: SmolLM2-135M-Instruct's Q4_1 GGUF (.fixtures/models/smollm2), fp32 on both sides (transformers
dequantises it at load, as lorarun does), LoRA r=16 alpha=32 on all linear layers. A step: 2 prompts
("What is 37 + 45? Reply with the number only.", ChatML) × 8 completions of up to 16 tokens,
temperature 1, the reward 1 when the last number written is the sum, beta 0, loss dapo, lr 5e-4.
Each side samples its own completions, so their lengths differ: besides the step time (the median
over the steps after the first two) the figure compared is completion tokens per second of step
time (the steps' completions/mean_length x 16 / their seconds). Peak RSS: the process's high-water
mark (lora-train: metrics.jsonl's peak_rss_mb; TRL: ru_maxrss of its own process, run apart).
Prints each repeat's figures, then the median and spread (min-max) of ours / TRL's.
"""
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, ".fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
THREADS, PROMPTS, G, LENGTH = 2, 2, 8, 16
ASK = "What is {} + {}? Reply with the number only."


def make_prompts(work, n):
    rng = random.Random(3)
    path = os.path.join(work, "sums.jsonl")
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": [{"role": "user", "content": ASK.format(a, b)}], "answer": a + b}) + "\n")
    return path


def ours(build, work, data, steps):
    recipe = os.path.join(work, "grpo.yaml")
    out = os.path.join(work, "ours")
    with open(recipe, "w") as f:
        f.write(f"""model: {{path: {MODEL}, dtype: fp32, device: cpu}}
lora: {{r: 16, alpha: 32, target_modules: all-linear}}
data: {{source: jsonl, path: {data}, format: prompt, chat_format: chatml, shuffle: none, max_length: 64,
       batch_size: {PROMPTS}}}
train: {{objective: grpo, epochs: 1, lr: 5.0e-4, lr_scheduler: constant, max_steps_per_epoch: {steps}}}
grpo: {{num_generations: {G}, max_completion_length: {LENGTH}, rewards: [{{name: sum, kind: number, field: answer}}]}}
checkpoint: {{output_dir: {out}, overwrite: true, epochs_to_save: none}}
track: {{mongodb: false}}
""")
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    r = subprocess.run([os.path.join(build, "bin/lora-train"), recipe], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"lora-train failed:\n{r.stdout}\n{r.stderr}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = [row for row in rows if "reward" in row][2:]
    seconds = [row["seconds"] for row in rows]
    tokens = [row["completions/mean_length"] * PROMPTS * G for row in rows]
    return statistics.median(seconds), sum(tokens) / sum(seconds), max(row["peak_rss_mb"] for row in rows)


def theirs(work, data, steps):
    """TRL's GRPOTrainer in this process (run as `trl`): prints one JSON line of its figures."""
    import torch
    import pyarrow as pa
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import re
    torch.set_num_threads(THREADS)
    where, name = os.path.dirname(MODEL), os.path.basename(MODEL)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer, model.is_quantized = None, False  # (dequantised to float32 at load: trainable)
    tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    docs = [json.loads(line) for line in open(data)]
    table = pa.table({"prompt": [d["prompt"] for d in docs], "answer": [d["answer"] for d in docs]})
    dataset = Dataset(table, fingerprint="grpo-bench-sums")

    def right(completions, answer, **_):
        out = []
        for c, a in zip(completions, answer):
            text = c[0]["content"] if isinstance(c, list) else c
            numbers = re.findall(r"-?\d+", text)
            out.append(1.0 if numbers and int(numbers[-1]) == a else 0.0)
        return out

    class Clock(TrainerCallback):
        def __init__(self):
            self.seconds, self.lengths, self.t0 = [], [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    args = GRPOConfig(output_dir=os.path.join(work, "trl"), per_device_train_batch_size=PROMPTS * G,
                      num_generations=G, max_completion_length=LENGTH, temperature=1.0, beta=0.0, loss_type="dapo",
                      learning_rate=5e-4, lr_scheduler_type="constant", max_steps=steps, logging_steps=1,
                      report_to=[], save_strategy="no", use_cpu=True, shuffle_dataset=False, seed=0,
                      disable_tqdm=True)
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=right, args=args, train_dataset=dataset, processing_class=tok,
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
                          callbacks=[clock])
    trainer.train()
    seconds, lengths = clock.seconds[2:], clock.lengths[2:]
    tokens = [n * PROMPTS * G for n in lengths]
    print(json.dumps({"step": statistics.median(seconds), "tokens_per_s": sum(tokens) / sum(seconds),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "trl":
        return theirs(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    build, work = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    os.makedirs(work, exist_ok=True)
    data = make_prompts(work, PROMPTS * steps)
    ratios = {"step time": [], "completion tokens/s": [], "peak RSS": []}
    for rep in range(repeats):
        step, rate, rss = ours(build, work, data, steps)
        r = subprocess.run([sys.executable, __file__, "trl", work, data, str(steps)], capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS=str(THREADS)))
        if r.returncode != 0:
            sys.exit(f"TRL failed:\n{r.stderr[-3000:]}")
        trl = json.loads(r.stdout.strip().splitlines()[-1])
        ratios["step time"].append(step / trl["step"])
        ratios["completion tokens/s"].append(rate / trl["tokens_per_s"])
        ratios["peak RSS"].append(rss / trl["peak_rss_mb"])
        print(f"repeat {rep + 1}: ours step {step:.2f} s, {rate:.1f} completion tokens/s, peak {rss:.0f} MB; TRL step "
              f"{trl['step']:.2f} s, {trl['tokens_per_s']:.1f} completion tokens/s, peak {trl['peak_rss_mb']:.0f} MB",
              flush=True)
    for label, r in ratios.items():
        print(f"{label}: ours / TRL's {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f}), {len(r)} repeats")


if __name__ == "__main__":
    main()
