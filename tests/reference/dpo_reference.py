"""The preference reference: TRL 1.16's DPOTrainer (and its experimental ORPOTrainer and CPOTrainer)
doing what lora-train does with train.objective: dpo (orpo, cpo, simpo).

usage: dpo_reference.py init MODEL_DIR OUT_DIR R ALPHA SEED [M1+M2]  (MODEL_DIR may be a .gguf file)
    a fresh PEFT adapter (all-linear; A Kaiming-uniform, B zero: the adapter adds nothing yet), with
    modules_to_save [M1, M2] when given
       dpo_reference.py check MODEL_DIR INIT_DIR DATA.jsonl OURS_DIR LOSS_TYPE BETA RPO_ALPHA STEPS BATCH LR
                              MAX_LENGTH [LOSS_TOL WEIGHT_TOL] [--chat-template=FILE.jinja]
    DATA.jsonl holds {"prompt", "chosen", "rejected"} documents (strings, or lists of {role, content}
    messages rendered with the model's chat template, or FILE.jinja's); RPO_ALPHA is a number or "none". Given a
    PeftModel, TRL freezes a copy of its starting adapter as the reference ("ref"): the base itself
    for a fresh adapter (B zero), INIT_DIR's adapter when it was trained.
    LOSS_TYPE "orpo" trains ORPOTrainer instead (BETA its lambda; RPO_ALPHA "none"); "cpo-T" (T:
    sigmoid, hinge, ipo, simpo) trains CPOTrainer with loss_type T and RPO_ALPHA as its cpo_alpha
    ("none": 0), simpo_gamma 0.5.
    Trains STEPS steps of BATCH pairs in file order from INIT_DIR's adapter (constant LR, AdamW,
    max_grad_norm 1, no dropout) and compares, step by step, OURS_DIR/metrics.jsonl's loss and
    TRL's metrics (rewards/*, logps/*; RPO is TRL's loss_type [LOSS_TYPE, "sft"] with loss_weights
    [1, RPO_ALPHA]), then the adapter OURS_DIR/epoch_0
    with TRL's; reports match (tests/support/oracle.py) and the differences (default 1e-5 of each
    figure's largest magnitude over the run, 1e-4 of the largest weight for the adapter).
"""
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import oracle  # noqa: E402  (first: before anything imports bitsandbytes)
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from datasets.table import InMemoryTable  # noqa: E402
from peft import PeftModel, get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOConfig, ORPOTrainer  # noqa: E402

FIGURES = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected"]
# What DPOTrainer and KTOTrainer log of the completion tokens' next-token distributions. (CPO's and ORPO's
# logits/* are means over their whole padded batch, prompts and padding included: not compared, not logged.)
TOKEN_FIGURES = ["entropy", "logits/chosen", "logits/rejected"]


def figure_floor(k, logps, beta, vocab):
    """The scale below which a figure's difference is taken as absolute: a reward's, beta times the largest
    log-probability (a difference of two float32 sums); a mean logit's, 1 (a mean of terms of either sign);
    the entropy's, its largest possible value ln(vocab) (after the first step it moves with the adapter's
    rounding differences, over the whole distribution); ORPO's log odds and KTO's KL, the largest
    log-probability."""
    if k.startswith("rewards/"):
        return beta * logps
    if k.startswith("logits/"):
        return 1.0
    if k == "entropy":
        return math.log(vocab)
    return logps if k in ("log_odds_chosen", "kl") else 0.0


class InOrderMixin:
    """A trainer reading the pairs in file order (lora-train's data.shuffle: none), its losses kept."""

    losses = []

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            InOrderMixin.losses.append((loss[0] if return_outputs else loss).item())
        return loss


class InOrder(InOrderMixin, DPOTrainer):
    pass


class InOrderOrpo(InOrderMixin, ORPOTrainer):
    pass


class InOrderCpo(InOrderMixin, CPOTrainer):
    pass


