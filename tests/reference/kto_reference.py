"""The KTO reference: TRL 1.16's KTOTrainer doing what lora-train does with train.objective: kto.

usage: kto_reference.py check MODEL_DIR INIT_DIR DATA.jsonl OURS_DIR LOSS_TYPE BETA DESIRABLE_WEIGHT
                            UNDESIRABLE_WEIGHT STEPS BATCH LR MAX_LENGTH [LOSS_TOL WEIGHT_TOL]
                            [--chat-template=FILE.jinja]
    DATA.jsonl holds {"prompt", "completion", "label"} documents (strings, or lists of {role, content}
    messages rendered with the model's chat template, or FILE.jinja's); LOSS_TYPE kto or
    apo_zero_unpaired. INIT_DIR is a PEFT adapter (dpo_reference.py init, or a trained one): TRL
    freezes a copy of it as the reference. Trains STEPS steps of BATCH examples in file order (KTO's
    sequential sampling: each batch's KL pairs are its completions rotated by one) from INIT_DIR's
    adapter (constant LR, AdamW, max_grad_norm 1, no dropout) and compares, step by step,
    OURS_DIR/metrics.jsonl's loss and figures (kl, rewards/*, logps/*: those TRL logs that step) with
    TRL's, then the adapter OURS_DIR/epoch_0; reports match (tests/support/oracle.py) and the
    differences (default 1e-5 of each figure's largest magnitude over the run, 1e-4 of the largest
    weight for the adapter).
"""
import json
import os
import sys
import tempfile

from dpo_reference import (TOKEN_FIGURES, InOrderMixin, Logged, adapter_against, figure_floor, policy,  # (oracle first)
                           worst_figure)
import oracle  # noqa: E402
import pyarrow as pa  # noqa: E402
from datasets import Dataset  # noqa: E402
from datasets.table import InMemoryTable  # noqa: E402
from trl import KTOConfig, KTOTrainer  # noqa: E402

FIGURES = ["kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"] + TOKEN_FIGURES


class InOrderKto(InOrderMixin, KTOTrainer):
    pass


class LoggedKto(Logged):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "kl" in logs:
            self.rows.append(dict(logs))


def dataset(path):
    docs = [json.loads(line) for line in open(path) if line.strip()]
    columns = {k: [d[k] for d in docs] for k in ("prompt", "completion")}
    columns["label"] = [bool(d["label"]) for d in docs]
    return Dataset(InMemoryTable(pa.table(columns)), fingerprint="lorarun-kto-reference")


def check(model_dir, init_dir, data, ours, loss_type, beta, dw, uw, steps, batch, lr, max_length, loss_tol=1e-5,
          weight_tol=1e-4, chat_template=None):
    model, tok = policy(model_dir, init_dir, chat_template)
    with tempfile.TemporaryDirectory() as out:
        args = KTOConfig(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                         learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, max_steps=steps,
                         weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no",
                         beta=beta, desirable_weight=dw, undesirable_weight=uw, loss_type=loss_type,
                         max_length=max_length, bf16=False, fp16=False, use_cpu=True, seed=0,
                         dataloader_num_workers=0)
        logged = LoggedKto()
        trainer = InOrderKto(model=model, args=args, train_dataset=dataset(data), processing_class=tok,
                             callbacks=[logged])
        InOrderMixin.losses = []
        trainer.train()
    rows = [json.loads(line) for line in open(ours + "/metrics.jsonl")]
    got = [r for r in rows if "loss" in r and "eval_loss" not in r]
    series = {"loss": list(zip([r["loss"] for r in got], InOrderMixin.losses))}
    missing = []
    for k in FIGURES:
        for i, (mine, theirs) in enumerate(zip(got, logged.rows)):
            if (k in mine) != (k in theirs):
                missing.append(f"{k} at step {i + 1}: ours {'has' if k in mine else 'lacks'} it, TRL "
                               f"{'has' if k in theirs else 'lacks'} it")
            elif k in mine:
                series.setdefault(k, []).append((mine[k], theirs[k]))
    logps = max([0.0] + [abs(r[f]) for r in logged.rows for f in ("logps/chosen", "logps/rejected") if f in r])
    worst, where = worst_figure(series, lambda k: figure_floor(k, logps, beta, model.config.vocab_size))
    same_keys, worst_w, moved = adapter_against(model, ours, init_dir)
    ok = (len(got) == steps and len(logged.rows) == steps and len(InOrderMixin.losses) == steps and not missing
          and same_keys and worst < loss_tol and worst_w < weight_tol and moved > 1e-4)
    print(f"{loss_type} beta {beta} weights {dw}/{uw} from {os.path.basename(init_dir)}: steps "
          f"{len(InOrderMixin.losses)} (ours {len(got)}); loss first {InOrderMixin.losses[0]:.6f} last "
          f"{InOrderMixin.losses[-1]:.6f}; worst relative figure diff {worst:.2e} ({where}); worst weight diff "
          f"{worst_w:.2e} of the largest; largest weight change {moved:.2e}"
          + (f"; figures logged differently: {missing[:3]}" if missing else ""))
    print("match" if ok else "MISMATCH")
    oracle.report(match=ok, steps=len(InOrderMixin.losses), our_steps=len(got), worst_relative_figure_diff=worst,
                  worst_relative_weight_diff=worst_w, largest_weight_change=moved,
                  first_loss=InOrderMixin.losses[0], last_loss=InOrderMixin.losses[-1])
    return 0 if ok else 1


if __name__ == "__main__":
    template = [x.split("=", 1)[1] for x in sys.argv if x.startswith("--chat-template=")]
    sys.argv = [x for x in sys.argv if not x.startswith("--chat-template=")]
    a = sys.argv[2:]
    if len(sys.argv) < 14 or sys.argv[1] != "check":
        sys.exit(__doc__)
    sys.exit(check(a[0], a[1], a[2], a[3], a[4], float(a[5]), float(a[6]), float(a[7]), int(a[8]), int(a[9]),
                   float(a[10]), int(a[11]), *map(float, a[12:14]), chat_template=template[0] if template else None))
