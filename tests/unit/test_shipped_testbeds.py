"""The testbeds shipped with the package (aspo_lit.testbed.shipped, docs/testbed.md): the same
weights on every machine, checked against their record; a local build compared with them; a run
names the version it started from."""

from __future__ import annotations

import json
import shutil

import pytest

from aspo_lit.testbed import shipped
from aspo_lit.testbed.shipped import NAMES, ShippedTestbedError


def _recipe_hash(name: str) -> str:
    from aspo_lit.testbed.code import CodeTestbedConfig
    from aspo_lit.testbed.code import config_hash as code_hash
    from aspo_lit.testbed.config import PROFILES, config_hash

    return code_hash(CodeTestbedConfig()) if name == "testbed-code" else config_hash(PROFILES[name])


@pytest.mark.parametrize("name", NAMES)
def test_each_shipped_testbed_is_the_current_recipes_and_loads(name):
    """Its files match their SHA-256, its record names the machine that built it, and its recipe is
    today's (a changed recipe must ship a new version: `build-testbed --profile NAME --ship true`)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = shipped.shipped_dir(name)
    record = shipped.shipped_record(name)
    assert record["testbed"] == name and record["version"] >= 1
    assert set(record["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert {"cpu", "cpu_flags", "torch_threads", "torch"} <= set(record["built_on"])
    assert record["config_hash"] == _recipe_hash(name), (
        f"the {name} recipe changed since v{record['version']} was shipped: rebuild and ship it "
        f"(python -m aspo_lit build-testbed --profile {name} --ship true)")
    assert AutoTokenizer.from_pretrained(folder).eos_token is not None
    assert AutoConfig.from_pretrained(folder).model_type == "llama"


def _copy(tmp_path, name: str = "testbed"):
    root = tmp_path / "testbeds"
    shutil.copytree(shipped.ROOT / name, root / name)
    return root


def test_a_changed_or_missing_file_is_refused_naming_it(tmp_path):
    root = _copy(tmp_path)
    assert shipped.shipped_dir("testbed", root) == root / "testbed"
    shipped._verified.cache_clear()
    (root / "testbed" / "tokenizer.json").write_text("{}")
    with pytest.raises(ShippedTestbedError, match=r"tokenizer\.json differ from the SHA-256"):
        shipped.shipped_dir("testbed", root)
    (root / "testbed" / "model.safetensors").unlink()
    with pytest.raises(ShippedTestbedError, match=r"model\.safetensors, tokenizer\.json"):
        shipped.shipped_dir("testbed", root)
    with pytest.raises(ValueError, match="no shipped testbed 'testbed-xl'"):
        shipped.shipped_dir("testbed-xl", root)


def _perturbed(folder, scale: float = 1e-3):
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + scale
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return name


def test_identity_a_copy_is_its_version_a_local_build_is_not(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(shipped.ROOT / "testbed", copy)
    ident = shipped.identity(copy)
    assert ident["name"] == "testbed" and ident["version"] == 1
    assert shipped.describe(ident) == "testbed v1"
    _perturbed(copy)
    ident = shipped.identity(copy)
    assert ident["version"] is None and ident["name"] == "testbed"   # the same recipe (config hash)
    assert shipped.describe(ident).startswith("a local build of testbed (weights ")
    assert shipped.identity(tmp_path) is None and shipped.describe(None) == "not a testbed"


def test_compare_build_says_identical_or_by_how_much(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(shipped.ROOT / "testbed", copy)
    report = shipped.compare_build(copy, "testbed")
    assert report["identical"] and report["same_recipe"] and report["shipped_version"] == 1
    name = _perturbed(copy, 1e-3)
    report = shipped.compare_build(copy, "testbed")
    assert not report["identical"] and report["same_recipe"]
    assert report["tensors_differ"] == 1 and report["max_abs_weight_diff"] == pytest.approx(1e-3, rel=1e-2), name


def test_ship_is_a_new_version_only_when_the_weights_differ(tmp_path):
    root = _copy(tmp_path)
    shipped._verified.cache_clear()
    build = tmp_path / "build"
    shutil.copytree(shipped.ROOT / "testbed", build)
    assert shipped.ship(build, "testbed", root)["version"] == 1      # the same bytes: the same version
    _perturbed(build)
    record = shipped.ship(build, "testbed", root)
    assert record["version"] == 2 and json.loads((root / "testbed" / "testbed.json").read_text()) == record
    assert shipped.shipped_dir("testbed", root) == root / "testbed"  # its new hashes hold
