"""The logging ecosystem: LearningRateMonitor in the shipped fit configs, the opt-in ThroughputMonitor
overlay, TensorBoard / W&B logger overlays (conf/loggers/), figures handed to the loggers
(`aspo_lit.training.figures.log_figure`), and metrics read back from whichever logger ran (`read_metrics`)."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from aspo_lit.__main__ import main, run_cli
from aspo_lit.callbacks.summary import rollout_responses, rollout_tokens
from aspo_lit.rollout import RolloutBatch
from aspo_lit.training.figures import find_metrics_source, log_figure, read_metrics
from tests.helpers.cli import effective
from tests.helpers.tolerance import rounding_tol

REPO = Path(__file__).resolve().parents[2]
LR_MONITOR = "lightning.pytorch.callbacks.LearningRateMonitor"


def scalars_and_images(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0, IMAGES: 0}).Reload()
    scalars = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()[SCALARS]}
    images = {t: [(e.step, e.width, e.height) for e in events.Images(t)] for t in events.Tags()[IMAGES]}
    return scalars, images


# --------------------------------------------------------------------------- configs
def fit_configs() -> list[str]:
    """Every shipped fit config under conf/ and conf/tiny/ (one with `trainer:` and `model:`)."""
    out = []
    for path in sorted([*REPO.glob("conf/*.yaml"), *REPO.glob("conf/tiny/*.yaml")]):
        data = yaml.safe_load(path.read_text()) or {}
        if "trainer" in data and "model" in data:
            out.append(path.relative_to(REPO).as_posix())
    return out


def own_callbacks(path: Path) -> list | None:
    """The `trainer.callbacks` list a config file writes, else its base's (`config: base.yaml`)."""
    data = yaml.safe_load(path.read_text()) or {}
    if "callbacks" in (data.get("trainer") or {}):
        return data["trainer"]["callbacks"]
    base = data.get("config")
    return own_callbacks(path.parent / base) if isinstance(base, str) else None


def test_every_fit_config_logs_the_learning_rate_per_step():
    configs = fit_configs()
    assert {"conf/aspo.yaml", "conf/grpo.yaml", "conf/tiny/aspo.yaml", "conf/tiny/grpo.yaml"} <= set(configs)
    for config in configs:
        callbacks = own_callbacks(REPO / config)
        if callbacks is None:  # composed on a full config (conf/tiny/code_*.yaml): callbacks from that one
            continue
        monitors = [c for c in callbacks if isinstance(c, dict) and c.get("class_path") == LR_MONITOR]
        assert len(monitors) == 1, config
        assert monitors[0]["init_args"]["logging_interval"] == "step", config


def test_logger_overlays_merge_into_the_effective_config(capsys):
    tb = effective("conf/tiny/aspo.yaml", "conf/loggers/tensorboard.yaml")["trainer"]["logger"]
    assert tb["class_path"] == "lightning.pytorch.loggers.TensorBoardLogger"
    assert (tb["init_args"]["save_dir"], tb["init_args"]["name"]) == ("runs", "tiny_aspo")  # kept from the base
    assert tb["init_args"]["default_hp_metric"] is False

    trainer = effective("conf/grpo.yaml", "conf/loggers/wandb.yaml", "conf/loggers/throughput.yaml")["trainer"]
    wb = trainer["logger"]
    assert wb["class_path"] == "lightning.pytorch.loggers.WandbLogger"
    assert (wb["init_args"]["name"], wb["init_args"]["save_dir"], wb["init_args"]["project"]) == ("grpo", "runs", "aspo-lit")
    names = [c["class_path"] for c in trainer["callbacks"]]
    assert names.count(LR_MONITOR) == 1                               # from conf/aspo.yaml, via grpo's base
    assert names[-1] == "lightning.pytorch.callbacks.ThroughputMonitor"  # appended, the rest kept
    assert names[:-1] == [c["class_path"] for c in effective("conf/grpo.yaml")["trainer"]["callbacks"]]
    throughput = trainer["callbacks"][-1]["init_args"]
    assert throughput["batch_size_fn"] == "aspo_lit.callbacks.summary.rollout_responses"
    assert throughput["length_fn"] == "aspo_lit.callbacks.summary.rollout_tokens"


