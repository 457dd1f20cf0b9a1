"""The CLI: help lists the subcommands, every shipped config parses, bad configs fail early and clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from aspo_lit.__main__ import main
from tests.helpers.cli import effective, print_config

REPO = Path(__file__).resolve().parents[2]
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
def test_shipped_configs_parse(configs):
    assert "model_name_or_path" in print_config(*configs)


def test_composition_overrides_base():
    text = print_config("conf/aspo.yaml", "conf/ablations/cispo.yaml")
    assert "loss: cispo" in text and "name: cispo" in text


#: Runs documented before the shared prompt and the 2,048-token budget were on in the testbed
#: configs, and the settings they ran with (their configs pin them; docs/performance.md).
DOCUMENTED = {
    "study v1 (docs/studies/study.md)": (("conf/tiny/aspo_long.yaml", "conf/study/testbed_long.yaml"), 16384),
    "study short (docs/studies/study-short.md)": (("conf/tiny/aspo.yaml", "conf/study/testbed_short.yaml"), 16384),
    "study v2 (docs/studies/study-v2.md)": (("conf/tiny/aspo_long.yaml", "conf/study/testbed_long_v2.yaml"), 2048),
    "mechanism (docs/studies/mechanism.md)": (("conf/tiny/aspo_long.yaml", "conf/study/testbed_long_v2.yaml",
                                               "conf/study/testbed_long_mechanism.yaml"), 2048),
}


@pytest.mark.parametrize("configs", [("conf/tiny/aspo.yaml",), ("conf/tiny/grpo.yaml",), ("conf/tiny/aspo_long.yaml",),
                                     ("conf/tiny/aspo.yaml", "conf/tiny/code_aspo.yaml")],
                         ids=lambda c: "+".join(Path(p).stem for p in c))
def test_testbed_configs_take_the_fast_exact_path(configs):
    """The testbed configs share each prompt's forward among its G responses and split rows by a
    2,048-token budget: the same maths, other floating-point sums, less time."""
    cfg = _flatten(effective(*configs))
    assert cfg["model.share_prompt"] is True and cfg["model.max_tokens_per_micro_batch"] == 2048


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_documented_runs_pin_the_settings_they_ran_with(name):
    """A study documented before the fast path was on keeps its own settings: the shared prompt off,
    its own token budget; every other effective value is its base config's."""
    configs, budget = DOCUMENTED[name]
    cfg = _flatten(effective(*configs))
    assert cfg["model.share_prompt"] is False and cfg["model.max_tokens_per_micro_batch"] == budget


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


DERIVED = ["conf/grpo.yaml", "conf/archer.yaml", "conf/qwen3_4b.yaml", "conf/qwen3_8b.yaml",
           "conf/qwen3_30b_a3b.yaml", "conf/tiny/grpo.yaml"]


@pytest.mark.parametrize("derived", DERIVED, ids=lambda p: p.replace("conf/", ""))
def test_derived_config_keeps_every_base_value(derived):
    """Every key a derived config does not write has the base's effective value (`config: base.yaml`)."""
    import yaml

    own = yaml.safe_load((REPO / derived).read_text())
    base = str(Path(derived).parent / own.pop("config"))
    written = set(_flatten(own))
    got, want = _flatten(effective(derived)), _flatten(effective(base))
    inherited = [k for k in want if not any(k == w or k.startswith(w + ".") or w.startswith(k + ".") for w in written)]
    assert len(inherited) > 50
    wrong = {k: (got.get(k), want[k]) for k in inherited if got.get(k) != want[k]}
    assert not wrong, f"{derived} lost its base's values: {wrong}"
    for key in written:  # and what it writes wins (print_config adds a data source's defaults)
        assert _written_in(_flatten(own)[key], got[key]), key


def _written_in(written, effective) -> bool:
    """`written` (as in the YAML) equals `effective`, where a written mapping may leave keys out."""
    if isinstance(written, dict):
        return isinstance(effective, dict) and all(k in effective and _written_in(v, effective[k])
                                                   for k, v in written.items())
    if isinstance(written, list):
        return isinstance(effective, list) and len(written) == len(effective) and \
            all(_written_in(w, e) for w, e in zip(written, effective))
    return written == effective


