"""Memory on CPU, measured in one run.

usage: .venv/bin/python bench/memory/bench.py BUILD_DIR WORK_DIR

1. The loss at a 128k vocabulary (Llama 3's 128,256), 2,048 tokens, hidden 1,024, fp32: peak RSS
   growth of loss + backward for transformers' way (logits.float() -> cross_entropy), our
   full-logits loss, and our chunked loss from hidden states (lm_head_loss). Each in its own process.
2. Activation checkpointing: lora-train on a random llama (hidden 512, 8 layers, seq 1,024, batch 4,
   LoRA r=16 all-linear, fp32) with and without train.activation_checkpointing: peak RSS and
   seconds per step, and whether the losses agree.
"""
import json
import os
import random
import statistics
import subprocess
import sys

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "support")
sys.path.insert(0, SUPPORT)
import oracle  # noqa: E402  (tests/support/oracle.py: what the reference process reports, and nothing else)
# The reference processes report through it too.
CHILD = f"import sys; sys.path.insert(0, {SUPPORT!r}); import oracle\n"

TOKENS, HIDDEN, VOCAB = 2048, 1024, 128256

REFERENCE = f"""
import resource, time, torch
torch.manual_seed(0)
w = torch.randn({VOCAB}, {HIDDEN}) * 0.02
h = torch.randn(1, {TOKENS}, {HIDDEN}, requires_grad=True)
labels = torch.randint({VOCAB}, (1, {TOKENS}))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
logits = torch.nn.functional.linear(h, w).float()          # as transformers' LlamaForCausalLM
loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, {VOCAB}), labels[:, 1:].reshape(-1),
                                         reduction="sum")  # ForCausalLMLoss, summed
loss.backward()
oracle.report(peak_growth_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before,
              seconds=time.perf_counter() - t0, loss=loss.item())
"""


def loss_memory(build):
    rows = []
    out = subprocess.run([sys.executable, "-c", CHILD + REFERENCE], check=True, capture_output=True, text=True).stdout
    ref = oracle.reported(out)
    rows.append(("transformers (logits.float() + cross_entropy)", ref["peak_growth_mb"], ref["seconds"], ref["loss"]))
    for mode in ("full", "chunked"):
        out = subprocess.run([f"{build}/bin/loss_memory_bench", mode, str(TOKENS), str(HIDDEN), str(VOCAB)],
                             check=True, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
        r = json.loads(out.stdout)
        name = "lora-train, full logits" if mode == "full" else "lora-train, chunked from hidden states"
        rows.append((name, r["peak_growth_mb"], r["seconds"], r["loss"]))
    print(f"loss + backward, {TOKENS} tokens, vocab {VOCAB}, hidden {HIDDEN}, fp32 "
          f"(full fp32 logits alone: {TOKENS * VOCAB * 4 / 2**20:.0f} MiB)")
    print(f"{'':48} {'peak MB':>8} {'seconds':>8} {'loss':>14}")
    for name, mb, s, loss in rows:
        print(f"{name:48} {mb:8.0f} {s:8.2f} {loss:14.2f}")


def make_model(work):
    model_dir = os.path.join(work, "llama512")
    data = os.path.join(work, "long.jsonl")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    with open(data, "w") as f:
        for _ in range(32):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(1500))}) + "\n")
    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        import torch
        from tokenizers import ByteLevelBPETokenizer
        from transformers import LlamaConfig, LlamaForCausalLM
        os.makedirs(model_dir, exist_ok=True)
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator([" ".join(words)] * 4, vocab_size=2048, special_tokens=["<|endoftext|>"])
        tok.save(os.path.join(model_dir, "tokenizer.json"))
        json.dump({"eos_token": "<|endoftext|>"}, open(os.path.join(model_dir, "tokenizer_config.json"), "w"))
        torch.manual_seed(0)
        eos = tok.token_to_id("<|endoftext|>")
        LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=512, intermediate_size=1408,
                                     num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                                     max_position_embeddings=2048, bos_token_id=eos, eos_token_id=eos)
                         ).save_pretrained(model_dir)
    return model_dir, data


def checkpointing(build, work):
    model_dir, data = make_model(work)
    rows = []
    for on in (False, True):
        out = os.path.join(work, f"ckpt-{on}")
        recipe = os.path.join(work, f"ckpt-{on}.yaml")
        with open(recipe, "w") as f:
            f.write(f"""model: {{path: {model_dir}, dtype: fp32, device: cpu}}
lora: {{r: 16, alpha: 32, target_modules: all-linear}}
data: {{source: jsonl, path: {data}, format: text, max_length: 1024, batch_size: 4, shuffle: none}}
train: {{epochs: 1, lr: 1.0e-4, max_steps_per_epoch: 4, lr_scheduler: constant, activation_checkpointing: {str(on).lower()}}}
checkpoint: {{output_dir: {out}, resume: never, epochs_to_save: none}}
track: {{mongodb: false}}
""")
        subprocess.run([f"{build}/bin/lora-train", recipe], check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, OMP_NUM_THREADS="2"))
        m = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        rows.append((on, max(r["peak_rss_mb"] for r in m), statistics.median(r["seconds"] for r in m[1:]),
                     [r["loss"] for r in m]))
    print("\nactivation checkpointing: llama hidden 512 x 8 layers, seq 1024, batch 4, r=16 all-linear, fp32")
    print(f"{'':28} {'peak RSS MB':>12} {'s/step':>8}")
    for on, rss, s, _ in rows:
        print(f"{'on' if on else 'off':28} {rss:12.0f} {s:8.2f}")
    worst = max(abs(a - b) / b for a, b in zip(rows[1][3], rows[0][3]))
    print(f"worst relative loss difference on/off: {worst:.2e}")


def main():
    build, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    loss_memory(build)
    checkpointing(build, work)


if __name__ == "__main__":
    main()
