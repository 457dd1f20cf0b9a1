"""`python -m aspo_lit build-testbed`: build (or find in the cache) a CPU testbed policy."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from aspo_lit.testbed.build import build_testbed
from aspo_lit.testbed.code import CodeTestbedConfig, build_code_testbed, code_testbed_dir
from aspo_lit.testbed.config import PROFILES

CODE_PROFILE = "testbed-code"


def build(profile: str = "testbed", overrides: dict[str, Any] | None = None, seed: int | None = None,
          cache_dir: str | None = None, force: bool = False, quiet: bool = False) -> int:
    """Build (if missing) a CPU testbed policy and print where it is.

    Args:
        profile: the named testbed: testbed (the fast demo), testbed-long (the study's), or
            testbed-code (the code task's).
        overrides: TestbedConfig fields to change, e.g. {sft_max_steps: 400}.
        seed: TestbedConfig.seed.
        cache_dir: cache root (default: $ASPO_LIT_CACHE or <repo>/.cache/aspo_lit).
        force: rebuild even if cached.
        quiet: no build progress on stderr.
    """
    changes = {**(overrides or {}), **({} if seed is None else {"seed": seed})}
    if profile == CODE_PROFILE:
        out = code_testbed_dir(cache_dir or None)
        path = build_code_testbed(dataclasses.replace(CodeTestbedConfig(), **changes), out=out, force=force,
                                  verbose=not quiet)
    elif profile in PROFILES:
        path = build_testbed(dataclasses.replace(PROFILES[profile], **changes), cache_dir=cache_dir, force=force,
                             verbose=not quiet)
    else:
        raise ValueError(f"profile: unknown testbed {profile!r}; expected one of {sorted([*PROFILES, CODE_PROFILE])}")
    meta = json.loads((path / "testbed.json").read_text())
    print(path)
    print(json.dumps({k: meta.get(k) for k in ("config_hash", "built_at", "build_seconds",
                                               "num_parameters", "sft_steps", "heldout")}, indent=2))
    return 0