def test_base_config_errors_name_the_file(tmp_path, capsys):
    derived = tmp_path / "derived.yaml"
    derived.write_text("config: missing_base.yaml\nmodel:\n  lr: 0.1\n")
    code, text = _run(["fit", "--config", str(derived), "--print_config"], capsys)
    assert code == 2 and "missing_base.yaml" in text and str(derived) in text
    derived.write_text(f"config: {derived.name}\n")
    code, text = _run(["fit", "--config", str(derived), "--print_config"], capsys)
    assert code == 2 and "include each other" in text


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
        # pure half-precision weights at the paper's lr: updates round away
        ("--trainer.precision=bf16-true --model.lr=1e-6", "trainer.precision"),
        ("--model.torch_dtype=bfloat16 --model.lr=1e-6", "model.torch_dtype"),
        # responses of a mini-batch must split evenly over the processes
        ("--trainer.devices=3 --data.init_args.batch_size=6 --model.mini_batch_size=1", "model.mini_batch_size"),
        # a nucleus cut where the sampler's renormalised log-probs reach the loss: the ratio carries the kept mass
        ("--data.init_args.top_p=0.8 --model.old_logprobs=sampler", "data.top_p=0.8 with model.old_logprobs=sampler"),
        ("--data.init_args.top_p=0.8 --model.rollout_is_cap=2.0", "data.top_p=0.8 with model.rollout_is_cap=2.0"),
    ],
)
def test_invalid_config_names_the_key(override, key, capsys, monkeypatch):
    # Must fail before any model loads: make loading impossible, so a late failure would differ.
    import aspo_lit.training.models as models
    import aspo_lit.training.module as module

    for where in (models, module):
        monkeypatch.setattr(where, "resolve_model_path", lambda name: pytest.fail("a model was loaded"))
    code, text = _run(["fit", "--config", TINY, *override.split()], capsys)
    assert code == 2, text
    # ours (a value no type can rule out), or jsonargparse's for a value outside a setting's Literal type
    message = [line for line in text.splitlines()
               if line.startswith("aspo-lit: config error:") or line.strip().startswith("error: Parser key")]
    assert len(message) == 1 and key in message[0], text


@pytest.mark.parametrize("override, key", [("--model.nonsense=1", "nonsense"), ("--model.lr=abc", "model.lr")])
def test_parse_errors_name_the_key(override, key, capsys):
    code, text = _run(["fit", "--config", TINY, override], capsys)
    assert code not in (0, None)
    assert key in text


def test_minibatch_arithmetic_of_the_32_gpu_run():
    """Qwen3-30B-A3B ran on 32 GPUs with 16-prompt mini-batches: 8 responses per rank per step."""
    from aspo_lit.cli import check_config
    from aspo_lit.maths.update_plan import rows_per_minibatch

    assert rows_per_minibatch(16, 16, 32) == 8
    cfg = {"trainer": {"devices": 8, "num_nodes": 4}, "model": {"mini_batch_size": 16},
           "data": {"init_args": {"batch_size": 64, "group_size": 16}}}
    check_config(cfg)
    with pytest.raises(ValueError, match="mini_batch_size=1"):
        rows_per_minibatch(1, 16, 32)


def test_base_named_earlier_is_not_reapplied(tmp_path):
    """`--config aspo.yaml --config mine.yaml --config grpo.yaml`: grpo's base (aspo) was given
    already, so it is not applied again after mine.yaml (that would undo mine.yaml)."""
    from aspo_lit.cli import expand_base_configs

    mine = tmp_path / "mine.yaml"
    mine.write_text("model:\n  lr: 0.5\n")
    aspo, grpo = str(REPO / "conf/aspo.yaml"), str(REPO / "conf/grpo.yaml")
    assert expand_base_configs(["fit", "--config", aspo, "--config", str(mine), "--config", grpo]) == \
        ["fit", "--config", aspo, "--config", str(mine), "--config", grpo]
    assert expand_base_configs(["fit", "--config", grpo]) == ["fit", "--config", str(REPO / "conf/aspo.yaml"),
                                                               "--config", grpo]


# --- one front end for every command ----------------------------------------------------------

@pytest.mark.parametrize("name", ["build-testbed", "evaluate", "table1", "table2", "table3", "figure2", "study"])
def test_every_tool_has_help_and_print_config(name, capsys):
    """Each command is a jsonargparse parser: --help and --print_config behave as in `fit`."""
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    assert "--config CONFIG" in capsys.readouterr().out


@pytest.mark.parametrize("table", ["table1", "table2", "table3"])
def test_table_tools_read_their_config(table, capsys):
    """`tableN` reads conf/tableN.yaml by default; another --config replaces it (not merged)."""
    with pytest.raises(SystemExit):
        main([table, "--print_config"])
    paper = yaml.safe_load(capsys.readouterr().out)
    assert paper["table"] == table and paper["compare_paper"] is True
    assert paper["rows"] == yaml.safe_load((REPO / "conf" / f"{table}.yaml").read_text())["rows"]
    with pytest.raises(SystemExit):
        main([table, "--config", str(REPO / "conf" / "tiny" / f"{table}.yaml"), "--print_config"])
    tiny = yaml.safe_load(capsys.readouterr().out)
    assert tiny["table"] == table and tiny["compare_paper"] is False
    assert tiny["out_dir"] == f"runs/tiny/{table}" and tiny["rows"] != paper["rows"]


