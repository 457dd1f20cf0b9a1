"""Faults that say where to look, in one line naming the file, field or sample and the fix: a
non-UTF-8 row, an empty data file, an unloadable checkpoint, a non-finite reward, a skipped step."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from aspo_lit.data.sources import BadRowError
from aspo_lit.tasks.math import MathTask
from aspo_lit.training.checkpoint_io import AtomicCheckpointIO, CheckpointUnreadable
from aspo_lit.training.export import load_checkpoint
from aspo_lit.training.module import ASPOModule

ROW = b'{"problem": "1+1?", "answer": "2"}\n'


def test_a_non_utf8_row_is_a_bad_row_named_by_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(ROW + b'{"problem": "caf\xe9?", "answer": "3"}\n' + ROW.replace(b"1+1", b"2+2"))
    with pytest.raises(BadRowError, match=rf"{path}:2: not UTF-8 \(byte 0xe9 at column 17\)"):
        MathTask(str(path)).rows("train")
    task = MathTask(str(path), on_bad_row="skip")
    assert [r["problem"] for r in task.rows("train")] == ["1+1?", "2+2?"]
    assert task.stats["data/train/train/bad_rows"] == 1.0 and task.stats["data/train/train/kept"] == 2.0


def test_an_empty_data_file_is_named_by_its_full_path(tmp_path):
    path = tmp_path / "sub" / "train.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"")
    with pytest.raises(BadRowError, match=rf"data.train_files: no usable rows in train \({path}\)"):
        MathTask(str(path)).rows("train")


@pytest.mark.parametrize("content, what", [(b"", r"empty \(0 bytes"),
                                           (os.urandom(4096), r"not a PyTorch checkpoint \(4096 bytes starting"),
                                           (None, r"torn or corrupt")])
def test_an_unloadable_checkpoint_names_what_is_wrong_and_what_to_use(tmp_path, content, what):
    good, bad = tmp_path / "epoch=0-step=4.ckpt", tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(64)}, "global_step": 4}, good)
    bad.write_bytes(content if content is not None else good.read_bytes()[:300])   # a torn copy
    for load in (AtomicCheckpointIO().load_checkpoint, load_checkpoint):
        with pytest.raises(CheckpointUnreadable, match=rf"checkpoint {bad} cannot be loaded: {what}.*; resume from "
                                                       rf"{good} \(--ckpt_path {good}\)") as caught:
            load(bad)
        assert "weights_only" not in str(caught.value)


def test_a_non_finite_reward_names_the_grader_and_the_sample():
    from tests.unit.test_rollout_controller import _controller, _records

    class Broken:
        def batch(self, texts, golds):
            return [math.nan if t == "p1-2" else 0.0 for t in texts]

    controller, _ = _controller()
    controller.grader = Broken
    with pytest.raises(ValueError, match=r"Broken gave a reward of nan to sample 2 of prompt id 1 \(of 1 non-finite "
                                         r"in this batch\): a reward must be a finite number; response starts 'p1-2'"):
        controller.rollout(_records(["-1", "-9"]), seed=0)


def test_a_skipped_non_finite_step_is_said_with_its_step():
    policy = torch.nn.Linear(2, 1)
    policy.weight.grad = torch.full_like(policy.weight, math.nan)
    module = SimpleNamespace(grad_scaler=None, policy=policy, global_step=7, _nonfinite_in_a_row=0,
                             skipped_steps_total=0, _all_ranks_finite=lambda *flags: flags,
                             hparams=SimpleNamespace(max_grad_norm=1.0, max_nonfinite_steps=3))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"step 7: skipped an optimizer step with a non-finite gradient norm "
                                         r"\(1 in a row; the run stops at model.max_nonfinite_steps=3\)"):
        ASPOModule._clip_and_step(module, optimizer, True)
    assert module.skipped_steps_total == 1