class Logged(TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "rewards/chosen" in logs:
            self.rows.append(dict(logs))


def load(model_dir):
    """(transformers' model in float32, its tokenizer) of a HF directory or a .gguf file."""
    if model_dir.endswith(".gguf"):
        where, name = os.path.dirname(os.path.abspath(model_dir)), os.path.basename(model_dir)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
        # (its tensors are dequantised to float32: the GGUF mark only makes Trainer refuse to train it)
        model.hf_quantizer, model.is_quantized = None, False
        return model, AutoTokenizer.from_pretrained(where, gguf_file=name)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(model_dir)


def dataset(path):
    docs = [json.loads(line) for line in open(path) if line.strip()]
    columns = {k: [d[k] for d in docs] for k in ("prompt", "chosen", "rejected")}
    # (from a pyarrow table with a fingerprint given: datasets cannot fingerprint from_list's here)
    return Dataset(InMemoryTable(pa.table(columns)), fingerprint="lorarun-dpo-reference")


def policy(model_dir, init_dir, chat_template):
    """(MODEL_DIR with INIT_DIR's adapter to train, its tokenizer with CHAT_TEMPLATE's text when given)."""
    torch.manual_seed(0)
    base, tok = load(model_dir)
    if chat_template:
        tok.chat_template = open(chat_template).read()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return PeftModel.from_pretrained(base, init_dir, is_trainable=True), tok


def worst_figure(series, floor):
    """The largest difference of ours from TRL's among the figures `series` ({name: [(ours, TRL's), …]
    by step}), each relative to its largest magnitude over the run or `floor(name)` when larger (a
    reward, a margin: differences of log-probability sums, relative to those), and where it is."""
    worst, where = 0.0, ""
    for k, values in series.items():
        scale = max([1e-6, floor(k)] + [abs(b) for _, b in values])
        for i, (a, b) in enumerate(values):
            if abs(a - b) / scale > worst:
                worst, where = abs(a - b) / scale, f"{k} at step {i + 1}: ours {a!r}, TRL {b!r}"
    return worst, where


def adapter_against(model, ours, init_dir):
    """Whether OURS/epoch_0's adapter has TRL's keys, its largest difference from TRL's trained one
    relative to TRL's largest weight, and how far TRL's moved from INIT_DIR's (that it trained)."""
    want = {k: v.detach() for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}
    mine = load_file(f"{ours}/epoch_0/adapter_model.safetensors")
    largest = max(v.abs().max().item() for v in want.values())
    worst_w = max((mine[k] - v).abs().max().item() for k, v in want.items() if k in mine) / largest
    start = load_file(init_dir + "/adapter_model.safetensors")
    moved = max((v - start[k]).abs().max().item() for k, v in want.items())
    return set(mine) == set(want), worst_w, moved


def check(model_dir, init_dir, data, ours, loss_type, beta, rpo, steps, batch, lr, max_length, loss_tol=1e-5,
          weight_tol=1e-4, chat_template=None):
    model, tok = policy(model_dir, init_dir, chat_template)
    common = dict(per_device_train_batch_size=batch, gradient_accumulation_steps=1, learning_rate=lr,
                  lr_scheduler_type="constant", warmup_steps=0, max_steps=steps, weight_decay=0.0, max_grad_norm=1.0,
                  logging_steps=1, report_to="none", save_strategy="no", beta=beta, max_length=max_length,
                  bf16=False, fp16=False, use_cpu=True, seed=0, dataloader_num_workers=0)
    with tempfile.TemporaryDirectory() as out:
        if loss_type == "orpo":
            args, cls = ORPOConfig(output_dir=out, **common), InOrderOrpo
        elif loss_type.startswith("cpo-"):
            args = CPOConfig(output_dir=out, loss_type=loss_type[4:], cpo_alpha=0.0 if rpo == "none" else float(rpo),
                             simpo_gamma=0.5, **common)
            cls = InOrderCpo
        else:
            types, weights = [loss_type], [1.0]
            if rpo != "none":
                types, weights = [loss_type, "sft"], [1.0, float(rpo)]
            args, cls = DPOConfig(output_dir=out, loss_type=types, loss_weights=weights, **common), InOrder
        logged = Logged()
        trainer = cls(model=model, args=args, train_dataset=dataset(data), processing_class=tok, callbacks=[logged])
        InOrderMixin.losses = []
        trainer.train()
    rows = [json.loads(line) for line in open(ours + "/metrics.jsonl")]
    got = [r for r in rows if "loss" in r and "eval_loss" not in r]
    # Each figure's difference relative to its largest magnitude over the run; a reward (beta times
    # the difference of two float32 log-probability sums) relative to beta times those sums, and
    # ORPO's log odds to the log-probabilities: a margin that crosses zero has no relative error of
    # its own.
    series = {"loss": (list(zip([r["loss"] for r in got], InOrderMixin.losses)))}
    extra = (["nll_loss", "log_odds_ratio", "log_odds_chosen"] if loss_type == "orpo"
             else ["nll_loss"] if loss_type.startswith("cpo-") and rpo != "none"
             else [] if loss_type.startswith("cpo-") else TOKEN_FIGURES + ["mean_token_accuracy"])
    for k in FIGURES + extra:
        series[k] = [(mine[k], theirs[k]) for mine, theirs in zip(got, logged.rows)]
    logps = max(abs(r["logps/chosen"]) for r in logged.rows)
    worst, where = worst_figure(series, lambda k: figure_floor(k, logps, beta, model.config.vocab_size))
    same_keys, worst_w, moved = adapter_against(model, ours, init_dir)
    ok = (len(got) == steps and len(logged.rows) == steps and len(InOrderMixin.losses) == steps and same_keys
          and worst < loss_tol and worst_w < weight_tol and moved > 1e-4)
    print(f"{loss_type} beta {beta} rpo {rpo} from {os.path.basename(init_dir)}: steps {len(InOrderMixin.losses)} (ours {len(got)}); "
          f"loss first {InOrderMixin.losses[0]:.6f} last {InOrderMixin.losses[-1]:.6f}; worst relative figure diff {worst:.2e}"
          f" ({where}); worst weight diff {worst_w:.2e} of the largest; largest weight change {moved:.2e}")
    print("match" if ok else "MISMATCH")
    oracle.report(match=ok, steps=len(InOrderMixin.losses), our_steps=len(got), worst_relative_figure_diff=worst,
                  worst_relative_weight_diff=worst_w, largest_weight_change=moved,
                  first_loss=InOrderMixin.losses[0], last_loss=InOrderMixin.losses[-1],
                  last_accuracy=logged.rows[-1]["rewards/accuracies"] if logged.rows else math.nan)
    return 0 if ok else 1


def init(model_dir, out_dir, r, alpha, seed, modules_to_save=None):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    base, _ = load(model_dir)
    get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0,
                                    modules_to_save=modules_to_save.split("+") if modules_to_save else None)) \
        .save_pretrained(out_dir)
    return 0


if __name__ == "__main__":
    template = [x.split("=", 1)[1] for x in sys.argv if x.startswith("--chat-template=")]
    sys.argv = [x for x in sys.argv if not x.startswith("--chat-template=")]
    a = sys.argv[2:]
    if len(sys.argv) in (7, 8) and sys.argv[1] == "init":
        sys.exit(init(a[0], a[1], int(a[2]), float(a[3]), int(a[4]), *a[5:6]))
    if len(sys.argv) < 13 or sys.argv[1] != "check":
        sys.exit(__doc__)
    sys.exit(check(a[0], a[1], a[2], a[3], a[4], float(a[5]), a[6], int(a[7]), int(a[8]), float(a[9]), int(a[10]),
                   *map(float, a[11:13]), chat_template=template[0] if template else None))
