"""The GRPO reference: TRL 1.16's real GRPOTrainer trained on lora-train's own completions
(train.objective: grpo), its figures, advantages and adapter compared with lora-train's.

usage: grpo_trainer_reference.py init MODEL_DIR OUT_DIR R ALPHA SEED
    a fresh PEFT adapter (all-linear, B zero), as dpo_reference.py's init
       grpo_trainer_reference.py check MODEL_DIR INIT_DIR PROMPTS.jsonl OURS_DIR [options]
    PROMPTS.jsonl: {"prompt": "<plain string>", "answer": ...} documents; OURS_DIR: lora-train's
    output_dir after a run with lora.init_from=INIT_DIR, data.shuffle: none, data.batch_size P,
    train.gradient_accumulation_steps A, grpo.num_generations G, grpo.log_completions: true,
    constant LR, AdamW (weight_decay 0), max_grad_norm 1, fp32 on CPU, 1 rank.
    options: --loss-type {grpo,dr_grpo,dapo,bnpo} --beta F --num-generations G --batch P --accum A
    --steps N --lr F --max-completion-length L --temperature F --epsilon F --epsilon-high F
    --importance-level {token,sequence} --scale-rewards {group,batch,none} --mask-truncated
    --rewards number,length --length M,C --length-weight W --loss-tol 1e-5 --adapter-tol 1e-4
    --num-iterations MU
       grpo_trainer_reference.py eval MODEL_DIR OURS_DIR PROMPTS.jsonl [--max-completion-length L]
       [--length M,C --length-weight W --rewards number,length]
    lora-train's last eval row (eval.path PROMPTS.jsonl) against transformers' greedy generate with
    OURS_DIR/epoch_0's adapter (PEFT), each prompt alone, scored by the same reward functions:
    eval_reward, each reward's mean and the mean completion length (absolute 1e-6).

TRL trains MODEL_DIR + INIT_DIR's adapter on the prompts in file order (P*G completions a micro-batch,
A micro-batches a step, one generation a step: steps_per_generation = A, so TRL advantages over the
step's P*A prompts as lora-train does; with --num-iterations MU, every MU-th step generates and the
steps between train again on its completions, with the log-probs at generation). Generation is replaced: _generate_single_turn returns, for
step S, OURS_DIR/completions.jsonl's completion_ids of step S (row p*G+g: prompt p, generation g);
the step's prompts are checked against the rows'. Everything else is TRL's: the rewards (the
functions below, with reward_weights), advantages, log-probs, KL reference, loss, metrics, AdamW.
Two changes of order only: the generation batch is not shuffled before it is split into
micro-batches (TRL's shuffle_sequence_dict is a random permutation; lora-train's micro-batch a
holds the step's prompts a*P..a*P+P-1), and with A > 1 kl and clip_ratio/* are TRL's micro-batch
values weighted by their tokens (sequences, at the sequence level): the step's figure over all its
tokens, as TRL reduces it over ranks (TRL's log() averages micro-batch values unweighted).
Rewards: "num" (number): 1.0 when the last number of the completion equals the answer's last number
(lora-train's last_number: commas between thousands ignored), weight 1; "short" (length):
trl.rewards.get_soft_overlong_punishment(M, C), weight W.
Compared, step by step: metrics.jsonl's figures with TRL's logs (a step that did not generate logs
no reward figure on either side), relative to max(|TRL|, 1e-6/loss_tol)
(so an absolute difference under 1e-6 always passes); each completion's reward and advantage (absolute
1e-5); then epoch_0/adapter_model.safetensors with TRL's adapter (largest difference relative to the
largest weight). Prints a table, "worst relative loss diff", "worst advantage diff", "adapter relative
diff", "match" or "MISMATCH: <figure> at step <n> ...", reports through oracle.report; exit 1 on mismatch.
"""
import argparse
import json
import math
import os
import re
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402  (first: before anything imports bitsandbytes)
from dpo_reference import adapter_against, init, load, policy  # noqa: E402
from peft import PeftModel  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
import trl.trainer.grpo_trainer as grpo_module  # noqa: E402
from datasets import Dataset  # noqa: E402
from datasets.table import InMemoryTable  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.rewards import get_soft_overlong_punishment  # noqa: E402

