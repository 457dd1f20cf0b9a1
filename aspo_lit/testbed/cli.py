"""`python -m aspo_lit build-testbed`: build a CPU testbed by its recipe, and compare it with the shipped one."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from aspo_lit.testbed import shipped
from aspo_lit.testbed.build import build_testbed
from aspo_lit.testbed.code import CodeTestbedConfig, build_code_testbed, code_testbed_dir
from aspo_lit.testbed.config import PROFILES

CODE_PROFILE = "testbed-code"


def build(profile: str = "testbed", overrides: dict[str, Any] | None = None, seed: int | None = None,
          cache_dir: str | None = None, force: bool = False, quiet: bool = False, ship: bool = False) -> int:
    """Build (if missing) a CPU testbed by its recipe, print where it is and how it compares with the
    testbed the package ships (`model_name_or_path: testbed` loads the shipped one; docs/testbed.md).

    Args:
        profile: the named testbed: testbed (the fast demo), testbed-long (the study's), or
            testbed-code (the code task's).
        overrides: TestbedConfig fields to change, e.g. {sft_max_steps: 400}.
        seed: TestbedConfig.seed.
        cache_dir: cache root (default: $ASPO_LIT_CACHE or <repo>/.cache/aspo_lit).
        force: rebuild even if cached.
        quiet: no build progress on stderr.
        ship: make this build the shipped testbed (for maintainers: a new version when its
            weights differ; aspo_lit/testbeds/<profile>/).
    """
    changes = {**(overrides or {}), **({} if seed is None else {"seed": seed})}
    if profile == CODE_PROFILE:
        path = build_code_testbed(dataclasses.replace(CodeTestbedConfig(), **changes),
                                  out=code_testbed_dir(cache_dir or None), force=force, verbose=not quiet)
    elif profile in PROFILES:
        path = build_testbed(dataclasses.replace(PROFILES[profile], **changes), cache_dir=cache_dir, force=force,
                             verbose=not quiet)
    else:
        raise ValueError(f"profile: unknown testbed {profile!r}; expected one of {sorted([*PROFILES, CODE_PROFILE])}")
    meta = json.loads((path / "testbed.json").read_text())
    print(path)
    print(json.dumps({k: meta.get(k) for k in ("config_hash", "built_at", "build_seconds",
                                               "num_parameters", "sft_steps", "heldout")}, indent=2))
    report = shipped.compare_build(path, profile)
    print(_comparison(report))
    if ship:
        record = shipped.ship(path, profile)
        print(f"shipped as {profile} v{record['version']}: {report['shipped']}")
    return 0


def _comparison(report: dict) -> str:
    head = f"against the shipped {report['testbed']} v{report['shipped_version']} ({report['shipped']}): "
    if report["identical"]:
        return head + "identical (every file's SHA-256)"
    acc = report["heldout_accuracy"]
    recipe = "the same recipe" if report["same_recipe"] else "another recipe (its config hash differs)"
    largest = report["max_abs_weight_diff"]
    weights = (f"weights differ in {report['tensors_differ']} of {report['tensors']} tensors"
               + (f", max |dw| {largest:.3g}" if largest is not None else ""))
    return (head + f"{recipe}; {weights}"
            + (f", shapes differ: {report['shapes_differ']}" if report["shapes_differ"] else "")
            + f"; held-out accuracy {acc['built']} here vs {acc['shipped']} shipped")