@pytest.mark.parametrize("argv", [["table1", "--config", str(REPO / "conf" / "table2.yaml")],
                                  ["table2", "--table", "table3"]])
def test_a_table_has_one_command(argv, capsys):
    """The command names the table: another table's config or `--table` is an error, not a second name."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"`{argv[0]}` is table '{argv[0]}'" in err


@pytest.mark.parametrize("name", ["table", "reproduce-table1", "run_table1"])
def test_no_alias_table_commands(name, capsys):
    """Only table1, table2 and table3 run a table: another name is an argparse error."""
    with pytest.raises(SystemExit) as exit_:
        main([name, "--config", str(REPO / "conf" / "table1.yaml")])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_tool_errors_name_the_field(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["table1", "--template", "fancy", "--print_config"])
    assert exit_.value.code == 2 and "template" in capsys.readouterr().err
    with pytest.raises(ValueError, match="profile: unknown testbed 'nope'"):
        main(["build-testbed", "--profile", "nope"])


def test_conf_paths_fall_back_to_the_packaged_copy(tmp_path, monkeypatch):
    """Outside a checkout, `--config conf/...` names the configs shipped in the package."""
    from aspo_lit.configs import resolve_config, resolve_config_args

    monkeypatch.chdir(tmp_path)
    packaged = Path(resolve_config("conf/tiny/aspo.yaml"))
    assert packaged.is_file() and packaged.read_text() == (REPO / "conf" / "tiny" / "aspo.yaml").read_text()
    assert resolve_config("conf/nope.yaml") == "conf/nope.yaml"
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "aspo.yaml").write_text("seed_everything: 1\n")
    assert resolve_config_args(["fit", "--config", "conf/aspo.yaml", "--config=conf/grpo.yaml"]) == \
        ["fit", "--config", "conf/aspo.yaml", f"--config={resolve_config('conf/grpo.yaml')}"]


# --- callbacks are appended, not replaced; what a run lacks is said at start-up -----------------

def _instantiate(tmp_path, model_dir, *configs: str, extra: tuple[str, ...] = ()):
    """The fit CLI built up to its classes (no training): trainer, module and DataModule."""
    from aspo_lit.cli import ASPOCLI

    args = ["--config", TINY, *[w for c in configs for w in ("--config", c)],
            f"--model.model_name_or_path={model_dir}", f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", *extra]
    return ASPOCLI(args=args, run=False)


def _callback_names(cli) -> list[str]:
    return [type(cb).__name__ for cb in cli.trainer.callbacks]


def test_appended_callback_keeps_the_shipped_ones(tmp_path, tiny_model_dir, recwarn):
    """`callbacks+:` in a later config adds to the shipped list; no warning about missing callbacks."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("trainer:\n  callbacks+:\n    - aspo_lit.callbacks.examples.BoxedAnswerRate\n")
    names = _callback_names(_instantiate(tmp_path, tiny_model_dir, str(mine)))
    shipped = [str(cb).rsplit(".", 1)[-1] if isinstance(cb, str) else cb["class_path"].rsplit(".", 1)[-1]
               for cb in yaml.safe_load(Path(TINY).read_text())["trainer"]["callbacks"]]
    assert sorted(n for n in names if n in shipped + ["BoxedAnswerRate"]) == sorted(shipped + ["BoxedAnswerRate"])
    assert not [w for w in recwarn if "trainer.callbacks lack" in str(w.message)]


