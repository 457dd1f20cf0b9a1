"""The example diagnostics work when named by ``class_path`` in YAML (as LightningCLI reads
``trainer.callbacks``), and log their metric through the Trainer's logger: a response-level one
(``BoxedAnswerRate``) and a token-level one (``TokenMeanRatio``, weighted over the response mask)."""

from __future__ import annotations

import inspect

import pytest
import torch
from jsonargparse import ArgumentParser
from lightning.pytorch.callbacks import Callback

from aspo_lit.callbacks import examples
from tests.helpers.tolerance import rounding_tol
from tests.unit.test_callbacks import LENGTHS, SHORT, DummyModule, fit, last_logged

YAML = """
callbacks:
  - class_path: aspo_lit.callbacks.examples.BoxedAnswerRate
    init_args:
      prog_bar: [train/boxed_rate]
  - aspo_lit.callbacks.examples.TokenMeanRatio
"""


def test_examples_are_short():
    assert len(inspect.getsource(examples.BoxedAnswerRate).splitlines()) <= 15
    assert len(inspect.getsource(examples.TokenMeanRatio).splitlines()) <= 8


def test_examples_named_in_yaml_log_their_metrics(tmp_path):
    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    callbacks = parser.instantiate_classes(parser.parse_string(YAML)).callbacks
    assert [type(cb) for cb in callbacks] == [examples.BoxedAnswerRate, examples.TokenMeanRatio]
    # responses of 5, 3, 2, 4 tokens whose tokens have ratios 2, 1, 0.5, 1; padding holds 7 (ignored)
    mask = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    ratio = torch.where(mask > 0, torch.tensor([2.0, 1.0, 0.5, 1.0])[:, None], 7.0)
    logged = last_logged(fit(tmp_path, callbacks, module=DummyModule(ratio=ratio)).log_dir)
    assert "\\boxed" in SHORT
    assert logged["train/boxed_rate"] == 0.25  # 1 of the 4 synthetic responses: exact
    # each token weighs 1: (5·2 + 3·1 + 2·0.5 + 4·1) / 14, not the responses' mean 1.125; exact sums, one
    # fp32 division
    assert logged["ratio/token_mean"] == pytest.approx(18 / 14, rel=rounding_tol(torch.float32, 1), abs=0)
