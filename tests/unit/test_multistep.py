"""The paper-regime testbed's data (aspo_lit.testbed.multistep) and its profile plumbing."""

from __future__ import annotations

import re

import pytest

from aspo_lit.testbed.arithmetic import split_of
from aspo_lit.testbed.multistep import generate_chain_problems

_FACT = re.compile(r"(\d+)\s*(\+|-|\*|/|plus|minus|times|and|less)\s*(\d+)\s*(=|is|makes|give)\s*(\d+)")
_WORDED = re.compile(r"(?:(twice) (\d+)|(\d+) (doubled)) is (\d+)", re.I)


def _apply(op: str, a: int, b: int) -> int:
    return {"+": a + b, "plus": a + b, "and": a + b, "-": a - b, "minus": a - b, "less": a - b,
            "*": a * b, "times": a * b, "/": a // b}[op]


def test_deterministic_prefix_stable_and_unique():
    a = generate_chain_problems(50, seed=3)
    assert a == generate_chain_problems(50, seed=3)
    assert generate_chain_problems(80, seed=3)[:50] == a
    assert a != generate_chain_problems(50, seed=4)
    assert len({r["id"] for r in generate_chain_problems(400, seed=0)}) == 400


@pytest.mark.parametrize("max_value", [30, 99])
def test_every_worked_step_is_true_and_boxed_is_the_answer(max_value):
    rows = generate_chain_problems(300, seed=1, ops=(4, 5, 6), max_value=max_value)
    if max_value == 99:
        assert any("twice" in r["solution"] or "doubled" in r["solution"] for r in rows)
    for row in rows:
        lines = row["solution"].split("\n")
        assert lines[-1] == f"\\boxed{{{row['answer']}}}"
        facts = 0
        for line in lines[:-1]:
            for a, op, b, _, c in _FACT.findall(line):
                assert _apply(op, int(a), int(b)) == int(c), (line, row)
                assert 0 <= int(c) <= max_value and 0 <= int(a) <= max_value
                facts += 1
            for _, x1, x2, _, z in _WORDED.findall(line):
                assert 2 * int(x1 or x2) == int(z), line
                facts += 1
        assert facts >= row["level"], row  # one worked fact per operation (plus re-checks)
        assert row["level"] in (4, 5, 6)


def test_wording_varies_but_the_arithmetic_is_forced():
    rows = generate_chain_problems(200, seed=0)
    first_lines = {r["solution"].split("\n")[0] for r in rows}
    assert len(first_lines) > 50                      # free wording
    # the format itself does not repeat word 4-grams (the repetition metric measures loops)
    from aspo_lit.callbacks.repetition import ngram_hashes
    repeats = [len(set(h.tolist())) < len(h) for h in (ngram_hashes(r["solution"], 4) for r in rows)]
    assert sum(repeats) / len(rows) < 0.1
    assert sum("Check:" in r["solution"] for r in rows) > 20   # re-checks occur
    assert all(r["solution"].count("\\boxed{") == 1 for r in rows)


def test_train_and_heldout_never_share_a_chain():
    train = generate_chain_problems(500, seed=0, split="train")
    held = generate_chain_problems(200, seed=0, split="heldout")
    assert not {r["problem"] for r in train} & {r["problem"] for r in held}
    assert len(held) == 200


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="split"):
        generate_chain_problems(3, seed=0, split="test")
    with pytest.raises(ValueError, match="ops"):
        generate_chain_problems(3, seed=0, ops=())
    with pytest.raises(ValueError, match="max_value"):
        generate_chain_problems(3, seed=0, max_value=5)


def test_profiles_and_config_validation():
    from aspo_lit.testbed import PROFILES, TestbedConfig, config_hash

    assert PROFILES["testbed"] == TestbedConfig()
    long = PROFILES["testbed-long"]
    assert long.task == "chain" and long.stop_on == "sampled"
    assert config_hash(long) != config_hash(PROFILES["testbed"])
    assert long.problems(5, "heldout") == generate_chain_problems(
        5, long.seed, long.ops, split="heldout", comment_prob=long.comment_prob,
        check_prob=long.check_prob, max_value=long.max_value)
    with pytest.raises(ValueError, match="task"):
        TestbedConfig(task="poetry")
    with pytest.raises(ValueError, match="stop_on"):
        TestbedConfig(stop_on="vibes")


def test_model_name_resolves_to_the_shipped_testbeds(monkeypatch):
    import aspo_lit.testbed.build as T
    from aspo_lit.testbed.shipped import ROOT
    from aspo_lit.training.models import resolve_model_path

    monkeypatch.setattr(T, "build_testbed", lambda *a, **k: pytest.fail("a testbed was built"))
    for name in ("testbed", "testbed-long", "testbed-code"):
        assert resolve_model_path(name) == str(ROOT / name)
    assert resolve_model_path("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"


def test_chain_datamodule_rows_follow_its_arguments():
    from data_modules.testbed import ChainRLDataModule

    dm = ChainRLDataModule(num_train=20, num_val=8, ops=[4, 5], max_value=30, data_seed=2)
    train, val = dm.task.rows("train"), dm.task.rows("val")
    assert train == generate_chain_problems(20, seed=2, ops=(4, 5), split="train", max_value=30)
    assert len(val) == 8 and all(split_of is not None and r["level"] in (4, 5) for r in val)
    assert ChainRLDataModule(num_val=0).task.rows("val") is None


def test_tiny_chain_build_stops_on_sampled_accuracy(tmp_path, monkeypatch):
    """`stop_on: sampled` checks real samples (not the gold solution's probability) and the summary
    records the profile's task, length and entropy."""
    import json

    import aspo_lit.testbed.build as T
    import aspo_lit.testbed.sft as S

    calls = []
    real = T.sample_accuracy

    def spy(model, tokenizer, problems, **kw):
        calls.append(len(problems))
        return real(model, tokenizer, problems, **kw)

    monkeypatch.setattr(T, "sample_accuracy", spy)
    monkeypatch.setattr(S, "_gold_probability", lambda *a, **k: pytest.fail("gold probability used"))
    config = T.TestbedConfig(
        task="chain", ops=(4,), max_value=30, num_train_problems=200, tokenizer_train_problems=100,
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, sft_max_steps=4, sft_batch_size=4,
        sft_warmup_steps=1, stop_on="sampled", eval_every=2, eval_min_step=2, dev_problems=4,
        heldout_problems=4, max_response_tokens=24, stop_accuracy=0.0)
    path = T.build_testbed(config, cache_dir=tmp_path, verbose=False)
    meta = json.loads((path / "testbed.json").read_text())
    assert meta["sft_steps"] == 2                    # stop_accuracy 0 is met at the first check
    assert calls[0] == 4 and calls[-1] == 4           # dev check, then the final held-out report
    assert meta["name"] == "aspo-lit chain testbed" and meta["config"]["ops"] == [4]
    assert meta["heldout"]["mean_token_entropy"] > 0 and meta["heldout"]["mean_response_tokens"] > 0


def test_evaluation_treats_every_profile_as_a_local_testbed(monkeypatch, tmp_path):
    """`testbed-long` is built locally like `testbed`: no hub lookup, results tagged by fingerprint."""
    from aspo_lit.eval import records, table_commands

    folder = tmp_path / "testbed-abc"
    monkeypatch.setattr(records, "resolve_model_path", lambda name: str(folder))
    monkeypatch.setattr(records, "model_fingerprint", lambda path: "f1e2d3c4b5a6")
    for name in ("testbed", "testbed-long"):
        assert table_commands.check_model(name) is None
        assert records.model_tag(name) == "testbed-abc-f1e2d3c4"
