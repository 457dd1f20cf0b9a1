"""ASPOCLI: LightningCLI with omegaconf interpolation, composable configs and early config checks.

A config may name a base config with a top-level `config: base.yaml` key (jsonargparse reads it
first, the rest of the file overrides it), and several `--config` files compose left to right:

    python -m aspo_lit fit --config conf/aspo.yaml --config conf/ablations/cispo.yaml
"""

from __future__ import annotations

from typing import Any

import argparse
import warnings

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningCLI

from aspo_lit.module import ASPOModule
from data_modules.math import MathRLDataModule


# Expected here, not actionable: the checkpoint is meant to hold the state after a completed step
# (manual optimisation), and the frozen reference policy is in eval mode on purpose.
for _message in (r".*no pre-optimization state was saved.*", r".*module\(s\) in eval mode at the start of training.*",
                 r".*isinstance\(treespec, LeafSpec\).*"):
    warnings.filterwarnings("ignore", message=_message)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def check_config(cfg: Any) -> None:
    """Cross-key checks that single classes cannot do, run before anything is instantiated."""
    model, data = cfg.get("model", {}), cfg.get("data", {})
    data_args = data.get("init_args", data) if hasattr(data, "get") else {}
    batch = data_args.get("batch_size")
    mini = model.get("mini_batch_size")
    group = data_args.get("group_size")
    if group is not None and group < 2:
        raise ConfigError(f"data.group_size must be >= 2 for group-relative advantages, got {group}")
    if batch is not None and batch < 1:
        raise ConfigError(f"data.batch_size must be a positive integer, got {batch}")
    if mini is not None and mini < 1:
        raise ConfigError(f"model.mini_batch_size must be a positive integer, got {mini}")
    if batch and mini and batch % mini:
        raise ConfigError(f"model.mini_batch_size={mini} must divide data.batch_size={batch} (both count prompts)")
    trainer = cfg.get("trainer", {})
    devices = trainer.get("devices")
    world = (devices if isinstance(devices, int) and devices > 0 else 1) * (trainer.get("num_nodes") or 1)
    if batch and mini and world > 1 and mini % world:
        raise ConfigError(f"model.mini_batch_size={mini} must be divisible by the number of processes ({world})")


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's line breaks (the list of aspo-lit tools)."""


class ASPOCLI(LightningCLI):
    def __init__(self, args: list[str] | None = None, epilog: str | None = None, **kwargs: Any) -> None:
        parser_kwargs = {"parser_mode": "omegaconf", "epilog": epilog, "formatter_class": _HelpFormatter}
        parser_kwargs.update({cmd: {"parser_mode": "omegaconf"} for cmd in ("fit", "validate", "test", "predict")})
        super().__init__(
            ASPOModule,
            MathRLDataModule,
            subclass_mode_data=True,
            args=args,
            parser_kwargs=parser_kwargs,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={
                "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}},
                "log_every_n_steps": 1,
                "num_sanity_val_steps": 0,
            },
            **kwargs,
        )

    def add_arguments_to_parser(self, parser) -> None:
        # Log-probs must be of the distribution the engine sampled from.
        parser.link_arguments("data.init_args.temperature", "model.temperature", apply_on="parse")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        check_config(cfg)
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
