"""A fit's validation as an offline evaluation: ``python -m aspo_lit evaluate --like_fit``.

A fit logs ``val/avg@K`` and ``val/pass@K`` of its held-out problems (`ASPOModule.validation_step`),
sampled and graded by its DataModule's rollout controller
(`aspo_lit.rollout_stage.controller.RolloutController.evaluate`). ``evaluate`` on
its own samples as the paper's evaluation (top_p 0.95, a seed per engine call, the benchmark's
prompt), so on the same checkpoint the two numbers differ by sampling noise. With ``--like_fit`` it
takes from the fit's saved config what the validation loop used, and draws the same samples:

* the problems: its task's held-out rows (its held-out split, ``val_max_problems``, prompts
  over ``max_prompt_length`` dropped), in its order, encoded by the task's ``encode_row`` with the
  fit's tokenizer (``model.model_name_or_path``);
* the sampling: its controller's `val_sampling` (``val_temperature``, top_p 1.0, ``max_response_length``,
  ``stop``), K = ``val_k``;
* the calls and seeds: ``val_batch_size`` consecutive problems x K samples per engine call, each
  call seeded with the run's seed (`fit_seed`), as its validation dataloader batches them;
* the engine (``data.engine``), in the policy's dtype (``model.torch_dtype``), and the grader
  (``data.reward``).

With the transformers engine on one process the samples are the fit's bit for bit, so avg@K and
pass@K are the logged ones (tests/integration/test_val_equals_eval.py). A fit on several processes
split each batch over its ranks, each rank sampling its share with its own seed (docs/gpu.md,
"Validation shards"): the evaluation, one process, warns that it draws other samples of the same
problems (`fit_processes`). docs/evaluation.md, "In-training
validation and offline evaluation", says where the two may still differ.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from aspo_lit.configs import check_moved_class_paths
from aspo_lit.rollout import SamplingConfig
from aspo_lit.training.export import is_checkpoint

log = logging.getLogger(__name__)

#: The benchmark name of a fit's held-out problems in the results folder (``fit_val.done.json``).
FIT_VAL = "fit_val"


@dataclass(frozen=True)
class FitValidation:
    """What a fit's validation loop sampled and graded, as `evaluate_model` takes it."""

    config: Path                   # the fit's config.yaml
    datamodule: str                # its data.class_path
    rows: list[dict[str, Any]]     # {id, problem, answer, prompt_ids, ...}, in the loop's order
    k: int                         # data.val_k
    sampling: SamplingConfig       # RolloutController.val_sampling()
    val_batch_size: int            # problems per engine call
    engine: Any                    # data.engine: a name or a RolloutEngine
    dtype: str | None              # model.torch_dtype (None: "auto", the evaluation's default)
    template: str                  # data.prompt_template
    reward: Any                    # data.reward (the DataModule's grader)
    domain: str                    # "math" or "code"

    def benchmark(self) -> dict[str, Any]:
        prompts = hashlib.sha1(repr([row["prompt_ids"] for row in self.rows]).encode()).hexdigest()
        return {"name": FIT_VAL, "k": self.k, "rows": self.rows, "domain": self.domain,
                "meta": {"like_fit": str(self.config), "datamodule": self.datamodule, "prompt_ids_sha1": prompts}}

    def evaluate_kwargs(self) -> dict[str, Any]:
        s = self.sampling
        return {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens, "stop": s.stop,
                "seed": s.seed, "fit_batches": self.val_batch_size, "engine": self.engine, "dtype": self.dtype,
                "template": self.template, "reward": self.reward, "code_reward": self.reward}


def fit_config_path(config: str | Path) -> Path:
    """A fit's config.yaml: the file itself or the version folder that holds it."""
    path = Path(config)
    if path.is_dir():
        path = path / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"like_fit: no fit config {str(path)!r} (a fit writes runs/NAME/version_N/config.yaml)")
    return path


def fit_seed(config: dict[str, Any], checkpoint: str | Path | None = None) -> int:
    """The seed the fit's validation sampled with (`aspo_lit.maths.seeding.run_seed`): ``data.seed``,
    else ``seed_everything`` (LightningCLI writes the seed it drew), else 0; a checkpoint's own
    record wins (a resumed run keeps its first launch's seed, `RLDataModule.load_state_dict`)."""
    data = config.get("data") or {}
    seed = (data.get("init_args") or {}).get("seed")
    if seed is None:
        everything = config.get("seed_everything")
        seed = everything if isinstance(everything, int) and not isinstance(everything, bool) else 0
    if checkpoint is not None and is_checkpoint(checkpoint) and Path(checkpoint).exists():
        state = _checkpoint_entry(Path(checkpoint), str(data.get("class_path", "")).rsplit(".", 1)[-1])
        if isinstance(state, dict) and state.get("seed") is not None and int(state["seed"]) != int(seed):
            log.warning("like_fit: %s sampled with seed %s (its config says %s): using the checkpoint's",
                        checkpoint, state["seed"], seed)
            seed = state["seed"]
    return int(seed)


