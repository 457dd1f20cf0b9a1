"""README's "Extending it" section, run verbatim: the diagnostic module, the YAML that appends it,
the command that trains with it (made small: the overrides below change sizes only), and the
loss. A reader who follows the README once keeps every shipped metric and gets the new ones."""

from __future__ import annotations

import csv
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.tolerance import rounding_tol

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--trainer.max_steps=2", "--trainer.enable_progress_bar=false", "--data.init_args.batch_size=8",
         "--data.init_args.group_size=4", "--data.init_args.num_val=0", "--data.init_args.max_response_length=32",
         "--model.mini_batch_size=4"]


def fresh_mypkg(tmp_path: Path, monkeypatch) -> Path:
    """An empty package ``mypkg`` in ``tmp_path``, importable, none imported before it."""
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "mypkg"


def readme_blocks(heading: str) -> dict[str, list[str]]:
    """The fenced blocks of the README section under ``heading``, by language."""
    text = (REPO / "README.md").read_text()
    start = text.index(heading)
    end = text.find("\n### ", start + len(heading))
    blocks: dict[str, list[str]] = {}
    for language, body in re.findall(r"```(\w+)\n(.*?)```", text[start:end if end > 0 else None], re.S):
        blocks.setdefault(language, []).append(body)
    return blocks


def test_readme_diagnostic_appended_keeps_every_shipped_metric(testbed, tmp_path, monkeypatch):
    from aspo_lit.__main__ import main

    blocks = readme_blocks("### A diagnostic")
    (python,), (config,), (command,) = blocks["python"], blocks["yaml"], blocks["bash"]
    (fresh_mypkg(tmp_path, monkeypatch) / "diagnostics.py").write_text(python)
    (tmp_path / "mine.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)  # `conf/...` in the command resolves to the shipped configs

    words = command.split()
    assert words[:4] == ["python", "-m", "aspo_lit", "fit"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(words[3:] + SMALL + [f"--model.model_name_or_path={testbed}",
                                         f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"])
    assert code == 0
    assert not [w for w in caught if "trainer.callbacks lack" in str(w.message)]
    header = next(csv.reader(next((tmp_path / "runs").rglob("metrics.csv")).open()))
    new = {"train/boxed_rate", "ratio/token_mean"}
    shipped = {"train/pg_loss", "train/kl", "train/grad_norm", "clip/pos_high", "train/reward_mean",
               "train/entropy", "entropy/cov", "train/repetition_rate", "ratio/off_policy_share"}
    assert new | shipped <= set(header), sorted(new | shipped - set(header))
    assert next((tmp_path / "runs").rglob("last.ckpt")).is_file()   # RunCheckpoint and GracefulInterrupt kept


def test_readme_loss_by_import_path_logs_its_statistic(tmp_path, monkeypatch):
    from aspo_lit.maths.losses import get_policy_loss

    (python,) = readme_blocks("### A loss")["python"]
    (fresh_mypkg(tmp_path, monkeypatch) / "losses.py").write_text(python)
    loss_fn = get_policy_loss("mypkg.losses:PositiveOnly", loss_agg="token-mean")
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = loss_fn(logprobs, logprobs.detach(), torch.tensor([1.0, -1.0]), mask)
    assert loss.item() == 3.0 / 3                        # -(A·lp) over the 3 tokens, A > 0 only: small dyadics, exact
    # 2 of 3 tokens: one fp32 division
    assert float(stats["kept"]) == pytest.approx(2 / 3, rel=rounding_tol(torch.float32, 1), abs=0) and float(stats["kept"].weight) == 3
