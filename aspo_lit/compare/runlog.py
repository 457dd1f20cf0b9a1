"""A run as its log folder holds it: the logged series, the config, the seed and the testbed it
started from (what `reference` and `compare` read; docs/compare.md).

A run is whatever :func:`aspo_lit.training.figures.read_metrics` reads: a log folder (``runs/NAME/version_K``),
its ``metrics.csv``, a TensorBoard folder, or ``wandb:ENTITY/PROJECT/RUN_ID``. Steps are the logger's
step, the rollout batch index (docs/metrics.md). Its seed is ``seed_everything`` in the
``config.yaml`` LightningCLI writes beside the logs; its testbed is ``testbed`` in the
``hparams.yaml`` the logger writes (``testbed v1``; aspo_lit.testbed.shipped), or the identity of the
folder its ``model_name_or_path`` names.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aspo_lit.training.figures import WANDB_PREFIX, find_metrics_source, read_metrics

__all__ = ["CompareError", "RunLog", "load_run", "config_differences", "resolve_metrics", "SPEED_ONLY_KEYS",
           "ADDED_SETTINGS", "STEP_KEY"]

STEP_KEY = "step"
# config keys that differ between seeds of one config by construction (aspo_lit/maths/seeding.py) or say
# only where the logs went
_PER_RUN_KEY = re.compile(r"^(seed_everything|ckpt_path|trainer\.logger(\..*)?|trainer\.default_root_dir|(.*\.)?seed)$")
#: Settings that keep the maths and change at most the order of floating-point sums (how rows are
#: split into forward passes, whether a group's prompt is computed once; docs/performance.md) or
#: nothing a run logs (whether validation runs under inference mode or no_grad): runs that differ only
#: in these draw from one distribution, so a reference's bands apply to both.
SPEED_ONLY_KEYS = frozenset({"model.share_prompt", "model.max_tokens_per_micro_batch", "model.micro_batch_size",
                             "model.logprob_chunk_size", "trainer.inference_mode"})
#: Settings added after configs (and references) were recorded, with the value that keeps the old
#: behaviour: a config that lacks the key ran with that value (docs/staleness.md: k = 0 is the
#: synchronous loop bit for bit).
ADDED_SETTINGS = {"data.init_args.max_staleness": 0, "data.init_args.engine_threads": None}


class CompareError(ValueError):
    """Input that cannot be compared: the message names the file."""


@dataclass
class RunLog:
    """One run's logged series, with what its log folder says about it."""
    path: str
    source: str                                     # the metrics file or folder read
    series: dict[str, tuple[np.ndarray, np.ndarray]]
    last_step: float
    seed: int | None = None
    config_path: str | None = None
    config_text: str | None = None
    testbed: str | None = None                      # "testbed v1", "a local build of ...", None: not known

    @property
    def folder(self) -> str | None:
        """The log folder (figures go here by default); None for a W&B run."""
        if self.source.startswith(WANDB_PREFIX):
            return None
        return self.source if os.path.isdir(self.source) else os.path.dirname(self.source) or "."


def load_run(path: str) -> RunLog:
    """Read a run (:func:`aspo_lit.training.figures.read_metrics`), its ``config.yaml`` (the seed) and its
    ``hparams.yaml`` (the testbed); errors name the file."""
    path = os.fspath(path)
    try:
        source = find_metrics_source(path)
    except FileNotFoundError as err:
        raise CompareError(f"run {path}: {err}") from None
    try:
        series = read_metrics(source)
    except ImportError as err:
        raise CompareError(str(err)) from None
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as err:
        raise CompareError(f"run {source}: cannot read its metrics ({type(err).__name__}: {err})") from None
    if not series:
        raise CompareError(f"run {source}: no metric values with a '{STEP_KEY}' (not a CSVLogger metrics.csv "
                           "or TensorBoard log?)")
    run = RunLog(path, source, series, max(float(steps.max()) for steps, _ in series.values()))
    folder = run.folder
    config = os.path.join(folder, "config.yaml") if folder else None
    if config and os.path.isfile(config):
        run.config_path, run.config_text = config, Path(config).read_text()
        seed = load_yaml(run.config_text, config).get("seed_everything")
        run.seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
    hparams = os.path.join(folder, "hparams.yaml") if folder else None
    if hparams and os.path.isfile(hparams):
        run.testbed = _testbed(load_yaml(Path(hparams).read_text(), hparams))
    return run


def _testbed(hparams: dict) -> str | None:
    """``hparams['testbed']`` when the run logged it, else the identity of its model folder when that is
    a testbed on this machine (a run made before runs logged it)."""
    if isinstance(hparams.get("testbed"), str):
        return hparams["testbed"]
    model = hparams.get("model_name_or_path")
    if isinstance(model, str) and os.path.isdir(model):
        from aspo_lit.testbed.shipped import describe, identity

        ident = identity(model)
        return describe(ident) if ident else None
    return None


def load_yaml(text: str, where: str) -> dict:
    """``text`` as a YAML mapping ({} for anything else); a syntax error names ``where``."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise CompareError(f"{where}: not YAML ({err})") from None
    return data if isinstance(data, dict) else {}


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}{i}.").items()}
    return {prefix[:-1]: value}


def config_differences(text_a: str, text_b: str, where: str = "config") -> list[str]:
    """``key: a != b`` for every config key that differs, leaving out the keys that differ between
    seeds of one config (the seeds, the logger's folder)."""
    a, b = (_flatten(load_yaml(t, where)) for t in (text_a, text_b))

    def value(config: dict, key: str):
        return config.get(key, ADDED_SETTINGS.get(key, "<unset>"))

    keys = sorted(k for k in set(a) | set(b) if not _PER_RUN_KEY.match(k) and value(a, k) != value(b, k))
    return [f"{k}: {value(a, k)!r} != {value(b, k)!r}" for k in keys]


def resolve_metrics(names, keys) -> dict[str, list[str]]:
    """``{name: the logged keys it names}``: itself, or for a name with ``@K`` every ``@<number>`` key."""
    keys = sorted(keys)
    out = {}
    for name in names:
        if "@K" in name:
            pattern = re.compile("^" + re.escape(name).replace("@K", r"@\d+") + "$")
            out[name] = [k for k in keys if pattern.match(k)]
        else:
            out[name] = [name] if name in keys else []
    return out
