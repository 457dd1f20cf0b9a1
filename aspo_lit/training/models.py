"""Loading the policy / reference / tokenizer, FSDP2 sharding, and full-weight gathering."""

from __future__ import annotations

from pathlib import Path

import torch


def resolve_model_path(name_or_path: str) -> str:
    """`"testbed"` / `"testbed-long"` / `"testbed-code"` → the CPU testbed shipped with the package
    (`aspo_lit.testbed.shipped`: the same weights on every machine, checked against their SHA-256);
    anything else unchanged.

    A local folder is used as is; any other string is an HF hub id, loaded by transformers.
    """
    from aspo_lit.testbed.shipped import NAMES, shipped_dir

    if name_or_path in NAMES:
        return str(shipped_dir(name_or_path))
    if name_or_path.startswith((".", "/", "~")) and not Path(name_or_path).expanduser().exists():
        raise FileNotFoundError(f"model_name_or_path: no such folder {name_or_path!r}")
    return name_or_path


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_policy(name_or_path: str, torch_dtype: str | torch.dtype = "float32", *, materialize: bool = True) -> torch.nn.Module:
    """The causal LM with its checkpoint weights, or (``materialize=False``) its architecture on the
    meta device, holding no memory: a rank that gets its shards from rank 0
    (`shard_and_broadcast`) never holds the full model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = _DTYPES[torch_dtype] if isinstance(torch_dtype, str) else torch_dtype
    path = resolve_model_path(name_or_path)
    if materialize:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        config = AutoConfig.from_pretrained(path)
        if dtype == "auto":
            dtype = getattr(config, "dtype", None) or torch.float32
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (the FSDP wrap unit), found by the model's own class list."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find decoder layers of {type(model).__name__} to shard (no _no_split_modules)")
    return layers


def shard_decoder_layers(model: torch.nn.Module, mesh, mp_policy=None) -> None:
    """FSDP2: `fully_shard` each decoder layer, then the root (policy and reference alike).

    `mp_policy` (FSDP2 `MixedPrecisionPolicy`) casts the fp32 master weights to the compute dtype
    when a layer is gathered and reduces gradients in its `reduce_dtype`.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def shard_and_broadcast(model: torch.nn.Module, mesh, mp_policy, device: torch.device) -> None:
    """FSDP2-shard a model built with real weights on rank 0 and on the meta device elsewhere,
    then fill every rank's shards from rank 0's weights (verl's ``fsdp2_load_full_state_dict``):
    ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`` sends one
    tensor at a time, so only rank 0 ever holds the full model. Buffers outside the state dict
    (rotary ``inv_freq``) are broadcast after, in name order: FSDP2 may list them in another
    order on each rank (verl sorts them too), and a broadcast pairs tensors by call order."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = dist.get_rank() == 0
    full = model.state_dict() if rank0 else {}
    shard_decoder_layers(model, mesh, mp_policy)
    if rank0:
        model.to(device)
    else:
        model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    for _, buffer in sorted(model.named_buffers(), key=lambda item: item[0]):
        dist.broadcast(buffer, src=0)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of every parameter and buffer; DTensors are gathered (all ranks must call)."""
    return dict(named_full_tensors(model))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, detached: an FSDP2 DTensor shard is gathered (a collective: every rank
    calls it), a plain tensor is itself."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach()


def named_full_tensors(model: torch.nn.Module):
    """Iterate (name, full tensor) one at a time, for streaming weight sync into a rollout engine."""
    for name, tensor in model.state_dict().items():
        yield name, full_tensor(tensor)