def test_replaced_callbacks_warn_naming_what_is_lost(tmp_path, tiny_model_dir):
    """A `callbacks:` list in a later config replaces the shipped one: the run still starts, with a
    warning naming the checkpoint, the interrupt handler and TrainingStats, and the append form."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("trainer:\n  callbacks:\n    - aspo_lit.callbacks.examples.BoxedAnswerRate\n")
    with pytest.warns(UserWarning, match="trainer.callbacks lack") as caught:
        cli = _instantiate(tmp_path, tiny_model_dir, str(mine))
    message = next(str(w.message) for w in caught if "trainer.callbacks lack" in str(w.message))
    for lost in ("RunCheckpoint", "GracefulInterrupt", "TrainingStats", "callbacks+:"):
        assert lost in message, lost
    assert "BoxedAnswerRate" in _callback_names(cli) and "TrainingStats" not in _callback_names(cli)


# --- a loss given as a class takes no loss_kwargs; a loss named by import path ------------------

def test_class_path_loss_with_loss_kwargs_is_an_error(tmp_path, capsys, monkeypatch):
    """conf/tiny/aspo.yaml sets model.loss_kwargs; a class_path loss would silently drop them."""
    import aspo_lit.training.models as models
    import aspo_lit.training.module as module

    for where in (models, module):
        monkeypatch.setattr(where, "resolve_model_path", lambda name: pytest.fail("a model was loaded"))
    mine = tmp_path / "mine.yaml"
    mine.write_text("model:\n  loss:\n    class_path: aspo_lit.maths.losses.GRPOLoss\n    init_args: {eps_high: 0.28}\n")
    code, text = _run(["fit", "--config", TINY, "--config", str(mine)], capsys)
    message = [line for line in text.splitlines() if line.startswith("aspo-lit: config error:")]
    assert code == 2 and len(message) == 1, text
    assert "model.loss_kwargs" in message[0] and "model.loss.init_args" in message[0]


def test_class_path_loss_without_loss_kwargs_and_import_path_names(tmp_path, tiny_model_dir):
    mine = tmp_path / "mine.yaml"
    mine.write_text("model:\n  loss_kwargs: null\n  loss:\n    class_path: aspo_lit.maths.losses.GRPOLoss\n"
                    "    init_args: {eps_high: 0.28}\n")
    loss_fn = _instantiate(tmp_path, tiny_model_dir, str(mine)).model.loss_fn
    assert type(loss_fn).__name__ == "GRPOLoss" and loss_fn.eps_high == 0.28
    cli = _instantiate(tmp_path, tiny_model_dir, extra=("--model.loss=tests.helpers.user_loss:ASPOWithPositionStat",))
    assert type(cli.model.loss_fn).__name__ == "ASPOWithPositionStat"
    assert cli.model.loss_fn.dual_clip == 3.0  # conf/tiny/aspo.yaml's loss_kwargs reached it
    assert "train/position_mean" in cli.model.stat_reductions


# --- every update on-policy: said at start-up -----------------------------------------------------

def test_on_policy_config_warns_at_start_up(tmp_path, tiny_model_dir, recwarn):
    with pytest.warns(UserWarning, match="every update is on-policy"):
        _instantiate(tmp_path, tiny_model_dir, extra=("--model.mini_batch_size=32",))  # = data.batch_size
    recwarn.clear()
    _instantiate(tmp_path, tiny_model_dir)  # conf/tiny/aspo.yaml: 4 steps per rollout batch
    _instantiate(tmp_path, tiny_model_dir, extra=("--model.mini_batch_size=32", "--model.ppo_epochs=2"))
    assert not [w for w in recwarn if "on-policy" in str(w.message)]


@pytest.mark.parametrize("config", ["conf/aspo.yaml", "conf/tiny/aspo.yaml"])
def test_validation_runs_under_no_grad_in_every_fit(config, capsys):
    """The CLI's trainer default: validation under ``no_grad`` (what gloo gives every CPU test), not
    ``inference_mode`` (Lightning's default for FSDP2 on NCCL), so nothing a validation loop builds
    first (an engine, FSDP2's gather buffers) is an inference tensor the next training step updates."""
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / config), "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["inference_mode"] is False


def test_a_moved_class_path_is_refused_naming_the_new_one(tmp_path):
    """A config or argument that names a class path from before the rollout stage's split stops
    with the new name; every new name imports."""
    import importlib

    from aspo_lit.cli import ConfigError, expand_base_configs
    from aspo_lit.configs import MOVED_CLASS_PATHS

    old = tmp_path / "old.yaml"
    old.write_text("data:\n  class_path: data_modules.math.MathRLDataModule\n")
    with pytest.raises(ConfigError, match=r"old.yaml: 'data_modules.math.MathRLDataModule' has moved: name "
                                          r"'data_modules.math.RLDataModule'"):
        expand_base_configs(["--config", str(old)])
    with pytest.raises(ConfigError, match=r"'aspo_lit.data.filters.FieldIn' instead"):
        expand_base_configs(["--data.init_args.val_files", '[{"filters": [{"class_path": "data_modules.filters.FieldIn"}]}]'])
    assert expand_base_configs(["--config", str(REPO / "conf/aspo.yaml")]) == ["--config", str(REPO / "conf/aspo.yaml")]
    for new in MOVED_CLASS_PATHS.values():
        module, _, name = new.rstrip(".").rpartition(".")
        if new.endswith("."):
            importlib.import_module(new.rstrip("."))
        else:
            assert getattr(importlib.import_module(module), name)
