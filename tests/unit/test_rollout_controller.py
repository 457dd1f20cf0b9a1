"""The rollout controller without a Trainer: its schedule, grading, filter and shares, driven by hand
with a scripted engine and rank context (what a fit's DataModule hands it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aspo_lit.maths.advantages import group_advantages
from aspo_lit.maths.seeding import derived_seed
from aspo_lit.rollout.base import Completion
from aspo_lit.rollout.process import EngineProcessError
from aspo_lit.rollout_stage.controller import RolloutController, val_seed
from aspo_lit.rollout_stage.ranks import RankContext
from aspo_lit.rollout_stage.settings import RolloutSettings
from aspo_lit.training.module import PolicyHandle


class ScriptedEngine:
    """Completion j of prompt p is ``"p<p>-<j>"``; answers are graded by `EndsWith`. Records pushes
    and calls."""

    lockstep = False

    def __init__(self) -> None:
        self.pushes, self.calls = 0, []

    def attach(self, policy, tokenizer, model_path) -> None:
        self.attached = model_path

    def update_weights(self, state) -> None:
        self.pushes += 1

    def generate(self, prompts, n, sampling):
        self.calls.append((len(prompts), n, sampling))
        return [[Completion(token_ids=[7] * (j + 1), text=f"p{p[0]}-{j}", finish_reason="stop", logprobs=[-0.5] * (j + 1))
                 for j in range(n)] for p in prompts]

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass


class EndsWith:
    """1 when the text ends with the gold."""

    def batch(self, texts, golds):
        return [float(t.endswith(g)) for t, g in zip(texts, golds)]


class Ranks(RankContext):
    """Rank `rank` of `world`, at optimizer step `at`; `others` are the other ranks' gathered objects."""

    def __init__(self, rank=0, world=1, others=None, failing=False):
        self._rank, self._world, self.others, self.failing, self.at = rank, world, others or [], failing, 0

    @property
    def world_size(self):
        return self._world

    @property
    def rank(self):
        return self._rank

    def step(self):
        return self.at

    def any(self, flag):
        return flag or self.failing

    def all_gather(self, obj):
        return [obj, *self.others] if self._rank == 0 else [*self.others, obj]


def _controller(ranks=None, **settings) -> tuple[RolloutController, ScriptedEngine]:
    engine = ScriptedEngine()
    policy = PolicyHandle(tokenizer=SimpleNamespace(pad_token_id=0), policy=torch.nn.Linear(2, 2),
                          model_path="scripted", device=torch.device("cpu"))
    settings = RolloutSettings(**{"group_size": 4, "max_response_length": 8, **settings})
    return RolloutController(settings, engine, grader=EndsWith, policy=lambda: policy, seed=11, ranks=ranks), engine


def _records(golds):
    return [{"id": i, "problem": f"q{i}", "answer": g, "prompt_ids": [i, 1]} for i, g in enumerate(golds)]


def test_rollout_grades_groups_and_pushes_once_per_optimizer_step():
    ranks = Ranks()
    controller, engine = _controller(ranks)
    batch = controller.rollout(_records(["-1", "-9"]), seed=5)
    # prompt 0: one of 4 correct; prompt 1: none, so its advantages are 0 (eq. 1)
    assert batch.rewards.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert torch.equal(batch.advantages, group_advantages(batch.rewards, 4)[0])   # each reward beside its own
    assert batch.advantages[1] > 0 and batch.advantages[4:].tolist() == [0.0] * 4
    assert batch.stats["batch/solve_none"].value == 0.5 and batch.stats["batch/solve_all"].value == 0.0
    assert batch.texts[:2] == ["p0-0", "p0-1"] and batch.answers == ["-1"] * 4 + ["-9"] * 4
    assert engine.calls[0][1:] == (4, controller.settings.sampling(5))
    assert engine.pushes == 1                          # the first call always pushes
    controller.rollout(_records(["-1"]), seed=6)
    assert engine.pushes == 1                          # same optimizer step: no push
    ranks.at = 1
    controller.rollout(_records(["-1"]), seed=7)
    assert engine.pushes == 2


