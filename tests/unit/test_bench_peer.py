"""`tools.perf.bench_peer`'s set-up, without running either side: what its fits are told to load,
and that TRL's side grades with the config's reward."""

from __future__ import annotations

import importlib

from lightning.pytorch.callbacks import Callback

from aspo_lit.rewards import MathReward
from tools.perf import bench_peer


def test_the_clock_callback_resolves_from_the_fit_config():
    """The bench runs as ``python -m tools.perf.bench_peer``; the fit it starts imports the clock by
    the class path it writes into the config."""
    module_name, name = bench_peer.CLOCK_CLASS_PATH.rsplit(".", 1)
    clock = getattr(importlib.import_module(module_name), name)
    assert issubclass(clock, Callback) and clock.__name__ == "BatchClock"


def test_trl_grades_with_the_configs_reward():
    """Equal work: TRL's reward function is the reward the demo's DataModule builds, with its rule."""
    work = bench_peer.load_work(bench_peer.SHAPES["demo"])
    reward = work.make_reward()
    try:
        assert work.reward == {"class_path": "aspo_lit.rewards.MathReward", "init_args": {"verifier": "either"}}
        assert type(reward) is MathReward and reward.verifier == "either"
    finally:
        reward.close()