# --------------------------------------------------------------------------- ThroughputMonitor measures
def test_rollout_measures_count_responses_and_real_tokens():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 1, 1, 0, 0]])
    batch = RolloutBatch(
        input_ids=torch.zeros(4, 5, dtype=torch.long), attention_mask=mask, response_mask=torch.ones(4, 2),
        prompt_length=3, rewards=torch.zeros(4), advantages=torch.zeros(4), group_size=2,
        texts=[""] * 4, prompts=[""] * 4, answers=[""] * 4, finish_reasons=["stop"] * 4,
        response_lengths=torch.tensor([2, 2, 2, 1]),
    )
    assert rollout_responses(batch) == 4
    assert rollout_tokens(batch) == 12
    graded = {"correct": torch.zeros(3, 4, dtype=torch.bool)}           # a validation batch: P=3, K=4
    assert rollout_responses(graded) == rollout_tokens(graded) == 12
    with pytest.raises(TypeError, match="RolloutBatch"):
        rollout_responses(torch.zeros(2))


# --------------------------------------------------------------------------- a real fit, TensorBoard
@pytest.mark.timeout(600)
def test_tensorboard_fit_logs_lr_throughput_and_figures_and_reads_back(testbed, tmp_path, capsys):
    """2 rollout batches on the CPU testbed with the TensorBoard overlay first (the run's folder) and
    a CSVLogger beside it: both loggers get the same scalars, TensorBoard also the figures."""
    csv_logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
                  "init_args": {"save_dir": str(tmp_path / "csv"), "name": "tiny_aspo"}}
    args = [
        "fit", "--config", str(REPO / "conf/tiny/aspo.yaml"), "--config", str(REPO / "conf/loggers/throughput.yaml"),
        "--config", str(REPO / "conf/loggers/tensorboard.yaml"),
        "--trainer.callbacks.init_args.window_size=2",                 # the appended ThroughputMonitor
        f"--model.model_name_or_path={testbed}", "--trainer.max_steps=4",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'tb'}", f"--trainer.logger+={json.dumps(csv_logger)}",
        "--trainer.enable_progress_bar=false", "--data.init_args.batch_size=8", "--data.init_args.group_size=4",
        "--data.init_args.num_val=0", "--data.init_args.max_response_length=48", "--model.mini_batch_size=4",
    ]
    trainer = run_cli(args).trainer
    summary = capsys.readouterr().out
    assert [type(lg) for lg in trainer.loggers] == [TensorBoardLogger, CSVLogger]
    run_dir = tmp_path / "tb" / "tiny_aspo" / "version_0"
    assert Path(trainer.log_dir) == run_dir and list(run_dir.glob("events.out.tfevents.*"))

    # ThroughputMonitor on CPU with manual optimisation: no flops to divide by, the rest logged
    (throughput,) = [cb for cb in trainer.callbacks if isinstance(cb, ThroughputMonitor)]
    assert throughput.available_flops is None
    assert any(isinstance(cb, LearningRateMonitor) for cb in trainer.callbacks)

    scalars, images = scalars_and_images(run_dir)
    assert [step for step, _ in scalars["train/reward_mean"]] == [0, 1]   # one step per rollout batch
    lr = scalars["lr-AdamW"]
    # the float64 learning rate as TensorBoard stores scalars, in fp32: one rounding
    assert [step for step, _ in lr] == [0, 1] and all(v == pytest.approx(2e-4, rel=rounding_tol(torch.float32, 1), abs=0)
                                                      for _, v in lr)
    assert [v for _, v in scalars["train/samples"]] == [32.0, 64.0]      # 8 prompts x 4 responses per batch
    lengths = [v for _, v in scalars["train/lengths"]]
    assert 64.0 < lengths[0] < lengths[1]                                  # > samples: prompt + response tokens
    assert [step for step, _ in scalars["train/device/samples_per_sec"]] == [1]  # once the window (2) is full
    assert scalars["train/device/items_per_sec"][0][1] > scalars["train/device/samples_per_sec"][0][1] > 0

    # the figure callbacks' PNGs, handed to TensorBoard at the last scalar step
    figures = run_dir / "figures"
    for tag, png in (("figures/token_weights", figures / "token_weights_step4.png"),
                     ("figures/figure2", figures / "figure2.png")):
        from matplotlib.image import imread

        height, width = imread(str(png)).shape[:2]
        assert images.get(tag) == [(1, width, height)], (tag, sorted(images))

    # read_metrics: the TensorBoard run gives the CSV logger's series, metric for metric
    from_tb = read_metrics(str(tmp_path / "tb" / "tiny_aspo"))
    from_csv = read_metrics(str(tmp_path / "csv" / "tiny_aspo" / "version_0" / "metrics.csv"))
    assert set(from_tb) == set(from_csv) and "lr-AdamW" in from_tb and "train/entropy" in from_tb
    for key, (steps, values) in from_csv.items():
        assert np.array_equal(from_tb[key][0], steps), key
        # TensorBoard keeps fp32 scalars, the CSV the logged value's repr: equal, or one fp32 rounding apart for
        # a value logged as a Python float
        np.testing.assert_allclose(from_tb[key][1], values, rtol=rounding_tol(torch.float32, 1), atol=0, err_msg=key)

    # RunSummary read the TensorBoard run; figure2 draws from it too
    reward = from_tb["train/reward_mean"][1]
    assert f"reward mean      {reward[0]:.3f} -> {reward[-1]:.3f}" in summary
    assert f"metrics (TensorBoard) {run_dir}" in summary
    assert main(["figure2", str(tmp_path / "tb" / "tiny_aspo"), "--out", str(tmp_path / "fig2")]) == 0
    assert (tmp_path / "fig2.png").stat().st_size > 10_000


