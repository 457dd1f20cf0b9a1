"""The README's example diagnostic works when named by ``class_path`` in YAML (as LightningCLI
reads ``trainer.callbacks``), and logs its metric through the Trainer's logger."""

from __future__ import annotations

import inspect

import pytest
from jsonargparse import ArgumentParser
from lightning.pytorch.callbacks import Callback

from aspo_lit.callbacks import examples
from tests.test_callbacks import SHORT, fit, last_logged

YAML = """
callbacks:
  - class_path: aspo_lit.callbacks.examples.BoxedAnswerRate
    init_args:
      prog_bar: [train/boxed_rate]
"""


def test_example_is_short():
    assert len(inspect.getsource(examples.BoxedAnswerRate).splitlines()) <= 15


def test_example_named_in_yaml_logs_its_metric(tmp_path):
    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    callbacks = parser.instantiate_classes(parser.parse_string(YAML)).callbacks
    assert type(callbacks[0]) is examples.BoxedAnswerRate
    logged = last_logged(fit(tmp_path, callbacks).log_dir)
    assert "\\boxed" in SHORT
    assert logged["train/boxed_rate"] == pytest.approx(0.25)  # 1 of the 4 synthetic responses
