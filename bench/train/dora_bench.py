"""DoRA's cost on CPU: lora-train with lora.use_dora against plain LoRA, and against transformers +
PEFT with use_dora (and PEFT's plain LoRA), same torch, same model and batches, 2 threads each, in
one run, REPEATS times.

usage: .venv/bin/python bench/train/dora_bench.py BUILD_DIR WORK_DIR [STEPS [REPEATS [smollm2]]]

Config: bench/train/bench.py's (random llama, hidden 256, 4 layers, vocab ~2k, fp32, 4 sequences of
256 tokens a step, LoRA r=16 alpha=32 on all linear layers, AdamW, clipping at 1.0, 1 process x 2
threads); with smollm2, SmolLM2-135M-Instruct (the Q4_1 GGUF scripts/fetch-models keeps, dequantised
to fp32 on both sides; transformers reads it with its GGUF loading) and 2 sequences of 128 tokens a
step, so that a repeat fits in minutes on 2 cores. Step time is the median over the steps after the first two; peak RSS the process's
high-water mark. Prints each repeat's figures, then the median and spread (min-max) of each ratio.
"""
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import GLOBAL_BATCH, SEQ, THREADS, make_assets  # noqa: E402

SMOLLM2 = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       ".fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
# (sequences a step, tokens a sequence): bench.py's, or SmolLM2's smaller batch
SHAPE = {"": (GLOBAL_BATCH, SEQ), "smollm2": (2, 128)}


def run_ours(build, work, name, model_dir, data, shape, steps, lora="", train="", dtype="fp32", data_keys="", epochs=1):
    """lora-train on one rank with 2 threads: LoRA r=16 alpha=32 on every linear (plus `lora` keys),
    `epochs` of `steps` steps of `shape` (sequences, tokens) with the base in `dtype` (plus `train` and
    `data_keys` keys); (output dir, its metrics.jsonl rows)."""
    batch, seq = shape
    out = os.path.join(work, name)
    recipe = os.path.join(work, f"{name}.yaml")
    with open(recipe, "w") as f:
        f.write(f"""model: {{path: {model_dir}, dtype: {dtype}, device: cpu}}
lora: {{r: 16, alpha: 32, target_modules: all-linear{lora}}}
data: {{source: jsonl, path: {data}, format: text, max_length: {seq}, batch_size: {batch}{data_keys}}}
train: {{epochs: {epochs}, lr: 1.0e-4, max_steps_per_epoch: {steps}, lr_scheduler: constant{train}}}
checkpoint: {{output_dir: {out}, resume: never, epochs_to_save: none, overwrite: true}}
track: {{mongodb: false}}
""")
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    subprocess.run([f"{build}/bin/lorarun", "--nproc-per-node", "1", recipe], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return out, [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def ours(build, work, model_dir, data, dora, steps, shape):
    _, rows = run_ours(build, work, f"ours-dora{int(dora)}", model_dir, data, shape, steps,
                       lora=f", use_dora: {str(dora).lower()}")
    return statistics.median(r["seconds"] for r in rows[2:]), max(r["peak_rss_mb"] for r in rows)


def loading(model_dir, dtype="float32"):
    """Python expressions that load the model in torch's `dtype` and its tokenizer (a
    tokenizers.Tokenizer), for a HF directory or a GGUF file (transformers' GGUF loading)."""
    if model_dir.endswith(".gguf"):
        where, name = os.path.dirname(model_dir), os.path.basename(model_dir)
        return (f"AutoModelForCausalLM.from_pretrained({where!r}, gguf_file={name!r}, dtype=torch.{dtype})",
                f"AutoTokenizer.from_pretrained({where!r}, gguf_file={name!r}).backend_tokenizer")
    return (f"AutoModelForCausalLM.from_pretrained({model_dir!r}, dtype=torch.{dtype})",
            f"Tokenizer.from_file({os.path.join(model_dir, 'tokenizer.json')!r})")


def reference(model_dir, data, dora, steps, shape):
    """(median step seconds, peak RSS MB) of PEFT in a process of its own."""
    times, _, rss = reference_run(model_dir, data, dora, steps, shape)
    return statistics.median(times[2:]), rss


def reference_run(model_dir, data, dora, steps, shape, dtype="float32", epochs=1):
    """PEFT in a process of its own, the base in torch's `dtype` (PEFT keeps the adapter in fp32),
    `epochs` passes over the first `steps` batches in file order: (step seconds, losses, peak RSS MB)."""
    batch, seq = shape
    load = loading(model_dir, dtype)
    code = f"""
import json, resource, time, torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads({THREADS})
tok = {load[1]}
seqs = [tok.encode(json.loads(line)["text"]).ids[:{seq}] for line in open({data!r})]
model = get_peft_model({load[0]},
                       LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, use_dora={dora}))
model.train()
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-4)
times, losses = [], []
for s in [s for _ in range({epochs}) for s in range({steps})]:
    ids = torch.tensor(seqs[s * {batch}:(s + 1) * {batch}])
    t0 = time.perf_counter()
    loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())
print(json.dumps([times, losses, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def main():
    build, work = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    which = sys.argv[5] if len(sys.argv) > 5 else ""
    os.makedirs(work, exist_ok=True)
    model_dir, data = make_assets(work)
    if which == "smollm2":
        model_dir = SMOLLM2
    shape = SHAPE[which]
    ratios = {k: [] for k in ("dora/lora time", "dora/lora RSS", "PEFT dora/ours dora time", "PEFT dora/ours dora RSS",
                              "PEFT dora/PEFT lora time")}
    for rep in range(repeats):
        (lt, lr), (dt, dr) = (ours(build, work, model_dir, data, dora, steps, shape) for dora in (False, True))
        (plt, _), (pdt, pdr) = (reference(model_dir, data, dora, steps, shape) for dora in (False, True))
        print(f"repeat {rep}: step s: ours lora {lt:.3f} dora {dt:.3f}, PEFT lora {plt:.3f} dora {pdt:.3f}; "
              f"peak RSS MB: ours lora {lr:.0f} dora {dr:.0f}, PEFT dora {pdr:.0f}")
        for k, v in zip(ratios, (dt / lt, dr / lr, pdt / dt, pdr / dr, pdt / plt)):
            ratios[k].append(v)
    for k, v in ratios.items():
        print(f"{k:28} median {statistics.median(v):.2f}x  (spread {min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
