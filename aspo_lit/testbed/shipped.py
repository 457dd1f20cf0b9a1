"""The testbeds shipped with the package: every machine starts from the same weights (docs/testbed.md).

A testbed is trained where it is built, and another CPU kind rounds its warm start's sums otherwise
(the same recipe stopped at 45.3 % held-out accuracy on a 2-core AMD EPYC, at 43.75 % on an Intel
machine): built on each machine, each would run a testbed of its own, and a reference made on one
would not hold on the other. So the three testbeds are built once by the recipe
(:mod:`aspo_lit.testbed.build`, :mod:`aspo_lit.testbed.code`) and shipped as package data,
``aspo_lit/testbeds/<name>/``, each with its build record ``testbed.json``: the name and version,
the recipe (config, its hash, the builder version), the machine that built it (CPU, vector
extensions, torch threads, library versions), the held-out accuracy and the SHA-256 of every file.

``model_name_or_path: testbed`` (``testbed-long``, ``testbed-code``) loads the shipped folder once its
files match their hashes (:func:`shipped_dir`); nothing is built or downloaded. ``build-testbed``
builds the recipe into the cache and reports how that build compares with the shipped weights
(:func:`compare_build`); ``--ship true`` makes a build the shipped one (:func:`ship`), as a new
version when its weights differ. A run names the testbed it started from (:func:`identity`:
``testbed v1``), and ``compare`` says when a run and a reference started from different ones.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path

__all__ = ["NAMES", "ROOT", "RECORD", "ShippedTestbedError", "shipped_dir", "shipped_record", "file_hashes",
           "identity", "describe", "compare_build", "ship", "machine"]

NAMES = ("testbed", "testbed-long", "testbed-code")
ROOT = Path(__file__).resolve().parents[1] / "testbeds"
RECORD = "testbed.json"
WEIGHTS = "model.safetensors"


class ShippedTestbedError(RuntimeError):
    """A shipped testbed whose files are missing or not the ones its record names."""


def file_hashes(folder: str | os.PathLike) -> dict[str, str]:
    """SHA-256 of every file of ``folder`` but the record itself, by file name."""
    folder = Path(folder)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != RECORD}


def shipped_record(name: str, root: Path = ROOT) -> dict:
    """The build record of the shipped testbed ``name``."""
    if name not in NAMES:
        raise ValueError(f"no shipped testbed {name!r}; the shipped ones: {', '.join(NAMES)}")
    path = root / name / RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ShippedTestbedError(f"{path}: the shipped testbed's build record is missing or unreadable ({err}); "
                                  "reinstall aspo-lit (or `git checkout aspo_lit/testbeds` in a checkout)") from None


@functools.lru_cache(maxsize=None)
def _verified(name: str, root: Path) -> Path:
    folder = root / name
    expected = shipped_record(name, root).get("files") or {}
    found = file_hashes(folder)
    wrong = sorted(f for f in expected if found.get(f) != expected[f])
    if not expected or wrong:
        detail = f"{', '.join(wrong)} differ from the SHA-256 in {folder / RECORD}" if expected else "no file hashes"
        raise ShippedTestbedError(
            f"shipped testbed {folder}: {detail}. A clone without its binary files (Git LFS pointers, a partial "
            "checkout) or a file changed by hand; reinstall aspo-lit or `git checkout aspo_lit/testbeds`")
    return folder


def shipped_dir(name: str, root: Path = ROOT) -> Path:
    """The folder of the shipped testbed ``name``, its files checked against their SHA-256 (once per process)."""
    shipped_record(name, root)
    return _verified(name, root)


def identity(folder: str | os.PathLike) -> dict | None:
    """Which testbed ``folder`` holds: ``{name, version, weights_sha256}``. A folder whose weights are
    those of a shipped version is that version (a cache folder a run loaded included); a local build
    of another recipe or on another machine has ``version: None``. None for a folder that is no
    testbed (a hub model, a checkpoint)."""
    folder = Path(folder)
    try:
        record = json.loads((folder / RECORD).read_text())
        weights = hashlib.sha256((folder / WEIGHTS).read_bytes()).hexdigest()
    except (OSError, ValueError):
        return None
    for name in NAMES:
        try:
            shipped = shipped_record(name)
        except ShippedTestbedError:
            continue
        if shipped.get("files", {}).get(WEIGHTS) == weights:
            return {"name": name, "version": shipped.get("version"), "weights_sha256": weights}
    return {"name": _recipe_name(record), "version": None, "weights_sha256": weights,
            "config_hash": record.get("config_hash")}


def _recipe_name(record: dict) -> str | None:
    """The shipped testbed whose recipe a build record's is (same config hash), else its own name."""
    for name in NAMES:
        try:
            if shipped_record(name).get("config_hash") == record.get("config_hash"):
                return name
        except ShippedTestbedError:
            continue
    return record.get("testbed") or record.get("name")


