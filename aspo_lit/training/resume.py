"""What a resume may change (docs/running.md, "Resuming"): a checkpoint carries its run's settings
(the module's and the DataModule's hyperparameters); ``--ckpt_path`` compares them with this run's.

- A change to what defines the run (the loss and its kwargs, the KL, the batch shapes, the group,
  the sampling, the data, the seed, the model) is refused, naming each key old -> new: the resumed
  run would be another run, mixed.
- A change to the optimizer's settings (lr, betas, weight_decay) is refused too: the optimizer
  state restored from the checkpoint keeps the old values, so the new ones would be recorded in
  ``hparams.yaml`` and not used. ``warmup_steps``, ``max_grad_norm`` and the trainer's
  ``max_steps`` are read afresh and take effect, said in the log.
- ``ASPO_LIT_RESUME_WITH_CHANGES=1`` continues with every change applied (the optimizer's
  settings set on its parameter groups and scheduler), each logged as a warning.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

#: the environment variable an expert sets to resume with changes
ALLOW_CHANGES = "ASPO_LIT_RESUME_WITH_CHANGES"

DEFINING = {
    "model": ("model_name_or_path", "testbed", "loss_name", "loss_kwargs", "kl_coef", "kl_kind", "ppo_epochs",
              "mini_batch_size", "torch_dtype", "old_logprobs", "rollout_is_cap", "shuffle_mini_batches"),
    "data": ("_class_path", "train_files", "problem_key", "answer_key", "dedup", "batch_size", "group_size",
             "max_prompt_length", "max_response_length", "temperature", "top_p", "stop", "adv_norm", "filter_groups",
             "overlong_buffer", "overlong_penalty_factor", "prompt_template", "seed", "num_train", "levels", "ops",
             "max_value", "data_seed", "sandbox", "reward_timeout_s", "reward_max_tests", "enable_thinking",
             "system_prompt"),
}
#: the config key of a saved hyperparameter whose name differs
CONFIG_KEY = {"loss_name": "loss", "_class_path": "class_path"}
#: restored with the optimizer's state: a new value would be recorded but not used
OPTIMIZER = ("lr", "betas", "weight_decay")
#: read afresh on resume: a new value takes effect
READ_AFRESH = ("warmup_steps", "max_grad_norm")


def _plain(value: Any) -> Any:
    """A hyperparameter as comparable data (tuples as lists, mappings as dicts)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def changes(saved: Mapping[str, Any], current: Mapping[str, Any], keys: tuple[str, ...], prefix: str) -> list[str]:
    """``prefix.key: old -> new`` for each of `keys` whose value differs (a key missing on one side
    is a change only when the other side has it)."""
    out = []
    for key in keys:
        if key not in saved and key not in current:
            continue
        old, new = _plain(saved.get(key)), _plain(current.get(key))
        if old != new:
            out.append(f"{prefix}.{CONFIG_KEY.get(key, key)}: {old!r} -> {new!r}")
    return out


def resume_changes(checkpoint: Mapping[str, Any], model: Mapping[str, Any], data: Mapping[str, Any] | None
                   ) -> dict[str, list[str]]:
    """This run's changes against the checkpoint's run, by kind: ``defining``, ``optimizer``,
    ``read_afresh``."""
    saved_model = checkpoint.get("hyper_parameters") or {}
    saved_data = checkpoint.get("datamodule_hyper_parameters") or {}
    defining = changes(saved_model, model, DEFINING["model"], "model")
    if data is not None:
        defining += changes(saved_data, data, DEFINING["data"], "data")
    return {"defining": defining, "optimizer": changes(saved_model, model, OPTIMIZER, "model"),
            "read_afresh": changes(saved_model, model, READ_AFRESH, "model")}


def allowed() -> bool:
    return os.environ.get(ALLOW_CHANGES, "") not in ("", "0")


def refusal(path: Any, found: dict[str, list[str]]) -> str | None:
    """The error for a resume whose changes are not allowed, or None."""
    refused = found["defining"] + [f"{c} (the optimizer state restored from the checkpoint keeps the old value)"
                                   for c in found["optimizer"]]
    if not refused or allowed():
        return None
    lines = "\n".join(f"  {c}" for c in refused)
    return (f"resuming {path}: this run differs from the one that wrote the checkpoint in\n{lines}\n"
            "A resumed run continues the run it resumes: undo these, or start a new run under another name "
            f"(trainer.logger.init_args.name); to continue with them anyway, set {ALLOW_CHANGES}=1 (each change "
            "is logged)")


def apply_optimizer_settings(optimizers: list[Any], schedulers: list[Any], model: Mapping[str, Any]) -> None:
    """Set this run's lr, betas and weight_decay on the restored optimizers (and the schedulers'
    base lr, so that the schedule continues from the new one)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            scale = group["lr"] / group["initial_lr"] if group.get("initial_lr") else 1.0
            group["initial_lr"] = float(model["lr"])
            group["lr"] = float(model["lr"]) * scale
            group["betas"] = tuple(model["betas"])
            group["weight_decay"] = float(model["weight_decay"])
    for scheduler in schedulers:
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [float(model["lr"])] * len(scheduler.base_lrs)
