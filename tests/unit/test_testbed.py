"""The CPU testbed: arithmetic generator and the tiny-policy builder (aspo_lit.testbed)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aspo_lit.testbed.arithmetic import generate_problems, read_jsonl, split_of, write_jsonl

REPO = Path(__file__).resolve().parents[2]

# A testbed small enough to build in a few seconds (the quality of the policy is irrelevant here).
TINY = dict(
    num_train_problems=400, tokenizer_train_problems=200, vocab_size=400,
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, max_position_embeddings=256,
    sft_max_steps=6, sft_batch_size=8, sft_warmup_steps=2, eval_every=3, eval_min_step=3,
    dev_problems=8, heldout_problems=8, max_response_tokens=16, stop_accuracy=1.01,
)


# ----------------------------------------------------------------------------- generator

def _check_solution(row: dict) -> None:
    """Every step line `x op y = z` is true arithmetic and the last box holds the answer."""
    *steps, boxed = row["solution"].split("\n")
    assert boxed == f"\\boxed{{{row['answer']}}}"
    assert len(steps) == row["level"]
    for line in steps:
        m = re.fullmatch(r"(\d+)([+\-*])(\d+)=(-?\d+)", line)
        assert m, line
        x, op, y, z = int(m[1]), m[2], int(m[3]), int(m[4])
        assert {"+": x + y, "-": x - y, "*": x * y}[op] == z, line
    assert int(steps[-1].split("=")[1]) == int(row["answer"])


def test_generator_is_deterministic_and_prefix_stable():
    a = generate_problems(300, seed=7)
    assert a == generate_problems(300, seed=7)
    assert generate_problems(100, seed=7) == a[:100]
    assert a != generate_problems(300, seed=8)


def test_records_shape_levels_and_uniqueness():
    rows = generate_problems(600, seed=0, levels=(1, 2, 3))
    assert all(set(r) == {"id", "problem", "answer", "level", "solution"} for r in rows)
    assert {r["level"] for r in rows} == {1, 2, 3}
    assert len({r["problem"] for r in rows}) == len(rows)
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(isinstance(r["answer"], str) and re.fullmatch(r"\d+", r["answer"]) for r in rows)
    assert {r["level"] for r in generate_problems(50, seed=0, levels=(2,))} == {2}
    assert any(r["problem"].split()[0] not in {"What", "Compute", "Evaluate", "Calculate"}
               for r in rows), "no word-problem phrasing"
    with pytest.raises(ValueError):
        generate_problems(5, seed=0, levels=(4,))
    with pytest.raises(ValueError):
        generate_problems(5, seed=0, split="test")


def test_answers_are_correct():
    heldout = generate_problems(300, seed=3, split="heldout")
    rows = generate_problems(1000, seed=3) + heldout
    n_expr = 0
    for r in rows:
        _check_solution(r)
        m = re.fullmatch(r"(?:What is|Compute|Evaluate|Calculate) ([\d+\-*()]+)[.?]", r["problem"])
        if m:  # bare expressions: evaluate them independently of the solution
            n_expr += 1
            assert eval(m[1], {"__builtins__": {}}) == int(r["answer"]), r
            key = r["problem"] if r["level"] == 1 else m[1]
            assert split_of(key) == ("heldout" if r in heldout else "train")
    assert n_expr > 100


def test_train_and_heldout_are_disjoint():
    train = generate_problems(3000, seed=0)
    held = generate_problems(500, seed=0, split="heldout")
    assert not {r["problem"] for r in train} & {r["problem"] for r in held}

    # levels 2-3: the step lines identify the arithmetic whatever the phrasing, and no
    # expression is shared (level 1 problems are single table facts, split by their text)
    def multi_step(rows):
        return {r["solution"] for r in rows if r["level"] > 1}

    assert not multi_step(train) & multi_step(held)
    assert not multi_step(generate_problems(3000, seed=1)) & multi_step(held)
    assert len(multi_step(held)) > 200


def test_write_jsonl_roundtrip(tmp_path):
    rows = generate_problems(20, seed=0)
    path = write_jsonl(rows, tmp_path / "sub" / "a.jsonl")
    assert read_jsonl(path) == rows


# ----------------------------------------------------------------------------- builder

def test_config_validation_and_hash(monkeypatch, tmp_path):
    from aspo_lit.testbed import TestbedConfig, config_hash, default_cache_dir, testbed_dir

    with pytest.raises(ValueError):
        TestbedConfig(hidden_size=96, num_attention_heads=4)  # head_dim 24: not a vLLM size
    with pytest.raises(ValueError):
        TestbedConfig(model_type="qwen2")
    assert config_hash(TestbedConfig()) == config_hash(TestbedConfig())
    assert config_hash(TestbedConfig()) != config_hash(TestbedConfig(seed=1))
    monkeypatch.setenv("ASPO_LIT_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    assert testbed_dir(TestbedConfig()).parent == tmp_path
    monkeypatch.delenv("ASPO_LIT_CACHE")
    assert default_cache_dir() == REPO / ".cache" / "aspo_lit"



def test_code_testbed_lives_in_the_cache_root(monkeypatch, tmp_path):
    """The code testbed follows the math testbeds' cache root: `$ASPO_LIT_CACHE`, else the
    checkout's `.cache/aspo_lit`; `build_code_testbed()` and `build-testbed --profile testbed-code`
    read it at call time."""
    from aspo_lit.testbed import cli
    from aspo_lit.testbed import code as C

    built = []

    def publish(final, build_into, keep_concurrent):  # the folder the build would fill
        built.append(final)
        final.mkdir(parents=True)
        (final / "testbed.json").write_text("{}")
        return final

    monkeypatch.setattr(C, "publish", publish)
    # no weights in the stand-in folder to compare with the shipped ones
    monkeypatch.setattr(cli.shipped, "compare_build", lambda path, name: {
        "testbed": name, "shipped": "shipped", "shipped_version": 1, "identical": True})
    monkeypatch.setenv("ASPO_LIT_CACHE", str(tmp_path / "env"))
    assert C.code_testbed_dir() == tmp_path / "env" / "testbed-code"
    assert C.build_code_testbed(verbose=False) == tmp_path / "env" / "testbed-code"
    assert cli.build("testbed-code", cache_dir=str(tmp_path / "arg"), quiet=True) == 0
    assert built == [tmp_path / "env" / "testbed-code", tmp_path / "arg" / "testbed-code"]
    monkeypatch.delenv("ASPO_LIT_CACHE")
    assert C.code_testbed_dir() == REPO / ".cache" / "aspo_lit" / "testbed-code"


# A code testbed small enough to build in seconds (max_position_embeddings: LiveCodeBench's template).
TINY_CODE = dict(
    num_train_problems=200, tokenizer_train_problems=100, vocab_size=400, hidden_size=64, intermediate_size=128,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
    sft_max_steps=4, sft_batch_size=4, sft_warmup_steps=1, eval_every=2, eval_min_step=2,
    dev_problems=4, heldout_problems=4, max_response_tokens=16, stop_accuracy=1.01,
)


def test_tiny_code_build_is_deterministic(tmp_path):
    """The code testbed is built by the math testbeds' recipe (`warm_start_into`): the same config
    gives the same bytes in another folder, and its summary describes the saved policy."""
    from safetensors.torch import load_file

    from aspo_lit.testbed.code import CodeTestbedConfig, build_code_testbed, config_hash

    config = CodeTestbedConfig(**TINY_CODE)
    first = build_code_testbed(config, out=tmp_path / "a", verbose=False)
    again = build_code_testbed(config, out=tmp_path / "b", verbose=False)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (first / name).read_bytes(), name
    meta = json.loads((first / "testbed.json").read_text())
    assert meta["config_hash"] == config_hash(config) and meta["sft_steps"] == config.sft_max_steps
    assert meta["num_parameters"] == sum(t.numel() for t in load_file(first / "model.safetensors").values())
    assert meta["vocab_size"] == len(json.loads((first / "tokenizer.json").read_text())["model"]["vocab"])
    assert meta["heldout"]["n"] == config.heldout_problems
    assert 0 < meta["longest_example_tokens"] <= config.max_position_embeddings


def test_code_build_refuses_examples_longer_than_the_model(tmp_path):
    from aspo_lit.testbed.code import CodeTestbedConfig, build_code_testbed

    config = CodeTestbedConfig(**{**TINY_CODE, "max_position_embeddings": 64})
    with pytest.raises(ValueError, match=r"SFT example of \d+ tokens exceeds max_position_embeddings=64"):
        build_code_testbed(config, out=tmp_path / "a", verbose=False)
    assert not (tmp_path / "a").exists()


def test_grading():
    from aspo_lit.testbed import is_correct

    assert is_correct("1+2=3\n\\boxed{3}", "3") and is_correct("\\boxed{1} then \\boxed{ 12 }", "12")
    assert not is_correct("\\boxed{12} then \\boxed{1}", "12") and not is_correct("no box", "12")
    assert is_correct("x\\boxed{23}", "23") and is_correct("\\boxed{023}", "23")
    assert not is_correct("\\boxed{23}", "24") and not is_correct("\\boxed{2 3}", "23")
    assert not is_correct("23", "23")


@pytest.fixture(scope="module")
def tiny_testbed(tmp_path_factory):
    from aspo_lit.testbed import TestbedConfig, build_testbed

    cache = tmp_path_factory.mktemp("tb")
    config = TestbedConfig(**TINY)
    t0 = time.perf_counter()
    path = build_testbed(config, cache_dir=cache, verbose=False)
    return config, cache, path, time.perf_counter() - t0


def test_tiny_build_layout_and_cache(tiny_testbed):
    from aspo_lit.testbed import build_testbed, config_hash

    config, cache, path, seconds = tiny_testbed
    assert seconds < 60
    assert path == cache / f"testbed-{config_hash(config)}"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "testbed.json"} <= names
    assert not [p for p in cache.iterdir() if p.name.startswith(".")], "temp folder left behind"
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    meta = json.loads((path / "testbed.json").read_text())
    assert meta["config_hash"] == config_hash(config) and meta["config"]["seed"] == config.seed
    assert meta["num_parameters"] > 0 and 0.0 <= meta["heldout"]["accuracy"] <= 1.0
    assert meta["heldout"]["n"] == config.heldout_problems

    # cached: the second call returns at once and rewrites nothing
    mtime = (path / "testbed.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_testbed(config, cache_dir=cache, verbose=False) == path
    assert time.perf_counter() - t0 < 1.0
    assert (path / "testbed.json").stat().st_mtime_ns == mtime


def test_tiny_build_loads_with_auto_classes(tiny_testbed):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from aspo_lit.prompts import INSTRUCTION, build_prompt, encode_prompt

    config, _, path, _ = tiny_testbed
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings is False
    assert cfg.head_dim in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert next(model.parameters()).dtype == torch.float32
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()

    for text in ["12+345=357", "7-2=5\n5*3=15\n15+4=19\n\\boxed{19}", "Ann has 3 pens.  Let's go!"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    digits = tok.encode("12+345=357", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(digits)[:2] == ["1", "2"], "digits must be single tokens"

    prompt = build_prompt("What is 1+2?", tok, enable_thinking=None)
    assert "What is 1+2? " + INSTRUCTION in prompt
    assert prompt.startswith(tok.bos_token) and prompt.endswith("<|assistant|>")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 1+2? " + INSTRUCTION}],
                                  add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == encode_prompt("What is 1+2?", tok, enable_thinking=None) == tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id

    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=True, top_k=0)
    assert out.shape[1] > len(ids)
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_tiny_build_is_deterministic(tiny_testbed, tmp_path):
    from aspo_lit.testbed import build_testbed

    config, _, path, _ = tiny_testbed
    again = build_testbed(config, cache_dir=tmp_path, verbose=False)
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()


def test_force_rebuild_and_cli(tiny_testbed, tmp_path, capsys):
    from aspo_lit.__main__ import main

    config, _, _, _ = tiny_testbed
    overrides = json.dumps(TINY)
    assert main(["build-testbed", "--cache_dir", str(tmp_path), "--overrides", overrides]) == 0
    out = capsys.readouterr().out
    path = Path(out.splitlines()[0])
    assert path.parent == tmp_path and (path / "testbed.json").is_file()
    mtime = (path / "testbed.json").stat().st_mtime_ns
    assert main(["build-testbed", "--cache_dir", str(tmp_path), "--overrides", overrides, "--force", "true"]) == 0
    assert (path / "testbed.json").stat().st_mtime_ns != mtime
    assert json.loads(out[out.index("{"):out.rindex("}") + 1])["config_hash"] in path.name
    # the last line: how this build compares with the shipped testbed (here another recipe)
    assert out.splitlines()[-1].startswith("against the shipped testbed v1") and "another recipe" in out


def test_held_out_accuracy_helper(tiny_testbed):
    from aspo_lit.testbed import held_out_accuracy

    _, _, path, _ = tiny_testbed
    acc = held_out_accuracy(path, n=8, seed=1)
    assert 0.0 <= acc <= 1.0
    assert acc == held_out_accuracy(path, n=8, seed=1)


_VLLM_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        from transformers import AutoTokenizer
        path = sys.argv[1]
        tok = AutoTokenizer.from_pretrained(path)
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is 1+2?"}],
                                         add_generation_prompt=True, tokenize=False)
        ids = tok.encode(prompt, add_special_tokens=False)
        # eager: this checks loading and sampling, not the compiled graph (saves ~1 min on 2 cores)
        llm = LLM(model=path, dtype="float32", max_model_len=256, seed=0, enforce_eager=True)
        assert llm.get_tokenizer().encode(prompt, add_special_tokens=False) == ids
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(temperature=1.0, max_tokens=8))
        print("VLLM_OK", len(out[0].outputs[0].token_ids))
""")


