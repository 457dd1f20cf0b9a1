"""The rollout DataModule: data loading and validation, resumable batches, and on-policy rollouts."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from aspo_lit.data.sources import BadRowError, PromptBatches, load_rows
from aspo_lit.rollout.hf import HFEngine
from aspo_lit.training.module import ASPOModule
from data_modules.math import RLDataModule
from data_modules.testbed import ArithmeticRLDataModule


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- loading --------------------------------------------------------------------------------------

def test_loads_shared_training_sets(shared_data_dir):
    path = shared_data_dir / "train" / "deepscaler_dsr_sub.jsonl"
    # the staged DeepScaleR subset has one row with an empty answer (line 266): reported, not used
    with pytest.raises(BadRowError, match=r"deepscaler_dsr_sub\.jsonl:266: field 'answer' is empty"):
        load_rows(str(path))
    rows, report = load_rows(str(path), on_bad_row="skip")
    assert report.kept == len(rows) == 1208 and len(report.skipped) == 1
    assert all(isinstance(r["problem"], str) and r["answer"].strip() for r in rows)


@pytest.mark.parametrize(
    "bad_row, complaint",
    [({"problem": "1+1?"}, "'answer' is missing"),
     ({"problem": "1+1?", "answer": 2}, "'answer' is a int, not a string"),
     ({"problem": "1+1?", "answer": " "}, "'answer' is empty"),
     ({"answer": "2"}, "'problem' is missing"),
     ({"problem": "", "answer": "2"}, "'problem' is missing")],
)
def test_bad_row_error_names_file_and_line(tmp_path, bad_row, complaint):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "2+2?", "answer": "4"}, bad_row])
    with pytest.raises(BadRowError, match=rf"d\.jsonl:2: .*{complaint}"):
        load_rows(str(path))


def test_bad_rows_skipped_and_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"problem": "2+2?", "answer": "4"}\nnot json\n{"problem": "3?", "answer": 3}\n')
    rows, report = load_rows(str(path), on_bad_row="skip")
    assert [r["answer"] for r in rows] == ["4"]
    assert len(report.skipped) == 2 and "d.jsonl:2" in report.skipped[0] and "d.jsonl:3" in report.skipped[1]


def test_field_mapping_parquet_and_missing_file(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"question": "5-1?", "solution": "4"}]).to_parquet(str(tmp_path / "d.parquet"))
    rows, _ = load_rows(str(tmp_path / "d.parquet"), problem_key="question", answer_key="solution")
    assert rows[0]["problem"] == "5-1?" and rows[0]["answer"] == "4"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(str(tmp_path / "nope.jsonl"))


def test_hub_id_goes_through_datasets(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, split))
        return [{"problem": "1+2?", "answer": "3"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows, _ = load_rows("agentica-org/DeepScaleR-Preview-Dataset", split="train")
    assert calls == [("agentica-org/DeepScaleR-Preview-Dataset", "train")] and rows[0]["answer"] == "3"


def test_prompt_batches_resume_midway():
    rows = [{"i": i} for i in range(10)]
    first = PromptBatches(rows, batch_size=3, seed=1)
    full = [b for b in first]
    assert len(full) == 3 and sorted(r["i"] for b in full for r in b) != list(range(9))[:0]
    resumed = PromptBatches(rows, batch_size=3, seed=1)
    resumed.load_state_dict({"epoch": 0, "consumed": 2})
    assert list(resumed) == full[2:]
    # the next epoch reshuffles
    first.consumed = len(first)
    assert [b for b in first] != full


# --- rollouts with the module -------------------------------------------------------------------------

class ParityReward:
    """A reward with signal for a random model: 1 when the response length is even."""

    def batch(self, texts, golds):
        return [float(len(t) % 2 == 0) for t in texts]


def _checksum(module: torch.nn.Module) -> float:
    return sum(float(p.detach().double().sum()) for p in module.parameters())


class CheckingEngine(HFEngine):
    """An engine with its own weight copy; records the weights it sampled with, in batch order."""

    def __init__(self) -> None:
        super().__init__(copy=True)
        self.sampled_with: list[float] = []

    def generate(self, prompts, n=1, sampling=None):
        self.sampled_with.append(_checksum(self.model))
        return super().generate(prompts, n, sampling)


class OnPolicyCheck(Callback):
    """When a batch is trained on, were its rollouts sampled with the policy's weights of that moment?"""

    def __init__(self, engine: CheckingEngine) -> None:
        self.engine = engine
        self.checks: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.checks.append((self.engine.sampled_with[batch_idx], _checksum(pl_module.policy)))


