"""What an evaluation leaves on disk so that it resumes: per-sample records, pinned settings, done markers.

Every sample is recorded as one JSONL line, flushed per problem, in
`<out_dir>/<model_tag>/<benchmark>.samples.jsonl`:

    {"problem_id", "sample_index", "text_sha1", "answer_extracted", "correct",
     "finish_reason", "num_tokens"}

so a killed or preempted evaluation resumes where it stopped (done (problem, sample) pairs are
skipped, never written twice), and a finished (model, benchmark) pair — `<benchmark>.done.json`
holding its metrics — is never recomputed. `<benchmark>.meta.json` pins the sampling settings and
the weights' fingerprint: samples drawn under other settings, or by other weights, are never mixed in.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

from aspo_lit.testbed.shipped import NAMES as TESTBEDS
from aspo_lit.training.export import is_checkpoint
from aspo_lit.training.models import resolve_model_path

log = logging.getLogger(__name__)


def model_fingerprint(model: str) -> str:
    """Identifies the weights: the hub id, or sizes and mtimes of a local file/folder."""
    path = Path(model).expanduser()
    if not path.exists():
        return str(model)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return hashlib.sha1("|".join([str(path.resolve()), *parts]).encode()).hexdigest()[:12]


def model_tag(model: str) -> str:
    """Folder name of a model's results: `org__name` for a hub id; for local weights their name
    and fingerprint, `<folder>-<fp>` or `<run>-<ckpt stem>-<fp>`, so that retrained or rebuilt
    weights (the testbed included) get fresh results instead of stale ones."""
    model = str(model)
    path = Path(model).expanduser()
    if is_checkpoint(model):   # runs/<name>/checkpoints/last.ckpt -> <name>-last-<fp>
        run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        run = f"{run.parent.name}-{run.name}" if run.name.startswith("version_") else run.name
        tag = f"{run}-{path.stem}-{model_fingerprint(model)[:8]}"
    elif model in TESTBEDS or path.exists():
        local = Path(resolve_model_path(model)).resolve()
        tag = f"{local.name}-{model_fingerprint(str(local))[:8]}"
    else:
        tag = model.replace("/", "__")
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", tag)


def read_sample_records(path: Path) -> dict[tuple[str, int], dict]:
    """Records already written, keyed by (problem_id, sample_index); the first one wins. A torn
    last line (the process was killed mid-write) is cut off so appending continues cleanly."""
    records: dict[tuple[str, int], dict] = {}
    if not path.is_file():
        return records
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - end)
            f.truncate(end)
    for lineno, line in enumerate(data[:end].decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            records.setdefault((str(rec["problem_id"]), int(rec["sample_index"])), rec)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            log.warning("%s, line %d: unreadable record skipped", path, lineno)
    return records


def pin_settings(path: Path, meta: dict) -> None:
    """Write `meta` to `path` (`<benchmark>.meta.json`) on the first call; on later calls, raise
    naming each setting that differs from the pinned ones."""
    if path.is_file():
        old = json.loads(path.read_text())
        if old != meta:
            diff = {key: (old.get(key), meta.get(key)) for key in set(old) | set(meta)
                    if old.get(key) != meta.get(key)}
            raise ValueError(f"{path}: samples there were drawn with other settings {diff} "
                             "(old, new); use another out_dir or tag, or delete that folder")
    else:
        write_json(path, meta)


def read_done(path: Path, k: int, problem_ids_sha1: str) -> dict | None:
    """The metrics of a finished benchmark (`<benchmark>.done.json`), None unless it was finished
    with the same K on the same problems."""
    if not path.is_file():
        return None
    done = json.loads(path.read_text())
    return done if done.get("k") == k and done.get("problem_ids_sha1") == problem_ids_sha1 else None


def write_json(path: Path, obj) -> None:
    """Through a temporary file and `os.replace`: a kill leaves the old file or the new, never half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False))
    os.replace(tmp, path)