@pytest.mark.vllm
def test_tiny_build_loads_in_vllm(tiny_testbed, tmp_path):
    pytest.importorskip("vllm")
    _, cache, path, _ = tiny_testbed
    script = tmp_path / "load_vllm.py"
    script.write_text(_VLLM_SCRIPT)
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache / "vllm"))
    # output to files, not pipes: vLLM's engine processes and resource tracker can outlive the
    # script and hold a pipe open, which would make communicate() wait forever
    log = tmp_path / "vllm.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=sink,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=400)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "timeout"
    text = log.read_text()
    assert rc == 0 and "VLLM_OK" in text, f"rc={rc}\n{text[-3000:]}"


def test_the_shipped_testbed_is_a_useful_rl_start():
    """The shipped testbed's sampled accuracy (T=1) on fresh held-out problems is within 20-80%."""
    from aspo_lit.testbed import held_out_accuracy
    from aspo_lit.testbed.shipped import shipped_dir, shipped_record

    meta = shipped_record("testbed")
    assert 0.2 <= meta["heldout"]["accuracy"] <= 0.8
    assert meta["heldout"]["mean_response_tokens"] <= 64
    acc = held_out_accuracy(shipped_dir("testbed"), n=200, seed=12345)
    assert 0.2 <= acc <= 0.8, acc
