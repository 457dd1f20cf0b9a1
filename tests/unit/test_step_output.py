"""The step's output is a typed object (`aspo_lit.maths.step.StepOutput`): what a real training step
returns, the ratio the loss used (clamped as the loss clamps it), statistic names fixed before the
step runs, and the shape contract it enforces."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from aspo_lit.maths.sampler_mismatch import MISMATCH_KEYS
from aspo_lit.maths.stats import Stat
from aspo_lit.maths.step import StepOutput
from aspo_lit.training.module import ASPOModule
from tools.fixed_rollouts import GROUPS, FixedRollouts


class Keep(Callback):
    def __init__(self):
        self.outputs = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs.append(outputs)


@pytest.mark.numerics
def test_training_step_returns_the_typed_step(tiny_model_dir, tmp_path):
    clamp = 0.01  # small enough that the second mini-batch's tokens hit it
    module = ASPOModule(model_name_or_path=str(tiny_model_dir), loss="aspo", loss_kwargs={"clamp_log_ratio": clamp},
                        lr=1e-2, warmup_steps=0, kl_coef=0.01, mini_batch_size=GROUPS // 2, micro_batch_size=5)
    keep = Keep()
    trainer = Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[keep], limit_val_batches=0)
    trainer.fit(module, datamodule=FixedRollouts(steps=1))
    (step,) = keep.outputs
    assert isinstance(step, StepOutput) and torch.equal(step["rewards"], step.rewards)

    log_ratio = step.logprobs - step.old_logprobs
    assert log_ratio.abs().max() > clamp                      # the update moved tokens past the clamp
    assert torch.equal(step.ratio, log_ratio.clamp(-clamp, clamp).exp())  # the loss's own ops on its values: exact
    moved = step.response_mask.bool() & (log_ratio.abs() > 1e-6)
    assert 0 < moved.sum() < step.response_mask.sum()           # the first mini-batch's tokens did not move
    # one epoch: the first mini-batch is the first step's rows, and only they are unmoved
    assert int(step.first_minibatch.sum()) == step.response_mask.shape[0] // 2
    assert not moved[step.first_minibatch].any() and moved[~step.first_minibatch].any(1).all()
    assert not torch.equal(step.updated_entropy[moved], step.entropy[moved])

    declared = set(module.stat_reductions)
    assert declared >= {"clip/pos_high", "ratio/pos_mean", "train/pg_loss", "train/kl", "train/grad_norm"}
    timings = {"timing/old_logprob_s", "timing/update_s"}
    assert set(step.stats) == declared | set(MISMATCH_KEYS) | timings | {"train/skipped_steps",
                                                                         "train/updates_per_rollout"}
    assert all(isinstance(s, Stat) for s in step.stats.values())
    assert float(step.stats["train/updates_per_rollout"]) == 2 and step.stats["train/updates_per_rollout"].reduce == "max"


def test_step_output_enforces_its_shapes():
    mask = torch.ones(2, 3)
    fields = dict(response_mask=mask, old_logprobs=mask, entropy=mask, logprobs=mask, ratio=mask,
                  updated_entropy=mask, token_weight=mask, advantages=torch.ones(2), rewards=torch.ones(2),
                  response_lengths=torch.ones(2), truncated=torch.zeros(2, dtype=torch.bool), texts=["a", "b"])
    step = StepOutput(**fields, stats={"x": Stat.mean(1.0)})
    assert type(step.copy()) is StepOutput and list(step) == list(fields) + ["stats", "first_minibatch"]
    assert step.first_minibatch is None
    with pytest.raises(ValueError, match=r"StepOutput.first_minibatch.*\[N\] = \[2\]"):
        StepOutput(**fields, first_minibatch=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="StepOutput.ratio"):
        StepOutput(**{**fields, "ratio": torch.ones(2, 4)})
    with pytest.raises(ValueError, match=r"StepOutput.rewards.*\[N\] = \[2\]"):
        StepOutput(**{**fields, "rewards": torch.ones(3)})
    with pytest.raises(ValueError, match="texts"):
        StepOutput(**{**fields, "texts": ["a"]})
    with pytest.raises(ValueError, match="Stat values"):
        StepOutput(**fields, stats={"x": 1.0})