# --------------------------------------------------------------------------- pieces, no fit
class ImageLogger:
    """A logger that takes images the way WandbLogger does (`log_image(key, images, step)`)."""

    def __init__(self):
        self.calls = []

    def log_image(self, key, images, step=None):
        self.calls.append((key, images, step))


def test_log_figure_goes_to_every_logger_that_takes_images(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1.5), dpi=50)
    fig.subplots().plot([0, 1], [1, 0])
    png = tmp_path / "f.png"
    fig.savefig(png)
    tb, images = TensorBoardLogger(str(tmp_path), name="tb"), ImageLogger()
    trainer = types.SimpleNamespace(loggers=[CSVLogger(str(tmp_path)), tb, images])

    assert log_figure(trainer, "figures/a", fig, step=3) == ["TensorBoardLogger", "ImageLogger"]
    assert log_figure(trainer, "figures/b", str(png), step=5) == ["TensorBoardLogger", "ImageLogger"]
    tb.save()
    _, logged = scalars_and_images(Path(tb.log_dir))
    assert logged == {"figures/a": [(3, 100, 75)], "figures/b": [(5, 100, 75)]}
    (key_a, (pixels,), step_a), (key_b, (path,), step_b) = images.calls
    assert (key_a, step_a, pixels.shape, pixels.dtype) == ("figures/a", 3, (75, 100, 3), np.uint8)
    assert (key_b, path, step_b) == ("figures/b", str(png), 5)           # the PNG file itself
    assert log_figure(types.SimpleNamespace(loggers=[CSVLogger(str(tmp_path))]), "figures/c", fig, 1) == []