# lora-train's last_number (lib/train/rewards.cpp)
NUMBER = re.compile(r"[-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
FIGURES = ["loss", "reward", "reward_std", "frac_reward_zero_std", "kl", "clip_ratio/low_mean",
           "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length"]
TOKEN_WEIGHTED = ["kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]


def last_number(text):
    found = NUMBER.findall(str(text))
    return float(found[-1].replace(",", "")) if found else None


def num(completions, answer, **kwargs):
    out = []
    for c, a in zip(completions, answer):
        got, want = last_number(c), last_number(a)
        out.append(1.0 if got is not None and want is not None and got == want else 0.0)
    return out


def reward_funcs(names, length, weight):
    funcs, weights = [], []
    for name in names:
        if name == "number":
            funcs.append(num), weights.append(1.0)
        elif name == "length":
            m, c = (int(x) for x in length.split(","))
            overlong = get_soft_overlong_punishment(max_completion_len=m, soft_punish_cache=c)

            def short(completion_ids, **kwargs):
                return overlong(completion_ids)
            funcs.append(short), weights.append(weight)
        elif name == "chars":  # the completion's characters (a command reward that reads the text)
            def chars(completions, **kwargs):
                return [float(len(c)) for c in completions]
            funcs.append(chars), weights.append(1.0)
        else:
            sys.exit(f"unknown reward {name!r} (number, length, chars)")
    return funcs, weights


class Logged(TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and "learning_rate" in logs:
            self.rows.append(dict(logs))


def replaying(ours, tok, G, A):
    """A GRPOTrainer whose generation returns lora-train's completions of the step, recording
    TRL's advantages, rewards, micro-batch weights and raw micro-batch metrics."""

    class Replayed(GRPOTrainer):
        steps = []  # by step: {"advantages", "rewards", "weights"}
        raw = []    # by step: TRL's metric lists before log() averages them

        def _generate_and_score_completions(self, inputs):
            step = self.state.global_step
            rows = ours.get(step)
            assert rows is not None, f"step {step + 1}: lora-train logged no completions for it"
            stale = " (rows of an earlier run? lora-train appends to completions.jsonl)"
            assert len(rows) == len(inputs), (f"step {step + 1}: {len(rows)} completions logged, TRL has "
                                              f"{len(inputs)}{stale if len(rows) > len(inputs) else ''}")
            for i, (x, r) in enumerate(zip(inputs, rows)):
                assert (r["index"], r["generation"]) == (i // G, i % G), f"step {step + 1}: row {i} is {r}"
                text = tok.decode(tok(x["prompt"])["input_ids"])
                assert text == r["prompt"], f"step {step + 1} prompt {i // G}: TRL's {text!r}, ours {r['prompt']!r}"
            self._replay = [list(r["completion_ids"]) for r in rows]
            out = super()._generate_and_score_completions(inputs)
            mask = out["completion_mask"].float()
            chunks = mask.chunk(A)  # split_tensor_dict's micro-batches (not shuffled)
            seq = self.importance_sampling_level == "sequence"
            Replayed.steps.append(dict(advantages=out["advantages"].tolist(), rewards=self._rewards,
                                       weights=[float(c.size(0)) if seq else c.sum().item() for c in chunks]))
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            rewards = (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
            rewards[torch.isnan(per_func).all(dim=1)] = torch.nan  # as TRL's logged rewards
            self._rewards = (rewards.tolist(), per_func.tolist())
            return per_func

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            assert len(prompt_ids) == len(self._replay)
            return self._replay, None

        def log(self, logs, start_time=None):
            if self.model.training and "loss" in logs:
                Replayed.raw.append({k: list(v) for k, v in self._metrics["train"].items()})
            super().log(logs, start_time)

    return Replayed


def fmt(x):
    return "None" if x is None else f"{x:.10g}"


def gap(a, b):
    """|a - b|; 0 when both are None or NaN (unscorable), infinite when one is."""
    a, b = (math.nan if x is None else float(x) for x in (a, b))
    return 0.0 if math.isnan(a) and math.isnan(b) else math.inf if math.isnan(a) or math.isnan(b) else abs(a - b)


def close(a, b, tol):
    """(|a - b| relative to max(|b|, 1e-6 / tol), whether within tol): an absolute floor of 1e-6."""
    d = gap(a, b)
    d = d if d in (0.0, math.inf) else d / max(abs(b), 1e-6 / tol)
    return d, d <= tol


def check(o):
    names = o.rewards.split(",")
    funcs, weights = reward_funcs(names, o.length, o.length_weight)
    P, A, G, N, MU = o.batch, o.accum, o.num_generations, o.steps, o.num_iterations
    docs = [json.loads(line) for line in open(o.prompts) if line.strip()]
    need = -(-N // MU) * P * A
    if len(docs) < need:
        sys.exit(f"{o.prompts}: {len(docs)} prompts, {N} steps of {P * A} ({MU} a generation) need {need}")
    columns = {"prompt": [d["prompt"] for d in docs], "answer": [str(d["answer"]) for d in docs]}
    data = Dataset(InMemoryTable(pa.table(columns)), fingerprint="lorarun-grpo-trainer-reference")
    ours = defaultdict(list)
    for line in open(os.path.join(o.ours, "completions.jsonl")):
        if line.strip():
            r = json.loads(line)
            ours[r["step"]].append(r)
    for rows in ours.values():
        rows.sort(key=lambda r: (r["index"], r["generation"]))
    metrics = [json.loads(line) for line in open(os.path.join(o.ours, "metrics.jsonl")) if line.strip()]
    metrics = [r for r in metrics if "loss" in r and "step" in r]

    model, tok = policy(o.model, o.init, None)
    grpo_module.shuffle_sequence_dict = lambda batch: batch  # micro-batches in lora-train's order
    cls = replaying(ours, tok, G, A)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=P * G, gradient_accumulation_steps=A, num_generations=G,
            steps_per_generation=A, num_iterations=MU, shuffle_dataset=False, learning_rate=o.lr,
            lr_scheduler_type="constant", warmup_steps=0, max_steps=N, weight_decay=0.0, max_grad_norm=1.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, beta=o.beta, loss_type=o.loss_type,
            epsilon=o.epsilon, epsilon_high=o.epsilon_high if o.epsilon_high is not None else o.epsilon,
            importance_sampling_level=o.importance_level, scale_rewards=o.scale_rewards,
            mask_truncated_completions=o.mask_truncated, temperature=o.temperature,
            max_completion_length=o.max_completion_length, reward_weights=weights, logging_steps=1, report_to=[],
            use_cpu=True, bf16=False, fp16=False, seed=0, save_strategy="no", remove_unused_columns=False,
            use_liger_kernel=False, use_vllm=False, log_completions=False, dataloader_num_workers=0)
        logged = Logged()
        trainer = cls(model=model, reward_funcs=funcs, args=args, train_dataset=data, processing_class=tok,
                      callbacks=[logged])
        try:
            trainer.train()
        except AssertionError as e:  # lora-train's completions do not fit TRL's steps
            print(f"MISMATCH: {e}")
            oracle.report(match=False, failures=[str(e)])
            return 1

    figures = [k for k in FIGURES if k != "kl" or o.beta != 0.0]
    figures += [f"rewards/{f.__name__}/mean" for f in funcs] + [f"rewards/{f.__name__}/std" for f in funcs]
    failures, worst, worst_adv, worst_reward, unweighted = [], (0.0, ""), 0.0, 0.0, 0.0
    if len(metrics) != N or len(logged.rows) != N:
        failures.append(f"steps: ours {len(metrics)}, TRL {len(logged.rows)}, asked {N}")
    print(f"{'step':>4} {'figure':<26} {'lorarun':>17} {'TRL':>17} {'rel diff':>9}")
    for s, (mine, theirs, raw) in enumerate(zip(metrics, logged.rows, cls.raw)):
        got = cls.steps[s // MU]  # the generation the step trains on
        for k in figures:
            want = theirs.get(k)
            if k in TOKEN_WEIGHTED and A > 1 and k in raw:  # the step's figure over all its tokens
                w = got["weights"]
                want = sum(v * x for v, x in zip(raw[k], w)) / sum(w) if sum(w) > 0 else 0.0
                unweighted = max(unweighted, close(mine.get(k), theirs.get(k), o.loss_tol)[0])
            d, ok = close(mine.get(k), want, o.loss_tol)
            print(f"{s + 1:>4} {k:<26} {fmt(mine.get(k)):>17} {fmt(want):>17} {d:9.2e}{'' if ok else '  <--'}")
            if d > worst[0]:
                worst = (d, f"{k} at step {s + 1}: lorarun {mine.get(k)!r}, TRL {want!r}")
            if not ok:
                failures.append(f"{k} at step {s + 1}: lorarun {mine.get(k)!r}, TRL {want!r} (rel diff {d:.2e})")
        rewards, per_func = got["rewards"]
        for i, r in enumerate(ours[s] if s % MU == 0 else []):
            da = gap(r["advantage"], got["advantages"][i])
            dr = max([gap(r["reward"], rewards[i])] +
                     [gap(r["rewards"].get(f.__name__), per_func[i][j]) for j, f in enumerate(funcs)])
            worst_adv, worst_reward = max(worst_adv, da), max(worst_reward, dr)
            where = f"step {s + 1} prompt {r['index']} generation {r['generation']}"
            if not da <= 1e-5:
                failures.append(f"advantage at {where}: lorarun {r['advantage']!r}, TRL {got['advantages'][i]!r}")
            if not dr <= 1e-5:
                failures.append(f"reward at {where}: lorarun {r['reward']!r} {r['rewards']}, TRL {rewards[i]!r} "
                                f"{per_func[i]}")
    same_keys, worst_w, moved = adapter_against(model, o.ours, o.init)
    if not same_keys:
        failures.append("adapter: lorarun's keys are not TRL's")
    if not worst_w <= o.adapter_tol:
        failures.append(f"adapter: largest difference {worst_w:.2e} of the largest weight (tolerance {o.adapter_tol})")
    zero_std = [r.get("frac_reward_zero_std") for r in logged.rows]
    print(f"worst relative loss diff {worst[0]:.2e} ({worst[1]}); relative to max(|TRL|, {1e-6 / o.loss_tol:g})")
    print(f"worst advantage diff {worst_adv:.2e}; worst reward diff {worst_reward:.2e}")
    print(f"adapter relative diff {worst_w:.2e} (largest weight change from init {moved:.2e}); "
          f"frac_reward_zero_std by step {zero_std}")
    if A > 1:
        print(f"(kl, clip_ratio/*: against TRL's logged unweighted micro-batch means, worst {unweighted:.2e})")
    if o.loss_type == "bnpo" and A > 1:
        print("note: lorarun's bnpo divides by the step's tokens (lib/train/grpo.cpp), TRL's by each "
              "micro-batch's: they differ with accumulation")
    print("match" if not failures else "MISMATCH: " + "; ".join(failures[:5]))
    oracle.report(match=not failures, steps=len(logged.rows), our_steps=len(metrics),
                  worst_relative_figure_diff=worst[0], worst_advantage_diff=worst_adv, worst_reward_diff=worst_reward,
                  worst_relative_weight_diff=worst_w,
                  largest_weight_change=moved, failures=failures[:20])
    return 0 if not failures else 1


def evaluate(o):
    """transformers' greedy completions of the prompts with lora-train's adapter, scored as TRL scores,
    against lora-train's last evaluation row."""
    base, tok = load(o.model)
    model = PeftModel.from_pretrained(base, os.path.join(o.ours, "epoch_0")).eval()
    funcs, weights = reward_funcs(o.rewards.split(","), o.length, o.length_weight)
    docs = [json.loads(line) for line in open(o.prompts) if line.strip()]
    totals, per_func, lengths = [], defaultdict(list), []
    for d in docs:
        ids = tok(d["prompt"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=o.max_completion_length, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.eos_token_id)
        completion = out[0, ids.shape[1]:].tolist()
        text = tok.decode(completion, skip_special_tokens=True)
        total = 0.0
        for f, w in zip(funcs, weights):
            v = f(completions=[text], completion_ids=[completion], answer=[str(d["answer"])])[0]
            per_func[f.__name__].append(v)
            total += w * v
        totals.append(total)
        lengths.append(len(completion))
    want = {"eval_reward": sum(totals) / len(totals), "eval_completions/mean_length": sum(lengths) / len(lengths)}
    for name, values in per_func.items():
        want[f"eval_rewards/{name}/mean"] = sum(values) / len(values)
    rows = [json.loads(line) for line in open(os.path.join(o.ours, "metrics.jsonl")) if line.strip()]
    mine = [r for r in rows if "eval_reward" in r][-1]
    failures = [f"{k}: lorarun {mine.get(k)!r}, transformers {v!r}" for k, v in want.items()
                if not gap(mine.get(k), v) <= 1e-6]
    for k, v in want.items():
        print(f"{k:<32} {fmt(mine.get(k)):>17} {fmt(v):>17}")
    print("match" if not failures else "MISMATCH: " + "; ".join(failures))
    oracle.report(match=not failures, prompts=len(docs), eval_reward=want["eval_reward"], failures=failures)
    return 0 if not failures else 1


def options(argv):
    p = argparse.ArgumentParser(description="TRL's GRPOTrainer on lora-train's completions")
    names = ("model", "ours", "prompts") if argv[0] == "eval" else ("model", "init", "prompts", "ours")
    argv = argv[1:]
    for name in names:
        p.add_argument(name)
    p.add_argument("--loss-type", choices=["grpo", "dr_grpo", "dapo", "bnpo"], default="dapo")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="P: prompts a micro-batch")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--num-iterations", type=int, default=1)
    p.add_argument("--steps", type=int, required=names[1] == "init")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-completion-length", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--epsilon", type=float, default=0.2)
    p.add_argument("--epsilon-high", type=float, default=None)
    p.add_argument("--importance-level", choices=["token", "sequence"], default="token")
    p.add_argument("--scale-rewards", choices=["group", "batch", "none"], default="group")
    p.add_argument("--mask-truncated", action="store_true")
    p.add_argument("--rewards", default="number,length")
    p.add_argument("--length", default="8,6", help="M,C of the length reward")
    p.add_argument("--length-weight", type=float, default=0.5)
    p.add_argument("--loss-tol", type=float, default=1e-5)
    p.add_argument("--adapter-tol", type=float, default=1e-4)
    return p.parse_args(argv)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "init":
        a = sys.argv[2:]
        sys.exit(init(a[0], a[1], int(a[2]), float(a[3]), int(a[4])))
    if len(sys.argv) < 2 or sys.argv[1] not in ("check", "eval"):
        sys.exit(__doc__)
    sys.exit((check if sys.argv[1] == "check" else evaluate)(options(sys.argv[1:])))