def describe(ident: dict | None) -> str:
    """``testbed v1``, or ``a local build of <name> (weights <sha>...)``; ``not a testbed`` for None."""
    if not ident:
        return "not a testbed"
    if ident.get("version") is not None:
        return f"{ident['name']} v{ident['version']}"
    return f"a local build of {ident.get('name')} (weights {str(ident.get('weights_sha256'))[:12]})"


def compare_build(built: str | os.PathLike, name: str, root: Path = ROOT) -> dict:
    """How a local build of ``name``'s recipe compares with the shipped testbed: ``identical`` (every
    file's bytes, the record aside), else the recipe hashes, the largest absolute weight difference
    and the held-out accuracies of both records."""
    from safetensors.torch import load_file

    built = Path(built)
    shipped = shipped_dir(name, root)
    record, ours = shipped_record(name, root), json.loads((built / RECORD).read_text())
    report = {"testbed": name, "shipped": str(shipped), "built": str(built),
              "shipped_version": record.get("version"),
              "same_recipe": record.get("config_hash") == ours.get("config_hash"),
              "identical": file_hashes(built) == record.get("files"),
              "heldout_accuracy": {"shipped": _accuracy(record), "built": _accuracy(ours)}}
    if not report["identical"]:
        a, b = load_file(shipped / WEIGHTS), load_file(built / WEIGHTS)
        common = sorted(set(a) & set(b))
        diffs = {k: float((a[k].double() - b[k].double()).abs().max()) for k in common if a[k].shape == b[k].shape}
        report.update(tensors_differ=sum(d > 0 for d in diffs.values()), tensors=len(common),
                      max_abs_weight_diff=max(diffs.values(), default=None),
                      shapes_differ=sorted(set(a) ^ set(b)) + [k for k in common if a[k].shape != b[k].shape])
    return report


def _accuracy(record: dict) -> float | None:
    heldout = record.get("heldout") or {}
    return heldout.get("accuracy", heldout.get("match_rate"))


def machine(torch_threads: int) -> dict:
    """What the build ran on: the CPU, the vector extensions that decide torch's kernels, threads, versions."""
    import torch
    import transformers

    cpu, flags = platform.processor() or "unknown", []
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), cpu)
        first = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
        flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in first]
    except OSError:
        pass
    return {"cpu": cpu, "cpu_flags": flags, "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cores": os.cpu_count(), "torch_threads": torch_threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def ship(built: str | os.PathLike, name: str, root: Path = ROOT) -> dict:
    """Make the build in ``built`` the shipped testbed ``name``: copied into ``root/name`` with its
    record (version + 1 when the weights differ from the shipped ones; the same version when they are
    identical). Returns the new record. For maintainers: the package then ships these weights."""
    built = Path(built)
    record = json.loads((built / RECORD).read_text())
    old = None
    try:
        old = shipped_record(name, root)
    except (ShippedTestbedError, ValueError):
        pass
    hashes = file_hashes(built)
    same = old is not None and old.get("files") == hashes
    record.update(testbed=name, version=(old or {}).get("version", 0) + (0 if same else 1), files=hashes)
    record.setdefault("built_on", machine(int((record.get("config") or {}).get("num_threads") or 1)))
    target = root / name
    tmp = root / f".{name}.shipping"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(built, tmp)
    (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    _verified.cache_clear()
    return record
