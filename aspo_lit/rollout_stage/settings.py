"""What the rollout stage is configured with (``data.*``), and the checks that refuse a bad value
before any model loads, naming its key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from aspo_lit.data.sources import OnBadRow
from aspo_lit.maths.settings import check_choice, check_positive_int
from aspo_lit.rollout.base import SamplingConfig

AdvNorm = Literal["std", "none"]
PromptTemplate = Literal["chat", "plain"]


@dataclass(frozen=True)
class RolloutSettings:
    """How rollouts are sampled and graded (the ``data.*`` keys of the same names).

    group_size: G, responses per prompt (paper: 16). max_response_length: new tokens per response.
    temperature, top_p, stop: rollout sampling (paper: 1.0, 1.0). val_temperature, val_k: the
    validation loop's sampling. adv_norm: ``std`` (GRPO) or ``none`` (Dr.GRPO). filter_groups: drop
    the global batch's all-equal-reward groups. overlong_buffer, overlong_penalty_factor: DAPO's
    soft overlong penalty (0: off). max_staleness: k, batches the sampler may lag (0: synchronous).
    engine_threads: the engine process's torch threads (None: this process's count).
    """

    group_size: int = 16
    max_response_length: int = 8192
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] | None = None
    val_temperature: float = 0.8
    val_k: int = 4
    adv_norm: str = "std"
    filter_groups: bool = False
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    max_staleness: int = 0
    engine_threads: int | None = None

    def sampling(self, seed: int) -> SamplingConfig:
        """A training rollout's sampling, with the sampler's log-probs."""
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_response_length,
                              stop=self.stop, seed=seed, logprobs=True)

    def val_sampling(self, seed: int) -> SamplingConfig:
        """The validation loop's sampling: ``val_temperature``, no nucleus cut (top_p 1.0), the
        rollouts' ``max_response_length`` and ``stop``."""
        return SamplingConfig(temperature=self.val_temperature, top_p=1.0, max_tokens=self.max_response_length,
                              stop=self.stop, seed=seed)


def check_group_size(group_size: int) -> None:
    """``data.group_size`` responses per prompt: at least 2, or a group-relative advantage (eq. 1) is 0."""
    check_positive_int("data.group_size", group_size)
    if group_size < 2:
        raise ValueError(f"data.group_size must be >= 2 for group-relative advantages, got {group_size}")


def prompts_per_rank(batch_size: int, world_size: int) -> int:
    """Each rank's share of a rollout batch: ``data.batch_size`` counts prompts over all ranks."""
    if batch_size % world_size:
        raise ValueError(f"data.batch_size={batch_size} prompts must be divisible by the number of processes "
                         f"({world_size})")
    return batch_size // world_size


def refuse_staleness_on_gpus(max_staleness: int, accelerator: Any) -> None:
    """``data.max_staleness >= 1`` generates in a spawned engine process per rank, on CPU only. On a
    GPU node every rank's process would start vLLM on GPU 0 (its single-process executor takes the
    device index from ``"cuda"``) and the weights would travel as full fp32 host copies through shared
    memory (docs/gpu.md, "Bounded staleness on GPU nodes": separate generation GPUs and an NCCL
    broadcast, not built). Refused there, never run silently."""
    from lightning.pytorch.accelerators import CPUAccelerator

    if max_staleness and accelerator is not None and not isinstance(accelerator, CPUAccelerator):
        raise ValueError(
            f"data.max_staleness={max_staleness} runs its engine processes on CPU only: on "
            f"{type(accelerator).__name__} every rank's engine process would take GPU 0 and receive the weights "
            "as full fp32 host copies. Set data.max_staleness: 0 (the synchronous loop, colocated engines) on "
            "GPU nodes; docs/gpu.md, 'Bounded staleness on GPU nodes'")


def check_data_settings(args: dict[str, Any]) -> None:
    """Invalid ``data.*`` settings (a DataModule's init arguments) fail before any model loads, naming the key."""
    for key in ("batch_size", "group_size", "max_prompt_length", "max_response_length", "val_k", "val_batch_size"):
        check_positive_int(f"data.{key}", args[key])
    if not isinstance(args["max_staleness"], int) or isinstance(args["max_staleness"], bool) or args["max_staleness"] < 0:
        raise ValueError(f"data.max_staleness must be an integer >= 0, got {args['max_staleness']!r}")
    if args["engine_threads"] is not None:
        check_positive_int("data.engine_threads", args["engine_threads"])
    check_group_size(args["group_size"])
    if not 0 < args["top_p"] <= 1:
        raise ValueError(f"data.top_p must be in (0, 1], got {args['top_p']!r}")
    if args["temperature"] <= 0:
        raise ValueError(f"data.temperature must be > 0, got {args['temperature']!r}")
    for key, hint in (("adv_norm", AdvNorm), ("prompt_template", PromptTemplate), ("on_bad_row", OnBadRow)):
        check_choice(f"data.{key}", args[key], hint)
    for key in ("train_files", "val_files"):
        value = args[key]
        if isinstance(value, (list, tuple)) and not value:
            raise ValueError(f"data.{key} is an empty list of sources")
