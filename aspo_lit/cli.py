"""ASPOCLI: LightningCLI with omegaconf interpolation, composable configs and early config checks.

Several `--config` files compose left to right:

    python -m aspo_lit fit --config conf/aspo.yaml --config conf/ablations/cispo.yaml

A list such as `trainer.callbacks` is replaced by a later file's list; `callbacks+:` appends to it
instead (jsonargparse's append), which is how a callback is added to a shipped config:

    trainer:
      callbacks+:
        - mypkg.MyDiagnostic

A fit whose callbacks lack the checkpoint, the interrupt handler or `TrainingStats` gets a loud
warning naming them (`missing_callbacks`); so does a config whose every update is on-policy
(`on_policy_warning`).

A config may name its base with a top-level `config: base.yaml` key (a path relative to the
file, or a list of them). `expand_base_configs` turns it into explicit composition before
jsonargparse parses anything: `--config conf/grpo.yaml` becomes
`--config conf/aspo.yaml --config conf/grpo.yaml`, so every key the derived file does not write
keeps the base's value. (jsonargparse itself ignores a nested `config:` key.)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_warn

from aspo_lit.callbacks import GracefulInterrupt, RunCheckpoint, TrainingStats
from aspo_lit.configs import check_moved_class_paths
from aspo_lit.maths.fp16 import check_precision, check_weights_dtype
from aspo_lit.maths.sampler_mismatch import check_truncated_support
from aspo_lit.maths.settings import check_positive_int
from aspo_lit.maths.step import updates_per_rollout
from aspo_lit.maths.update_plan import rows_per_minibatch
from aspo_lit.rollout_stage.settings import check_group_size, prompts_per_rank
from aspo_lit.training.module import ASPOModule

# Expected here, not actionable: the checkpoint is meant to hold the state after a completed step
# (manual optimisation), and the frozen reference policy is in eval mode on purpose.
for _message in (r".*no pre-optimization state was saved.*", r".*module\(s\) in eval mode at the start of training.*",
                 r".*isinstance\(treespec, LeafSpec\).*"):
    warnings.filterwarnings("ignore", message=_message)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def check_config(cfg: Any) -> None:
    """The checks across objects (model, data, trainer) that no single class can do, run before anything
    is instantiated. The values they combine are first checked by their classes' own checks (the same
    functions), so that a bad one is reported by its key, not as a failed split."""
    model, data = cfg.get("model", {}), cfg.get("data", {})
    data_args = data.get("init_args", data) if hasattr(data, "get") else {}
    batch, mini, group = data_args.get("batch_size"), model.get("mini_batch_size"), data_args.get("group_size")
    trainer = cfg.get("trainer", {})
    devices = trainer.get("devices")
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    world = (devices if isinstance(devices, int) and devices > 0 else 1) * int(trainer.get("num_nodes") or 1)
    try:  # each value's own check first, so that a bad one is reported by its key; then the splits
        for key, value in (("data.batch_size", batch), ("model.mini_batch_size", mini)):
            if value is not None:
                check_positive_int(key, value)
        if group is not None:
            check_group_size(group)
        if batch is not None and mini is not None and batch % mini:
            raise ValueError(f"model.mini_batch_size={mini} must divide data.batch_size={batch} (both count prompts)")
        if batch is not None:
            prompts_per_rank(batch, world)
        if mini is not None and group is not None:
            rows_per_minibatch(mini, group, world)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    try:  # a nucleus cut where the sampler's log-probs reach the loss (aspo_lit.maths.sampler_mismatch)
        check_truncated_support(float(data_args.get("top_p") or 1.0), str(model.get("old_logprobs") or "recompute"),
                                model.get("rollout_is_cap"))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    precision = str(trainer.get("precision") or "")
    dtype = str(model.get("torch_dtype") or "float32")
    try:  # fp16 compute trains only with fp32 master weights and the grad scaler (aspo_lit.maths.fp16)
        check_precision(precision)
        check_weights_dtype(dtype)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    lr = model.get("lr")
    if precision == "bf16-true" or dtype == "bfloat16":
        if lr is not None and lr < 1e-4:
            half = precision if precision == "bf16-true" else dtype
            raise ConfigError(
                f"half-precision weights ({'trainer.precision' if half == precision else 'model.torch_dtype'}={half}) "
                f"cannot take AdamW steps of model.lr={lr}: most updates round away. Keep fp32 master weights "
                "(trainer.precision: 32-true, model.torch_dtype: float32) and compute in bf16 with "
                "trainer.strategy: aspo_lit.training.strategy.FSDP2Strategy (param_dtype: bfloat16)")


ESSENTIAL_CALLBACKS = (
    ("a checkpoint that keeps last.ckpt (aspo_lit.callbacks.RunCheckpoint with save_last: true): "
     "no resume with --ckpt_path last", lambda cb: isinstance(cb, ModelCheckpoint) and bool(cb.save_last)),
    ("aspo_lit.callbacks.GracefulInterrupt: Ctrl-C/SIGTERM lose the steps since the last checkpoint",
     lambda cb: isinstance(cb, GracefulInterrupt)),
    ("aspo_lit.callbacks.TrainingStats: no train/pg_loss, train/kl, train/grad_norm, clip/*, ratio/*, "
     "rewards or timings", lambda cb: isinstance(cb, TrainingStats)),
)


def missing_callbacks(callbacks: list[Callback]) -> list[str]:
    """What a fit loses for each essential callback that ``callbacks`` lacks."""
    return [what for what, present in ESSENTIAL_CALLBACKS if not any(present(cb) for cb in callbacks)]


def missing_callbacks_warning(missing: list[str]) -> str:
    lines = "\n".join(f"  - {what}" for what in missing)
    return ("aspo-lit: this run's trainer.callbacks lack\n" + lines + "\n"
            "A `trainer: callbacks:` list in a later --config replaces the earlier list. To add a callback to a "
            "shipped config, append it: `trainer: {callbacks+: [mypkg.MyDiagnostic]}` (README, \"Extending it\").")


def on_policy_warning(cfg: Any) -> str | None:
    """The warning for a config whose every update is on-policy (one optimizer step per rollout
    batch: r ≡ 1, so ASPO, GRPO and GRPO without IS make the same update), else None."""
    model, data = cfg.get("model", {}), cfg.get("data", {})
    data_args = data.get("init_args", data) if hasattr(data, "get") else {}
    batch, mini, epochs = data_args.get("batch_size"), model.get("mini_batch_size"), model.get("ppo_epochs") or 1
    if not (batch and mini) or updates_per_rollout(batch, mini, epochs) != 1:
        return None
    return (f"aspo-lit: every update is on-policy: data.batch_size={batch} prompts in one mini-batch "
            f"(model.mini_batch_size={mini}) and model.ppo_epochs={epochs} give one optimizer step per rollout "
            "batch, so the importance ratio r = π/π_old is 1 on every token and ASPO, GRPO and GRPO without IS "
            "make the same update (the paper's runs take 4 steps per batch: 64 / 16). Lower model.mini_batch_size "
            "or raise model.ppo_epochs for the ratio to act; train/updates_per_rollout and "
            "ratio/off_policy_share show it in the logs.")


def _bases(path: Path) -> list[Path]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []  # jsonargparse reports an unreadable config itself, naming the file
    base = data.get("config") if isinstance(data, dict) else None
    if base is None:
        return []
    names = base if isinstance(base, list) else [base]
    if not all(isinstance(name, str) for name in names):
        raise ConfigError(f"{path}: 'config' must name a base config file (or a list of them), got {base!r}")
    found = [(path.parent / name) for name in names]
    for base_path in found:
        if not base_path.is_file():
            raise ConfigError(f"{path}: base config {str(base_path)!r} (from 'config: {base}') does not exist")
    return found


def _with_bases(path: Path, chain: tuple[Path, ...] = ()) -> list[Path]:
    """`path` preceded by its bases (depth first, left to right); a cycle is an error."""
    if path.resolve() in chain:
        raise ConfigError(f"config files include each other: {' -> '.join(map(str, chain + (path.resolve(),)))}")
    out: list[Path] = []
    for base in _bases(path):
        out += _with_bases(base, chain + (path.resolve(),))
    return out + [path]


def expand_base_configs(argv: list[str]) -> list[str]:
    """Replace every `--config FILE` whose YAML names a base (`config: base.yaml`) by the chain
    `--config BASE ... --config FILE`, bases first."""
    out: list[str] = []
    applied: set[Path] = set()
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--config" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif word.startswith("--config="):
            value, i = word.split("=", 1)[1], i + 1
        else:
            try:
                check_moved_class_paths(word, "argument")
            except ValueError as err:
                raise ConfigError(str(err)) from err
            out.append(word)
            i += 1
            continue
        path = Path(value)
        chain = _with_bases(path) if path.is_file() else [value]
        for item in chain:
            if Path(item).is_file():
                try:
                    check_moved_class_paths(Path(item).read_text(errors="replace"), str(item))
                except ValueError as err:
                    raise ConfigError(str(err)) from err
        # a base already given earlier is not re-applied (it would undo the files in between)
        chain = [item for item in chain[:-1] if Path(item).resolve() not in applied] + chain[-1:]
        applied.update(Path(item).resolve() for item in chain)
        for item in chain:
            out += ["--config", str(item)]
    return out


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's line breaks (the list of aspo-lit tools)."""


