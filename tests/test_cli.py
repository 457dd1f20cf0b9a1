"""The CLI: help lists the subcommands, every shipped config parses, bad configs fail early and clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from aspo_lit.__main__ import main

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "conf/tiny/aspo.yaml")


def _run(args, capsys):
    try:
        code = main(args)
    except SystemExit as exc:  # jsonargparse exits on parse errors / --help / --print_config
        code = exc.code
    out = capsys.readouterr()
    return code, out.out + out.err


def test_help_lists_fit_and_tools(capsys):
    code, text = _run(["--help"], capsys)
    assert code == 0
    for word in ("fit", "validate", "build-testbed", "evaluate", "table1", "figure2"):
        assert word in text


CONFIGS = [
    ["conf/aspo.yaml"], ["conf/grpo.yaml"], ["conf/archer.yaml"], ["conf/qwen3_4b.yaml"],
    ["conf/qwen3_8b.yaml"], ["conf/qwen3_30b_a3b.yaml"], ["conf/tiny/aspo.yaml"], ["conf/tiny/grpo.yaml"],
] + [["conf/aspo.yaml", f"conf/ablations/{name}.yaml"]
     for name in ("grpo_no_is", "grpo_pos_mean", "aspo_no_dual_clip", "cispo")]


@pytest.mark.parametrize("configs", CONFIGS, ids=lambda c: "+".join(Path(p).stem for p in c))
def test_shipped_configs_parse(configs, capsys):
    args = ["fit"]
    for path in configs:
        args += ["--config", str(REPO / path)]
    code, text = _run(args + ["--print_config"], capsys)
    assert code in (0, None), text
    assert "model_name_or_path" in text


def test_composition_overrides_base(capsys):
    code, text = _run(["fit", "--config", str(REPO / "conf/aspo.yaml"), "--config",
                       str(REPO / "conf/ablations/cispo.yaml"), "--print_config"], capsys)
    assert code in (0, None)
    assert "loss: cispo" in text and "name: cispo" in text
    code, text = _run(["fit", "--config", str(REPO / "conf/qwen3_8b.yaml"), "--print_config"], capsys)
    assert "max_response_length: 6144" in text and "Qwen/Qwen3-8B" in text and "loss: aspo" in text


def test_omegaconf_interpolation(tmp_path, capsys):
    cfg = tmp_path / "interp.yaml"
    cfg.write_text(f"config: {TINY}\nmodel:\n  warmup_steps: 7\n  micro_batch_size: ${{model.warmup_steps}}\n")
    code, text = _run(["fit", "--config", str(cfg), "--print_config"], capsys)
    assert code in (0, None), text
    assert "micro_batch_size: 7" in text


@pytest.mark.parametrize(
    "override, key",
    [
        ("--model.mini_batch_size=3", "model.mini_batch_size"),
        ("--data.init_args.group_size=1", "data.group_size"),
        ("--data.init_args.batch_size=-4", "data.batch_size"),
        ("--model.ppo_epochs=0", "model.ppo_epochs"),
        ("--model.kl_kind=k7", "model.kl_kind"),
        ("--model.loss=nonexistent_loss", "nonexistent_loss"),
    ],
)
def test_invalid_config_names_the_key(override, key, capsys, monkeypatch):
    # Must fail before any model loads: make loading impossible, so a late failure would differ.
    import aspo_lit.models as models
    import aspo_lit.module as module

    for where in (models, module):
        monkeypatch.setattr(where, "resolve_model_path", lambda name: pytest.fail("a model was loaded"))
    code, text = _run(["fit", "--config", TINY, override], capsys)
    assert code == 2, text
    message = [line for line in text.splitlines() if line.startswith("aspo-lit: config error:")]
    assert len(message) == 1 and key in message[0], text


@pytest.mark.parametrize("override, key", [("--model.nonsense=1", "nonsense"), ("--model.lr=abc", "model.lr")])
def test_parse_errors_name_the_key(override, key, capsys):
    code, text = _run(["fit", "--config", TINY, override], capsys)
    assert code not in (0, None)
    assert key in text
