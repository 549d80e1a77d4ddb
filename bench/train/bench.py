"""Training speed on CPU: lora-train (1 rank x 2 threads, 2 ranks x 1 thread) against transformers +
PEFT + torch AdamW (1 process x 2 threads), same torch, same model, same batches, in one run.

usage: .venv/bin/python bench/train/bench.py BUILD_DIR WORK_DIR [STEPS]

Config: a random llama (hidden 256, 4 layers, 8 heads / 4 KV heads, MLP 704, byte-level BPE vocab
~2k), fp32, sequences of exactly 256 tokens (format: text, truncated), 4 sequences per optimizer
step in all (1 rank: batch 4; 2 ranks: batch 2 each), LoRA r=16 alpha=32 on all linear layers,
AdamW, clipping at 1.0. Tokens/s count trained tokens (255 per sequence), median over the steps
after the first two.
"""
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

SEQ, GLOBAL_BATCH, THREADS = 256, 4, 2


def make_assets(work):
    model_dir = os.path.join(work, "llama")
    data = os.path.join(work, "data.jsonl")
    rng = random.Random(0)
    words = [''.join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    texts = [" ".join(rng.choice(words) for _ in range(400)) for _ in range(64)]
    with open(data, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    if os.path.exists(os.path.join(model_dir, "model.safetensors")):
        return model_dir, data
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM
    os.makedirs(model_dir, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=2048, special_tokens=["<|endoftext|>"])
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"},
              open(os.path.join(model_dir, "tokenizer_config.json"), "w"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      bos_token_id=eos, eos_token_id=eos)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    return model_dir, data


def ours(build, work, model_dir, data, world, steps):
    out = os.path.join(work, f"ours-w{world}")
    recipe = os.path.join(work, f"w{world}.yaml")
    with open(recipe, "w") as f:
        f.write(f"""model: {{path: {model_dir}, dtype: fp32, device: cpu}}
lora: {{r: 16, alpha: 32, target_modules: all-linear}}
data: {{source: jsonl, path: {data}, format: text, max_length: {SEQ}, batch_size: {GLOBAL_BATCH // world}}}
train: {{epochs: 1, lr: 1.0e-4, max_steps_per_epoch: {steps}, lr_scheduler: constant}}
checkpoint: {{output_dir: {out}, resume: never, epochs_to_save: none}}
track: {{mongodb: false}}
""")
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS // world))
    cmd = [f"{build}/bin/lorarun", "--nproc-per-node", str(world), recipe]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return statistics.median(r["tokens_per_s"] for r in rows[2:]), max(r["peak_rss_mb"] for r in rows)


def reference(model_dir, data, steps):
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(THREADS)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    seqs = [tok.encode(json.loads(line)["text"]).ids[:SEQ] for line in open(data)]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    rates = []
    for s in range(steps):
        ids = torch.tensor(seqs[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH])
        t0 = time.perf_counter()
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        rates.append((ids.size(1) - 1) * ids.size(0) / (time.perf_counter() - t0))
    import resource
    return statistics.median(rates[2:]), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    build, work = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    os.makedirs(work, exist_ok=True)
    model_dir, data = make_assets(work)
    ref, ref_rss = reference(model_dir, data, steps)
    rows = [("transformers + PEFT, 1 process x 2 threads", ref, ref_rss)]
    for world in (1, 2):
        rate, rss = ours(build, work, model_dir, data, world, steps)
        rows.append((f"lora-train, {world} rank(s) x {THREADS // world} thread(s)", rate, rss))  # RSS: rank 0
    print(f"{'':44} {'tokens/s':>9} {'vs ref':>7} {'peak RSS MB':>12}")
    for name, rate, rss in rows:
        print(f"{name:44} {rate:9.0f} {rate / ref:6.2f}x {rss:12.0f}")


if __name__ == "__main__":
    main()