class ASPOCLI(LightningCLI):
    def __init__(self, args: list[str] | None = None, epilog: str | None = None, **kwargs: Any) -> None:
        parser_kwargs = {"parser_mode": "omegaconf", "epilog": epilog, "formatter_class": _HelpFormatter}
        parser_kwargs.update({cmd: {"parser_mode": "omegaconf"} for cmd in ("fit", "validate", "test", "predict")})
        if args is None:  # LightningCLI warns when given args while sys.argv has words of its own
            sys.argv[1:] = expand_base_configs(sys.argv[1:])
        else:
            args = expand_base_configs(list(args))
        super().__init__(
            ASPOModule,
            LightningDataModule,
            subclass_mode_data=True,
            args=args,
            parser_kwargs=parser_kwargs,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={
                "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}},
                "log_every_n_steps": 1,
                "num_sanity_val_steps": 0,
                # validation under no_grad, as every multi-rank CPU run has it (gloo): under inference
                # mode (Lightning's default for FSDP2 on NCCL) an engine or FSDP2 buffer first made in a
                # validation loop holds inference tensors, which the next training step's in-place
                # update refuses
                "inference_mode": False,
            },
            **kwargs,
        )

    def add_arguments_to_parser(self, parser) -> None:
        # Log-probs must be of the distribution the engine sampled from.
        parser.link_arguments("data.init_args.temperature", "model.temperature", apply_on="parse")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        check_config(cfg)
        training = self.subcommand in ("fit", None)  # None: run=False, classes built to train
        warning = on_policy_warning(cfg) if training else None
        if warning:
            rank_zero_warn(warning)
        trainer = cfg.get("trainer")
        if trainer is not None and trainer.get("enable_progress_bar") is False and trainer.get("callbacks"):
            # `--trainer.enable_progress_bar=false` wins over a progress bar named in the config
            trainer.callbacks = [cb for cb in trainer.callbacks
                                 if not str(getattr(cb, "class_path", cb)).endswith("ProgressBar")]

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:  # our classes' own checks name the key
            raise ConfigError(str(err)) from err
        missing = missing_callbacks(self.trainer.callbacks) if self.subcommand in ("fit", None) else []
        if missing:
            rank_zero_warn(missing_callbacks_warning(missing))

    def before_fit(self) -> None:
        """``--ckpt_path last`` with nothing to resume stops in one line (Lightning would warn and
        start a new run)."""
        if self.config["fit"].get("ckpt_path") != "last":
            return
        ours = [cb for cb in self.trainer.checkpoint_callbacks if isinstance(cb, RunCheckpoint)]
        if not ours or any(cb.last_checkpoints(self.trainer) for cb in ours):
            return   # Lightning resolves "last" for another checkpoint callback itself
        raise ConfigError(f"--ckpt_path last: no last checkpoint in {ours[0].dirpath}: nothing to resume; leave "
                          "out --ckpt_path to start the run")
