"""In-training validation equals the offline evaluation of the same checkpoint (`evaluate --like_fit`)."""
from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest

from aspo_lit.__main__ import main
from aspo_lit.rollout_stage.controller import RolloutController

REPO = Path(__file__).resolve().parents[2]


def _fit_val_metrics(version: Path) -> list[dict[str, float]]:
    """The fit's logged validations, in order: {avg@4, pass@4}."""
    with (version / "metrics.csv").open() as handle:
        return [{k.split("/")[1]: float(row[k]) for k in ("val/avg@4", "val/pass@4")}
                for row in csv.DictReader(handle) if row.get("val/avg@4")]


def _offline(out: Path) -> tuple[dict, dict[tuple[str, int], dict]]:
    folder = next(out.glob("*/fit_val.done.json")).parent
    done = json.loads((folder / "fit_val.done.json").read_text())
    records = [json.loads(line) for line in (folder / "fit_val.samples.jsonl").read_text().splitlines()]
    return done, {(r["problem_id"], r["sample_index"]): r for r in records}


@pytest.mark.e2e
def test_offline_evaluation_like_the_fit_is_its_validation(testbed, tmp_path, monkeypatch):
    """A short fit validates before training (ValBeforeTrain) and after its last batch; `evaluate
    --like_fit` of the untrained model and of the saved last.ckpt gives each validation's avg@4 and
    pass@4, sample for sample.

    The same engine (transformers, one process, the same torch threads), the same calls (4 of 8
    problems x 4 samples, the last one of 6: batch composition and the order of the random draws
    are the dataloader's), the same per-call seed (the run seed, 3: the default evaluation's
    `_call_seed` gives other streams), top_p 1.0 (evaluate's default is 0.95), the same prompts
    and grader, and weights that are the policy's bit for bit (the export is lossless), so nothing
    is left to differ: every sample's text is the fit's and the numbers are equal, not merely
    within a standard error. The fit's samples are read off its DataModule's engine calls."""
    fit_samples: dict[int, dict[tuple[str, int], str]] = {}
    generate = RolloutController._generate

    def recording(self, records, n, sampling):
        completions, timings = generate(self, records, n, sampling)
        if not sampling.logprobs:   # the validation loop's calls (RolloutSettings.val_sampling)
            step = fit_samples.setdefault(self.ranks.step(), {})
            for row, group in zip(records, completions):
                step.update({(row["id"], s): hashlib.sha1(c.text.encode()).hexdigest() for s, c in enumerate(group)})
        return completions, timings

    monkeypatch.setattr(RolloutController, "_generate", recording)
    assert main([
        "fit", "--config", str(REPO / "conf/tiny/aspo.yaml"), f"--model.model_name_or_path={testbed}",
        "--seed_everything=3", "--trainer.max_steps=4", "--trainer.val_check_interval=2",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.logger.init_args.name=fit",
        "--trainer.enable_progress_bar=false",
        "--data.init_args.batch_size=8", "--data.init_args.group_size=4", "--model.mini_batch_size=4",
        "--data.init_args.num_val=30", "--data.init_args.val_batch_size=8",
        "--data.init_args.max_response_length=48",
    ]) == 0
    monkeypatch.undo()
    version = tmp_path / "fit" / "version_0"
    logged = _fit_val_metrics(version)
    assert sorted(fit_samples) == [0, 4] and len(logged) == 2   # before training, after the 4th optimizer step
    assert fit_samples[0] != fit_samples[4]                      # the update changed some samples

    for step, model, fit_val in ((0, testbed, logged[0]), (4, tmp_path / "fit" / "checkpoints" / "last.ckpt", logged[1])):
        out = tmp_path / f"eval_{step}"
        assert main(["evaluate", "--model", str(model), "--like_fit", str(version / "config.yaml"),
                     "--out", str(out)]) == 0
        done, records = _offline(out)
        assert {key: r["text_sha1"] for key, r in records.items()} == fit_samples[step], step
        assert done["n_problems"] == 30 and done["k"] == 4
        assert done["settings"]["top_p"] == 1.0 and done["settings"]["seed"] == 3
        assert done["settings"]["fit_batches"] == 8 and done["settings"]["temperature"] == 0.8
        correct = sum(r["correct"] for r in records.values())
        solved = len({pid for (pid, _), r in records.items() if r["correct"]})
        # the logged fractions are the same counts: avg@4 = correct / (30 x 4), pass@4 = solved / 30
        assert fit_val["avg@4"] == correct / 120 and fit_val["pass@4"] == solved / 30, (step, fit_val)
        assert done["avg@k"] == pytest.approx(100 * fit_val["avg@4"], abs=1e-9)
        assert done["pass@k"] == pytest.approx(100 * fit_val["pass@4"], abs=1e-9)


def test_like_fit_takes_the_problems_and_sampling_from_the_fit(tmp_path):
    """With --like_fit the options that would change the problems or the samples are refused, by name."""
    with pytest.raises(ValueError, match="leave out --top_p, --seed"):
        main(["evaluate", "--model", "testbed", "--like_fit", str(tmp_path), "--top_p", "0.95", "--seed", "1"])
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        main(["evaluate", "--model", "testbed", "--like_fit", str(tmp_path)])


def test_like_fit_warns_for_a_fit_on_several_processes(tmp_path, caplog):
    """A fit on N processes sampled each rank's share with its own seed: --like_fit, one process,
    says that it draws other samples (by the fit's trainer.devices x trainer.num_nodes); a
    one-process fit gets no warning."""
    from aspo_lit.eval.like_fit import _warn_if_sharded, fit_processes

    assert fit_processes({"trainer": {"devices": 8, "num_nodes": 2}}) == 16
    assert fit_processes({"trainer": {"devices": [0, 1]}}) == 2
    assert fit_processes({"trainer": {"devices": "auto"}}) is None
    with caplog.at_level("WARNING", logger="aspo_lit.eval.like_fit"):
        _warn_if_sharded(tmp_path / "config.yaml", {"trainer": {"devices": 1}})
        assert not caplog.records
        _warn_if_sharded(tmp_path / "config.yaml", {"trainer": {"devices": 4}})
    assert "ran on 4 processes" in caplog.text and "other samples" in caplog.text
