"""Where a rollout batch's wall clock goes: every second between two batches, by what spent it.

Lightning names every hook it runs through the trainer's profiler (``[Callback]EntropyMonitor.
on_train_batch_end``, ``[LightningDataModule]RLDataModule.on_after_batch_transfer``,
``run_training_batch``, ``[_TrainingEpochLoop].train_dataloader_next``, ...). :class:`BatchTimer` is
such a profiler: it keeps each action's *own* seconds (its time less that of the actions it
encloses), so the actions partition the time they cover, and forwards every call to the profiler it
wraps, so a user's ``--trainer.profiler`` still sees everything. :func:`batch_accounting` groups one
window's own seconds into the ``timing/*`` keys `TrainingStats` logs; their sum is the window's
length, ``timing/batch_s``, and ``timing/unprofiled_s`` is what no action covered (docs/performance.md,
"The whole batch").
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

from lightning.pytorch.profilers import PassThroughProfiler, Profiler

#: The accounting's fixed keys (every rank logs the same names: they are reduced by collectives).
STAGES = ("timing/fetch_s", "timing/data_s", "timing/train_step_s", "timing/checkpoint_s", "timing/hooks_s",
          "timing/loop_s", "timing/validation_s")
VALIDATION = "validation:"
_TRAIN_STEP = re.compile(r"^(run_training_batch|optimizer_step|\[(LightningModule|Strategy)\][^.]+\."
                         r"(training_step|optimizer_step|backward|on_before_backward|on_after_backward|"
                         r"on_before_optimizer_step|on_before_zero_grad|optimizer_zero_grad|"
                         r"configure_gradient_clipping))$")


class BatchTimer(Profiler):
    """A Lightning profiler keeping each action's own wall seconds since the last :meth:`take`.

    Args:
        inner: the profiler it wraps, already set up, and forwards ``start``, ``stop``,
            ``summary``, ``describe`` and ``teardown`` to (the trainer's own: Lightning's
            ``PassThroughProfiler`` unless the user set one).
        clock: seconds, monotonic (``time.perf_counter``; a test passes its own).
    """

    def __init__(self, inner: Profiler | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.inner = inner if inner is not None else PassThroughProfiler()
        self.phase = ""  # "validation:" while a validation loop runs inside the training window
        self._clock = clock
        self._stack: list[list] = []  # [name, start, seconds of enclosed actions]
        self._own: dict[str, float] = defaultdict(float)
        self._mark = clock()

    def start(self, action_name: str) -> None:
        self._stack.append([self.phase + action_name, self._clock(), 0.0])
        self.inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)
        name = self.phase + action_name
        names = [frame[0] for frame in self._stack]
        if name not in names:  # the phase changed inside the action: match it by its bare name
            names = [frame[0].removeprefix(VALIDATION) for frame in self._stack]
            name = action_name
        if name not in names:
            return
        now = self._clock()
        depth = len(names) - 1 - names[::-1].index(name)
        while len(self._stack) > depth:  # Lightning nests strictly; an unclosed inner action ends here too
            self._close(self._stack.pop(), now)

    def _close(self, frame: list, now: float) -> None:
        name, start, enclosed = frame
        elapsed = now - start
        self._own[name] += elapsed - enclosed
        if self._stack:
            self._stack[-1][2] += elapsed

    def take(self) -> tuple[float, dict[str, float]]:
        """The window since the last call: its length and each action's own seconds in it. Open
        actions are cut at this instant and go on in the next window."""
        now = self._clock()
        open_child = 0.0  # the elapsed time of the open action inside this one
        for frame in reversed(self._stack):  # innermost first
            name, start, enclosed = frame
            elapsed = now - start
            self._own[name] += elapsed - enclosed - open_child
            open_child = elapsed
            frame[1], frame[2] = now, 0.0
        window, own = now - self._mark, dict(self._own)
        self._own.clear()
        self._mark = now
        return window, own

    def summary(self) -> str:
        return self.inner.summary()

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)
        super().teardown(stage)

    def describe(self) -> None:
        self.inner.describe()


def callback_key(name: str) -> str:
    """``timing/callback/<name>_s``."""
    return f"timing/callback/{name}_s"


def batch_accounting(window: float, own: Mapping[str, float], callbacks: Iterable[str]) -> dict[str, float]:
    """One window's own seconds per action as the logged ``timing/*`` keys, summing to ``window``:

    * ``timing/fetch_s``: the prompt loader's ``next`` (``train_dataloader_next``);
    * ``timing/data_s``: the DataModule's hooks: the rollout, its grading and the weight push
      (``timing/rollout_s``, ``reward_s``, ``weight_sync_s`` and, for an engine that sleeps,
      ``engine_wake_s`` and ``engine_sleep_s`` are inside it);
    * ``timing/train_step_s``: the training step and its optimizer hooks (``old_logprob_s`` and
      ``update_s`` are inside it);
    * ``timing/callback/<Name>_s``: each callback's hooks of the training loop (its class name);
    * ``timing/checkpoint_s``: writing checkpoints (``save_checkpoint``, whichever callback asks);
    * ``timing/validation_s``: a validation run inside the window, every hook of it;
    * ``timing/hooks_s``: the module's, the strategy's and unknown callbacks' other hooks;
    * ``timing/loop_s``: Lightning's loop itself between hooks (metrics to the loggers, progress);
    * ``timing/unprofiled_s``: the window less all of the above (time no action covers).
    """
    names = list(dict.fromkeys(callbacks))
    out = dict.fromkeys(STAGES, 0.0) | {callback_key(n): 0.0 for n in names}
    for action, seconds in own.items():
        out[_stage(action, names)] += seconds
    out["timing/unprofiled_s"] = window - sum(out.values())
    out["timing/batch_s"] = window
    return out


def _stage(action: str, callbacks: list[str]) -> str:
    if action.startswith(VALIDATION):
        return "timing/validation_s"
    if action.startswith("[Callback]"):
        name = re.split(r"[{.]", action.removeprefix("[Callback]"), maxsplit=1)[0]
        return callback_key(name) if name in callbacks else "timing/hooks_s"
    if action.startswith("[LightningDataModule]"):
        return "timing/data_s"
    if action.endswith("train_dataloader_next"):
        return "timing/fetch_s"
    if _TRAIN_STEP.match(action):
        return "timing/train_step_s"
    if action == "save_checkpoint":
        return "timing/checkpoint_s"
    if action.startswith("run_training_epoch") or action.startswith("run_stage") or not action.startswith("["):
        return "timing/loop_s"
    return "timing/hooks_s"
