"""FSDP2Strategy: Lightning's `ModelParallelStrategy` as plain data-parallel FSDP2 with mixed precision.

`ModelParallelStrategy()` with its defaults sets `data_parallel_size = num_nodes` and
`tensor_parallel_size = devices` (see its `setup_environment`). A model that only applies FSDP2
over `device_mesh["data_parallel"]` then shards over one rank per node, and the other ranks
train independent copies. This strategy makes the data-parallel dimension span every process
(tensor parallelism 1), which is what `ASPOModule.configure_model` expects and checks.

Precision follows verl's FSDP workers: the weights and AdamW states stay in fp32 (load the model
with `model.torch_dtype: float32` and keep `trainer.precision: 32-true`); FSDP2's
`MixedPrecisionPolicy` casts each gathered layer to `param_dtype` (bf16) for compute and reduces
gradients in `reduce_dtype` (fp32). Pure bf16 weights (`precision: bf16-true`) lose updates of
lr 1e-6 to rounding: a bf16 weight of magnitude 0.02 changes only by steps of 2^-14.

`param_dtype: float16` (or `reduce_dtype: float16`) is fp16 compute on the same fp32 master weights:
`ASPOModule` then scales the loss with torch's `ShardedGradScaler` (`aspo_lit.maths.fp16`; docs/gpu.md,
"fp16 compute"), as verl's FSDP workers do for fp16.

Each rank runs its share of the host's physical cores as torch threads (`aspo_lit.training.threads`), unless
``OMP_NUM_THREADS`` is set.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info

from aspo_lit.maths.settings import check_choice
from aspo_lit.training.checkpoint_io import staging_path, swap_folder
from aspo_lit.training.threads import set_threads_per_rank, user_thread_settings

ComputeDType = Literal["float32", "bfloat16", "float16"]
_DTYPES = {name: getattr(torch, name) for name in get_args(ComputeDType)}


class FSDP2Strategy(ModelParallelStrategy):
    """Data parallelism over every process, FSDP2-sharded by the module, with a mixed-precision policy.

    Args:
        param_dtype: compute dtype of the gathered weights (``bfloat16`` on GPU; ``float16`` turns on
            the module's grad scaler; ``None`` keeps the weights' own dtype).
        reduce_dtype: dtype of the gradient reduce-scatter (``float32``, as verl; ``float16`` also
            turns on the grad scaler).
        **kwargs: passed to `ModelParallelStrategy` (``save_distributed_checkpoint``,
            ``process_group_backend``, ``timeout``).
    """

    def __init__(self, param_dtype: ComputeDType | None = "bfloat16", reduce_dtype: ComputeDType | None = "float32",
                 **kwargs: Any) -> None:
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            check_choice(f"trainer.strategy.{name}", value, ComputeDType | None)
        for key in ("data_parallel_size", "tensor_parallel_size"):
            if kwargs.pop(key, "auto") not in ("auto", None):
                raise ValueError(f"trainer.strategy.{key} is not a setting of FSDP2Strategy: it shards over every process")
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        # read before Lightning's launcher sets OMP_NUM_THREADS in each rank: only the user's setting is kept
        self.user_thread_settings = user_thread_settings()

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        self.set_threads()

    def set_threads(self) -> None:
        """This rank's torch threads: its share of the host's cores (`aspo_lit.training.threads`), logged once."""
        rank_zero_info(set_threads_per_rank(self.num_processes, self.user_thread_settings))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """A sharded checkpoint folder is written beside its target and swapped in whole
        (`aspo_lit.training.checkpoint_io.swap_folder`): a save that fails leaves the previous one loadable.
        A single-file checkpoint goes through the CheckpointIO (atomic: `AtomicCheckpointIO`)."""
        if not self._save_distributed_checkpoint or storage_options is not None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        staged = staging_path(path)
        if self.global_rank == 0 and staged.exists():
            shutil.rmtree(staged)
        self.barrier("staging")
        super().save_checkpoint(checkpoint, staged)
        self.barrier("staged")
        if self.global_rank == 0:
            swap_folder(staged, path)
        self.barrier("swapped")

    @property
    def mp_policy(self):
        """FSDP2 `MixedPrecisionPolicy` for `fully_shard` (read by `ASPOModule.configure_model`)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=_DTYPES[self.param_dtype] if self.param_dtype else None,
            reduce_dtype=_DTYPES[self.reduce_dtype] if self.reduce_dtype else None,
        )
