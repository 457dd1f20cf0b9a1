"""An `ASPOModule` Lightning checkpoint as an HF model folder, for evaluation (docs/evaluation.md).

`ASPOModule.export_hf` saves the policy of a live module; `export_checkpoint` does the same from a
checkpoint on disk — a `torch.save` file, or the sharded folder FSDP2 writes — without building the
module or its trainer.
"""
from __future__ import annotations

import json
import warnings
import zipfile
from pathlib import Path

import torch

from aspo_lit.training.checkpoint_io import unreadable
from aspo_lit.training.models import load_policy, load_tokenizer, resolve_model_path


def is_checkpoint(model: str) -> bool:
    return str(model).endswith(".ckpt")


def export_checkpoint(ckpt_path, out_dir, torch_dtype: str | None = None) -> Path:
    """Write the policy of an `ASPOModule` Lightning checkpoint as an HF model folder.

    The module keeps its policy under the attribute `policy` (state-dict keys `policy.*`) and
    its base model in the hyper-parameter `model_name_or_path`; the base model is loaded, the
    trained weights are put into it (all of them: a missing or unexpected key is an error), and
    model + tokenizer are saved with `save_pretrained`. Returns `out_dir`.
    """
    ckpt_path, out_dir = Path(ckpt_path), Path(out_dir)
    checkpoint = load_checkpoint(ckpt_path)
    hparams = checkpoint.get("hyper_parameters") or {}
    base = hparams.get("model_name_or_path")
    if not base:
        raise ValueError(f"{ckpt_path}: no hyper_parameters['model_name_or_path'] "
                         "(not an ASPOModule checkpoint?)")
    prefix = "policy."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"{ckpt_path}: no '{prefix}*' weights in its state_dict")
    dtype = torch_dtype or hparams.get("torch_dtype") or "float32"
    model = load_policy(base, dtype)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:   # shape mismatches raise even with strict=False
        raise ValueError(f"{ckpt_path}: weights do not fit base model {base!r} (resolved to "
                         f"{resolve_model_path(base)}; was it rebuilt or changed since "
                         f"training?): {str(e).splitlines()[-1].strip()}") from None
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"{ckpt_path}: weights do not fit base model {base!r}: missing "
                         f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    model.config.use_cache = True
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    load_tokenizer(base).save_pretrained(out_dir)
    (out_dir / "exported_from.json").write_text(json.dumps(
        {"checkpoint": str(ckpt_path.resolve()), "base_model": base,
         "global_step": checkpoint.get("global_step")}, indent=1))
    return out_dir


def load_checkpoint(ckpt_path: Path) -> dict:
    """A Lightning checkpoint as one dict, with the module's full (unsharded) `state_dict`.

    A file is a plain `torch.save`. A folder is what `ModelParallelStrategy` (FSDP2) writes: a
    torch.distributed checkpoint of the sharded state plus `meta.pt` with everything else; only
    its `state_dict` entry is read (not the optimizer states), gathered into one process.
    """
    def torch_load(path):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:   # noqa: BLE001 - our own checkpoints: hyper-parameters may hold non-tensor objects
            if not zipfile.is_zipfile(path):   # empty, garbage: never unpickled without weights_only
                raise unreadable(Path(path), err) from None
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:   # noqa: BLE001 - a torn file: named, with what to use instead
            raise unreadable(Path(path), err) from None

    if not ckpt_path.is_dir():
        return torch_load(ckpt_path)
    # lazy: torch builds without distributed support (torch.distributed.is_available() False)
    # cannot import it, and only a sharded folder needs it
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not (ckpt_path / "meta.pt").is_file():
        raise ValueError(f"{ckpt_path}: a folder, but not a Lightning distributed checkpoint "
                         "(no meta.pt)")
    checkpoint = torch_load(ckpt_path / "meta.pt")
    with warnings.catch_warnings():   # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        sharded = _load_state_dict_from_keys({"state_dict"}, checkpoint_id=str(ckpt_path))
    checkpoint["state_dict"] = sharded["state_dict"]
    return checkpoint
