"""TRL 1.16's GRPO loss on given completion log-probs: GRPOTrainer._compute_loss itself, run on the
tensors lorarun used, its model forward replaced by those log-probs (the loss's inputs and gradient
are what is compared; the model's log-probs are checked elsewhere).

usage: grpo_reference.py loss IN.safetensors CONFIGS_JSON OUT.safetensors
  IN holds logps, old_logps, ref_logps, mask [B, T] and advantages [B] (float32).
  CONFIGS_JSON a list of {loss_type, importance_sampling_level, beta, epsilon, epsilon_high,
  max_completion_length, use_bias_correction_kl, old} (old false: no old log-probs, one iteration).
  Writes loss_<i> and grad_<i> (d loss / d logps) for each; reports each config's logged metrics.
"""
import json
import os
import sys
from collections import defaultdict
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from oracle import report  # noqa: E402  (first: see oracle.py)
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


class OneProcess:
    """The accelerator of one process: gathers and reductions return what they are given."""
    num_processes = 1

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(t, cfg):
    from trl import GRPOTrainer
    logps = t["logps"].clone().requires_grad_(True)
    entropies = torch.zeros_like(logps)
    me = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=cfg["importance_sampling_level"], beta=cfg["beta"], loss_type=cfg["loss_type"],
        epsilon_low=cfg["epsilon"], epsilon_high=cfg["epsilon_high"], use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=cfg["max_completion_length"],
        accelerator=OneProcess(), _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=cfg["use_bias_correction_kl"], delta=None, steps_per_generation=1))
    mask = t["mask"]
    inputs = {"prompt_ids": torch.zeros(mask.size(0), 1, dtype=torch.long),
              "prompt_mask": torch.ones(mask.size(0), 1, dtype=torch.long),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": t["advantages"], "num_items_in_batch": mask.sum()}
    if cfg["old"]:
        inputs["old_per_token_logps"] = t["old_logps"]
    if cfg["beta"] != 0.0:
        inputs["ref_per_token_logps"] = t["ref_logps"]
    loss = GRPOTrainer._compute_loss(me, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in me._metrics["train"].items()}
    return loss.detach(), logps.grad, metrics


def main():
    if len(sys.argv) != 5 or sys.argv[1] != "loss":
        sys.exit(__doc__)
    t = load_file(sys.argv[2])
    configs = json.load(open(sys.argv[3]))
    out, metrics = {}, []
    for i, cfg in enumerate(configs):
        loss, grad, m = trl_loss(t, cfg)
        out[f"loss_{i}"] = loss.reshape(1).contiguous()
        out[f"grad_{i}"] = grad.contiguous()
        metrics.append(m)
    save_file(out, sys.argv[4])
    report(metrics=metrics, written=sys.argv[4])


if __name__ == "__main__":
    main()