def test_find_metrics_source_takes_the_newest_run_and_the_csv_beside_events(tmp_path):
    old, new = tmp_path / "run" / "version_0", tmp_path / "run" / "version_1"
    old.mkdir(parents=True)
    new.mkdir()
    (old / "metrics.csv").write_text("step,x\n0,1\n")
    (new / "events.out.tfevents.1.host.0").write_bytes(b"")
    os.utime(old / "metrics.csv", (1, 1))
    assert find_metrics_source(str(tmp_path / "run")) == str(new)
    (new / "metrics.csv").write_text("step,x\n0,1\n")
    assert find_metrics_source(str(tmp_path / "run")) == str(new / "metrics.csv")
    assert find_metrics_source("wandb:me/proj/abc") == "wandb:me/proj/abc"
    with pytest.raises(FileNotFoundError, match="TensorBoard"):
        find_metrics_source(str(tmp_path / "empty"))


def test_read_metrics_reads_a_wandb_run_through_the_api(monkeypatch):
    """W&B history is online only: `wandb.Api().run(path).scan_history()`, here a stand-in."""
    rows = [
        {"_step": 0, "_runtime": 1.0, "trainer/global_step": 0, "epoch": 0, "train/entropy": 0.5, "lr-AdamW": 1e-6},
        {"_step": 1, "trainer/global_step": 0, "figures/figure2": {"_type": "image-file"}},
        {"_step": 2, "trainer/global_step": 1, "train/entropy": float("nan"), "lr-AdamW": 1e-6},
        {"_step": 3, "trainer/global_step": 2, "train/entropy": 0.25, "flag": True},
    ]
    opened = []

    class Api:
        def run(self, path):
            opened.append(path)
            return types.SimpleNamespace(scan_history=lambda: iter(rows))

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Api=Api))
    metrics = read_metrics("wandb:me/aspo-lit/abc123")
    assert opened == ["me/aspo-lit/abc123"]
    assert sorted(metrics) == ["lr-AdamW", "train/entropy"]
    assert metrics["train/entropy"][0].tolist() == [0.0, 2.0] and metrics["train/entropy"][1].tolist() == [0.5, 0.25]
    assert metrics["lr-AdamW"][0].tolist() == [0.0, 1.0]


@pytest.mark.timeout(300)
def test_wandb_offline_gets_the_figures(tmp_path, monkeypatch, capsys):
    """A real WandbLogger (offline, no network) receives TokenWeightSurface's PNGs as images, and
    RunSummary, with no local scalars to read, names the W&B run instead."""
    pytest.importorskip("wandb")
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import WandbLogger

    from aspo_lit.callbacks import RunSummary, TokenWeightSurface
    from tests.unit.test_callbacks import DummyModule

    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="aspo-lit", name="t")
    module = DummyModule()
    module.hparams.update(model_name_or_path="dummy", loss_name="aspo")   # what RunSummary prints
    trainer = Trainer(max_steps=3, logger=logger, accelerator="cpu", log_every_n_steps=1,
                      callbacks=[TokenWeightSurface(every_n_steps=2), RunSummary()],
                      enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    try:
        trainer.fit(module)
        media = Path(logger.experiment.dir) / "media" / "images" / "figures"
        run_path = logger.experiment.path
    finally:
        logger.experiment.finish()
    assert len(list(media.glob("token_weights_*.png"))) == 2                # steps 2 and 3 (end of fit)
    run_dir = tmp_path / "aspo-lit" / run_path.split("/")[-1]       # <save_dir>/<project>/<run id>: runs stay apart
    assert len(list((run_dir / "figures").glob("token_weights_step*.png"))) == 2  # PNGs stay
    assert not (tmp_path / "figures").exists()
    summary = capsys.readouterr().out
    assert f"metrics (W&B)    wandb:{run_path}" in summary and "reward mean      n/a" in summary
    assert not (run_dir / "figures" / "figure2.png").exists()  # nothing local to draw from