class PrefetchedRollouts(ArithmeticRLDataModule):
    """The design ARCHITECTURE.md rules out: generating inside the dataloader (Lightning prefetches)."""

    def train_dataloader(self):
        batches = super().train_dataloader()
        counter = iter(range(10**6))

        def generate_early():
            for records in batches:
                yield self.controller.rollout(records, seed=next(counter))

        return generate_early()

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch


def _fit(model_dir, datamodule_class, tmp_path):
    engine = CheckingEngine()
    data = datamodule_class(num_train=64, num_val=0, batch_size=4, group_size=2, max_response_length=6,
                            prompt_template="plain", engine=engine, reward=ParityReward())
    module = ASPOModule(model_name_or_path=str(model_dir), loss="grpo", lr=5e-3, warmup_steps=0,
                        mini_batch_size=4, micro_batch_size=8)
    check = OnPolicyCheck(engine)
    trainer = Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[check])
    trainer.fit(module, datamodule=data)
    return check.checks


def test_rollouts_always_use_current_weights(tiny_model_dir, tmp_path):
    checks = _fit(tiny_model_dir, ArithmeticRLDataModule, tmp_path)
    assert len(checks) == 4
    assert len({policy for _, policy in checks}) == 4, "the policy must change between steps for this test"
    # float64 sums of the same fp32 values in the same order: equal weights give exactly equal sums
    assert all(sampled == policy for sampled, policy in checks)


def test_stale_weight_scenario_is_detected(tiny_model_dir, tmp_path):
    checks = _fit(tiny_model_dir, PrefetchedRollouts, tmp_path)
    # equal weights: exactly equal sums (above); one update (lr 5e-3) moves the sum by far more than 1e-6
    stale = [abs(sampled - policy) > 1e-6 for sampled, policy in checks]
    assert stale[0] is False and all(stale[1:]), "prefetched rollouts should be one step stale"


def test_invalid_datamodule_settings_name_the_key():
    with pytest.raises(ValueError, match="data.group_size"):
        RLDataModule(group_size=1)
    with pytest.raises(ValueError, match="data.top_p"):
        RLDataModule(top_p=0.0)
    with pytest.raises(ValueError, match="data.adv_norm"):
        RLDataModule(adv_norm="mad")


def test_the_run_seed_is_seed_everythings_and_a_resumed_run_keeps_its_own(tiny_model_dir, monkeypatch):
    """`seed: null` (the default) takes the seed `seed_everything` recorded (PL_GLOBAL_SEED), an explicit
    seed wins, and a checkpoint's seed wins on resume (`seed_everything: true` draws another each launch)."""
    from lightning.pytorch import seed_everything

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # restored after the test: seed_everything sets it
    seed_everything(5)
    dm = ArithmeticRLDataModule(num_train=16, num_val=0)
    module = ASPOModule(model_name_or_path=str(tiny_model_dir))
    assert dm.seed == 5 and module.seed == 5 and dm.hparams.seed is None
    assert ArithmeticRLDataModule(num_train=16, num_val=0, seed=7).seed == 7
    assert ASPOModule(model_name_or_path=str(tiny_model_dir), seed=7).seed == 7
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert ArithmeticRLDataModule(num_train=16, num_val=0).seed == 0  # nothing seeded: Lightning's default
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    state = dm.state_dict()
    seed_everything(9)
    resumed_dm, resumed = ArithmeticRLDataModule(num_train=16, num_val=0), ASPOModule(model_name_or_path=str(tiny_model_dir))
    assert resumed_dm.seed == resumed.seed == 9
    resumed_dm.load_state_dict(state)
    resumed.on_load_checkpoint(checkpoint)
    assert resumed_dm.seed == resumed.seed == 5


def test_bounded_staleness_is_refused_on_gpu_nodes():
    """data.max_staleness >= 1 starts one engine process per rank, which on a GPU node would all take
    GPU 0 and get the weights as fp32 host copies: refused there with the key and the reason, run on
    CPU, and k = 0 (the colocated synchronous loop) runs anywhere."""
    from types import SimpleNamespace

    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    from data_modules.math import RLDataModule

    for k, accelerator, refused in ((1, CUDAAccelerator(), True), (0, CUDAAccelerator(), False),
                                    (2, CPUAccelerator(), False)):
        data = RLDataModule(group_size=2, batch_size=4, max_staleness=k)
        data.trainer = SimpleNamespace(world_size=1, accelerator=accelerator)
        if refused:
            with pytest.raises(ValueError, match=r"data.max_staleness=1 runs its engine processes on CPU only.*GPU 0"):
                data.setup("fit")
        else:
            data.setup("fit")