class Clock:
    """A stand-in for ``time.perf_counter`` that moves only when the engine says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SleepingEngine(ScriptedEngine):
    """An engine with sleep mode, on a scripted clock: a push takes 2 s (0.25 of them waking the
    weights), a generate 3 s (1 of them waking the KV cache), a sleep 0.5 s."""

    sleeps = True

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self._wake_s = clock, 7.0     # a wake before the rollout (a validation's): not its own

    def take_wake_seconds(self) -> float:
        seconds, self._wake_s = self._wake_s, 0.0
        return seconds

    def update_weights(self, state) -> None:
        super().update_weights(state)
        self.clock.now += 2.0
        self._wake_s += 0.25

    def generate(self, prompts, n, sampling):
        self.clock.now += 3.0
        self._wake_s += 1.0
        return super().generate(prompts, n, sampling)

    def sleep(self) -> None:
        self.clock.now += 0.5


def test_an_engine_that_sleeps_has_its_wake_and_sleep_timed_apart(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("aspo_lit.rollout_stage.controller.time.perf_counter", clock)
    controller, _ = _controller()
    controller.engine = SleepingEngine(clock)
    batch = controller.rollout(_records(["-1"]), seed=0)
    assert {k: v for k, v in batch.timings.items() if k != "timing/reward_s"} == {
        "timing/weight_sync_s": 1.75, "timing/engine_wake_s": 1.25, "timing/rollout_s": 2.0,
        "timing/engine_sleep_s": 0.5}
    controller.engine = ScriptedEngine()            # no sleep mode: generation and its no-op sleep, as before
    assert set(controller.rollout(_records(["-1"]), seed=0).timings) == {
        "timing/weight_sync_s", "timing/rollout_s", "timing/reward_s"}


def test_overlong_penalty_is_added_to_the_reward():
    controller, _ = _controller(overlong_buffer=4, max_response_length=4, overlong_penalty_factor=1.0)
    batch = controller.rollout(_records(["-0"]), seed=0)
    # lengths 1..4 of a 4-token limit with a 4-token buffer: DAPO's linear penalty -(L - 0) / 4
    assert batch.rewards.tolist() == [1.0 - 0.25, -0.5, -0.75, -1.0]


def test_filter_keeps_an_equal_share_of_the_global_batch_on_each_rank():
    row = {"id": 9, "problem": "x", "answer": "-0", "prompt_ids": [9, 1]}
    completions = ScriptedEngine().generate([row["prompt_ids"]], 4, None)[0]
    other = [(row, completions, torch.tensor([1.0, 0, 0, 0]), torch.ones(4), False)] * 2   # rank 1: two mixed groups
    controller, _ = _controller(Ranks(rank=0, world=2, others=[other]), filter_groups=True)
    batch = controller.rollout(_records(["-1", "-9", "-2"]), seed=0)      # rank 0: mixed, all-zero, mixed
    # global group g is rank g % 2's number g // 2: kept 0, 1, 3, 4 -> 2 a rank; rank 0 takes groups 0 and 1
    assert batch.stats["batch/filtered_groups"].value == 1.0                 # its all-zero group
    assert batch.stats["batch/filter_remainder_count"].value == 0.0
    assert batch.answers == ["-1"] * 4 + ["-0"] * 4 and len(batch.rewards) == 8


def test_a_lockstep_engine_gets_as_many_validation_prompts_on_every_rank():
    controller, engine = _controller(Ranks(rank=2, world=4))
    records = _records(["-0"] * 6)
    mine, filler = controller.val_share(records, engine)
    assert [r["id"] for r in mine] == [2] and filler == []
    engine.lockstep = True
    mine, filler = controller.val_share(records, engine)
    assert [r["id"] for r in mine] == [2] and [r["id"] for r in filler] == [0]      # 2 per rank
    out = controller.evaluate(records)
    assert out["correct"].shape == (1, controller.settings.val_k)
    assert engine.calls[-1][0] == 2 and engine.calls[-1][2].seed == val_seed(11, 2) == derived_seed(11, 2)


def test_another_ranks_engine_process_failure_stops_this_rank_before_any_push():
    controller, _ = _controller(Ranks(world=2, failing=True), max_staleness=1)
    pushed = []
    controller.engine_process = SimpleNamespace(push=lambda *a: pushed.append(a), close=lambda: None)
    with pytest.raises(EngineProcessError, match="another rank"):
        controller.stale_rollout(_records(["-0"]), counter=1, upcoming=lambda c: [])
    assert pushed == [] and controller.engine_process is None     # closed, nothing pushed