def fit_processes(config: dict[str, Any]) -> int | None:
    """The fit's training processes, ``trainer.devices`` x ``trainer.num_nodes`` of its config;
    None when the config does not say (``devices: auto`` or ``-1``: the host's devices)."""
    trainer = config.get("trainer") or {}
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1) or 1
    if isinstance(devices, (list, tuple)):
        count = len(devices)
    elif isinstance(devices, str) and "," in devices:
        count = len([d for d in devices.split(",") if d.strip()])
    else:
        try:
            count = int(devices)
        except (TypeError, ValueError):
            return None
    return count * int(nodes) if count >= 1 else None


def _warn_if_sharded(path: Path, config: dict[str, Any]) -> None:
    """A fit on several processes sampled each rank's share of a batch with that rank's seed
    (`aspo_lit.rollout_stage.controller.val_seed`): one process draws other samples of the same problems."""
    processes = fit_processes(config)
    if processes == 1:
        return
    trainer = config.get("trainer") or {}
    ran = (f"ran on {processes} processes" if processes else
           f"may have run on several processes (trainer.devices={trainer.get('devices', 'auto')!r})")
    log.warning("like_fit: the fit of %s %s: its validation split every batch of data.val_batch_size problems "
                "over the ranks, each sampling its share with its own seed (docs/gpu.md, \"Validation shards\"). "
                "This one-process evaluation samples them all as a one-process fit would: the same problems and "
                "settings, other samples; expect the logged val/avg@K within its standard error, not sample for "
                "sample", path, ran)


def fit_validation(config: str | Path, checkpoint: str | Path | None = None) -> FitValidation:
    """The fit's validation settings, from its config.yaml (and `checkpoint`, for its seed): its
    DataModule's task (rows, prompt, reward) and rollout controller (sampling, engine), built from
    the config as the fit built them; no policy is loaded, only the fit's tokenizer."""
    from aspo_lit.training.models import load_tokenizer

    path = fit_config_path(config)
    cfg = yaml.safe_load(path.read_text()) or {}
    data, model = cfg.get("data"), cfg.get("model") or {}
    if not isinstance(data, dict) or not data.get("class_path"):
        raise ValueError(f"like_fit: {path} has no data.class_path: not the config.yaml a fit writes")
    check_moved_class_paths(path.read_text(errors="replace"), f"like_fit: {path}")
    base = model.get("model_name_or_path")
    if not base:
        raise ValueError(f"like_fit: {path} has no model.model_name_or_path")
    _warn_if_sharded(path, cfg)
    init_args = {**(data.get("init_args") or {}), "seed": fit_seed(cfg, checkpoint)}
    datamodule = _datamodule({"class_path": data["class_path"], "init_args": init_args})
    task, controller, hp = datamodule.task, datamodule.controller, datamodule.hparams
    rows = task.rows("val")
    if not rows:
        raise ValueError(f"like_fit: the fit of {path} has no held-out problems (data.val_files / data.num_val)")
    # the fit's tokenizer (ASPOModule.tokenizer) encodes them as its DataModule's val_rows did
    rows = task.encode(rows[: hp.val_max_problems], "val", load_tokenizer(base), hp.max_prompt_length)
    dtype = model.get("torch_dtype", "float32")
    return FitValidation(
        config=path, datamodule=data["class_path"], rows=rows, k=controller.settings.val_k,
        sampling=controller.val_sampling(), val_batch_size=hp.val_batch_size, engine=controller.engine_spec,
        dtype=None if dtype == "auto" else dtype, template=hp.prompt_template, reward=task.reward, domain=task.domain)


def _datamodule(spec: dict[str, Any]):
    """The fit's DataModule, built from its ``data`` config as LightningCLI builds it."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningDataModule

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data", required=True)
    cfg = parser.parse_object({"data": spec})
    return parser.instantiate_classes(cfg)["data"]


def _checkpoint_entry(path: Path, key: str) -> Any:
    """One top-level entry of a Lightning checkpoint, without reading its weights into memory
    (memory-mapped; a sharded checkpoint folder keeps such entries in ``meta.pt``)."""
    file = path / "meta.pt" if path.is_dir() else path
    try:
        checkpoint = torch.load(file, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:   # noqa: BLE001 - the seed then comes from the config; export reports a bad file
        log.warning("like_fit: cannot read %s (%s): the seed comes from the config", file, err)
        return None
    return checkpoint.get(key)
