"""ASPOModule: policy + frozen reference + policy loss, trained with manual optimisation.

One `training_step` consumes one rollout batch (docs/design.md): old and reference log-probs
without grad, then `ppo_epochs` x mini-batches (`mini_batch_size` prompts over all ranks, as the
paper's 64/16, taken as consecutive response slices) x token-budget micro-batches with gradient
accumulation under one global normaliser. The policy loss is any `PolicyLoss` (docs/design.md
"Losses"); the KL term is eq. 1's `-beta * D_KL`. It returns a `StepOutput` for the callbacks
(docs/design.md "Step diagnostics"). The row plan and the update's bookkeeping (what it starts
from, what it leaves) are `aspo_lit.maths.update_plan`'s.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from aspo_lit.maths.fp16 import check_precision, check_weights_dtype, fsdp_needs_grad_scaler
from aspo_lit.maths.losses import (
    KLKind,
    PolicyLoss,
    agg_normalizer,
    aggregate,
    effective_token_weight,
    get_policy_loss,
    kl_penalty,
)
from aspo_lit.maths.metrics import AvgAtK, PassAtK
from aspo_lit.maths.microbatch import token_budget_micro_batches, trim_to_micro_batch
from aspo_lit.maths.sampler_mismatch import check_truncated_support, truncated_is_weights
from aspo_lit.maths.seeding import derived_seed, run_seed
from aspo_lit.maths.settings import check_choice, check_positive_int, choices
from aspo_lit.maths.stats import Stat
from aspo_lit.maths.step import StepOutput
from aspo_lit.maths.update_plan import EncodedPrompts, PreUpdate, UpdateRecord, epoch_minibatches, rows_per_minibatch
from aspo_lit.rollout.batch import RolloutBatch
from aspo_lit.testbed.shipped import describe as describe_testbed
from aspo_lit.testbed.shipped import identity as testbed_identity
from aspo_lit.training.forward import (
    distinct_prompts,
    encode_prompts,
    prompt_backward_term,
    prompt_sharing_applies,
    response_logprobs,
    responses_from_prompts,
)
from aspo_lit.training.kl_reference import ReferenceHolder, drop_reference_weights
from aspo_lit.training.models import (
    load_policy,
    load_tokenizer,
    resolve_model_path,
    shard_and_broadcast,
    shard_decoder_layers,
)

# The settings with a fixed set of values (LightningCLI rejects any other, naming the key; `_validate_hparams`
# does for a module built in Python). kl_kind: `aspo_lit.maths.losses.KLKind`, verl's names next to Schulman's.
OldLogprobs = Literal["recompute", "sampler"]
TorchDType = Literal["float32", "bfloat16", "float16", "auto"]
OLD_LOGPROBS = choices(OldLogprobs)


class NonFiniteTrainingError(RuntimeError):
    """Raised after `max_nonfinite_steps` consecutive optimizer steps with a non-finite loss or grad norm."""


@dataclass(frozen=True)
class PolicyHandle:
    """What a rollout DataModule needs of the LightningModule it samples for (`ASPOModule.policy_handle`).

    The rollouts are the policy's own (docs/design.md): its prompts are encoded with the policy's
    ``tokenizer``, the engine starts from ``model_path`` and is pushed ``policy``'s weights after every
    optimizer step, and each rollout batch goes to ``device`` for the update.
    """

    tokenizer: Any
    policy: torch.nn.Module
    model_path: str
    device: torch.device


class ASPOModule(ReferenceHolder, LightningModule):
    """The RL learner of GRPO-style on-policy RL (paper eq. 1) with a swappable policy loss.

    Args:
        model_name_or_path: HF hub id, local folder, or ``"testbed"`` (the CPU testbed model,
            built and cached on first use).
        loss: a loss name -- registered (``aspo``, ``grpo``, ``grpo_no_is``, ``grpo_pos_mean``,
            ``aspo_no_dual_clip``, ``cispo``, ``gspo``), an ``aspo_lit.maths.losses`` entry point or an import
            path (``mypkg.losses:MyLoss``) -- or a `PolicyLoss` instance (``class_path``).
        loss_kwargs: hyper-parameters for a loss given by name (``eps_low``, ``eps_high``,
            ``dual_clip``, ``loss_agg``, ``eps_high_entropy``, ...). An error with a ``class_path``
            loss, whose hyper-parameters are its ``init_args``.
        kl_coef: beta of the KL-to-reference term (0 disables it and the reference model).
        kl_kind: ``k1`` (``kl``), ``k2`` (``mse``) or ``k3`` (``low_var_kl``, the paper's).
        lr, betas, weight_decay: AdamW.
        warmup_steps: linear LR warm-up, counted in rollout batches (the scheduler steps once per
            rollout batch, as verl and the authors' Archer2.0 code), then constant.
        max_grad_norm: gradient-norm clip per optimizer step.
        ppo_epochs: passes over each rollout batch (the authors' code uses 3; the paper implies 1).
        mini_batch_size: prompts per optimizer step over all ranks (paper: 16 of a 64-prompt batch),
            split in responses: each rank takes ``mini_batch_size * G / world_size`` of its rows.
        shuffle_mini_batches: shuffle each rank's rows before every epoch's mini-batch split
            (``seed``: null takes the run's ``seed_everything``); default off, as verl and the authors' code,
            which keeps the optimizer steps
            independent of the number of processes.
        micro_batch_size: responses per forward/backward when ``max_tokens_per_micro_batch`` is null
            (memory only; the gradient does not change).
        max_tokens_per_micro_batch: token budget of one forward/backward (rows x their padded width):
            rows are sorted by length and packed up to it, each micro-batch computed at its own
            width (verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``). The default; null
            falls back to ``micro_batch_size`` rows padded to the batch's longest response.
        temperature: the rollout sampling temperature; log-probs are of the tempered distribution.
        logprob_chunk_size: sequence positions per chunk of the log-softmax / entropy maths.
        gradient_checkpointing: recompute activations in the backward pass.
        torch_dtype: dtype of the loaded (master) weights and optimizer states. Keep ``float32``:
            bf16 compute comes from the strategy (`aspo_lit.training.strategy.FSDP2Strategy(param_dtype=
            "bfloat16")`); pure bf16 weights do not move at the paper's lr of 1e-6. fp16 weights
            (``float16``, or ``auto`` on an fp16 checkpoint) are refused: fp16 compute is
            ``param_dtype="float16"``, with the loss scaled by ``grad_scaler`` (`aspo_lit.maths.fp16`).
        max_nonfinite_steps: consecutive skipped (non-finite) optimizer steps before stopping; under
            fp16, a step skipped for its scaled gradients' overflow counts only once the scale is 1.
        rollout_is_cap: truncated importance sampling against the sampler/trainer mismatch: each
            token's policy-gradient term is weighted by ``min(π_old / π_sampler, cap)`` (TRL's
            ``vllm_importance_sampling_correction``, verl's rollout IS); null (default) is off.
            Needs the engine's log-probs (every rollout carries them). Refused with
            ``old_logprobs: sampler`` (the weight would be 1 on every token).
        old_logprobs: where eq. 1's π_old comes from. ``recompute`` (default, the paper's
            definition): the training policy's log-probs of the sampled tokens before the first
            update, from a pass over the rollout batch (the first mini-batch's from the forward
            of its own update, where π_θ = π_old: the same numbers, one forward fewer), with
            their entropy. ``sampler`` (verl's ``bypass_mode``): the rollout engine's log-probs
            (``batch.rollout_logprobs``), and no policy pass before the update. The ratio is then
            π_θ / π_sampler: with the fp32 transformers engine the same policy up to its
            numerics (log-probs within ~1e-4 of the trainer's); with a bf16 vLLM engine
            another distribution, whose gap to the trainer the ratio then carries and clips
            instead of measuring it (``rollout/*`` compare the sampler with the trainer on the
            first mini-batch's tokens only). The entropy (``train/entropy``, the loss's
            entropy-dependent ε) is then each token's entropy at its first update forward:
            π_old's on the first mini-batch, π_θ after the optimizer steps before it on the
            others (the authors' code takes this entropy from its update pass too); with one
            epoch ``entropy/measured_change`` is then 0. The reference pass stays.
        share_prompt: compute each distinct prompt once per mini-batch (once per rollout batch
            before the update), its KV cache shared by the group's G responses in every
            micro-batch (`aspo_lit.training.forward`, "Shared prompts"), for the policy and the reference. The same maths; the prompt's sums run in other shapes, so the
            log-probs move by rounding (~1e-6), not bit for bit: off by default, so a run's
            numbers do not change with it. On the testbeds the prompt is a quarter of a row's
            tokens (docs/performance.md). Unsharded policies only (refused under FSDP2), and
            not with ``gradient_checkpointing``.
    """

    def __init__(
        self,
        model_name_or_path: str = "testbed",
        loss: str | PolicyLoss = "aspo",
        loss_kwargs: dict[str, Any] | None = None,
        kl_coef: float = 0.001,
        kl_kind: KLKind = "k3",
        lr: float = 1e-6,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        max_grad_norm: float = 1.0,
        ppo_epochs: int = 1,
        mini_batch_size: int = 16,
        micro_batch_size: int = 8,
        max_tokens_per_micro_batch: int | None = 16384,
        temperature: float = 1.0,
        logprob_chunk_size: int = 1024,
        gradient_checkpointing: bool = False,
        torch_dtype: TorchDType = "float32",
        max_nonfinite_steps: int = 3,
        shuffle_mini_batches: bool = False,
        rollout_is_cap: float | None = None,
        old_logprobs: OldLogprobs = "recompute",
        share_prompt: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        _validate_hparams(locals())
        if not isinstance(loss, str) and loss_kwargs:
            raise ValueError(
                f"model.loss_kwargs {dict(loss_kwargs)} would never reach the loss: model.loss is given as a class "
                f"({type(loss).__name__}, class_path), whose hyper-parameters are model.loss.init_args. Move them "
                "there and set model.loss_kwargs: null, or name the loss by its name or import path")
        self.loss_fn = get_policy_loss(loss, **(loss_kwargs or {})) if isinstance(loss, str) else loss
        self.stat_reductions = self._declare_stats()
        # Store the folder "testbed" resolves to, so a checkpoint names the exact weights it started from.
        model_name_or_path = resolve_model_path(model_name_or_path)
        # `seed` (mini-batch shuffles) is kept out of hparams: the logger merges module and
        # DataModule hparams and refuses one key with two values (the DataModule has its own seed).
        self.save_hyperparameters(ignore=["loss", "seed"])
        self.hparams["model_name_or_path"] = model_name_or_path  # LightningCLI saves the unresolved config value
        testbed = testbed_identity(model_name_or_path)
        if testbed is not None:  # which testbed (and version) the run started from: `compare` reads it
            self.hparams["testbed"] = describe_testbed(testbed)
        self.seed = run_seed(seed)  # only for shuffle_mini_batches; null: the run's seed_everything
        self.hparams["loss_name"] = loss if isinstance(loss, str) else type(loss).__name__
        self.automatic_optimization = False
        self.policy: torch.nn.Module | None = None
        self.tokenizer = load_tokenizer(model_name_or_path)
        self._nonfinite_in_a_row = 0
        self.skipped_steps_total = 0
        self.grad_scaler = None  # fp16 compute: torch's ShardedGradScaler, made in configure_model
        self.val_metrics = torch.nn.ModuleDict()  # validation avg@K / pass@K, created at the first batch

    def on_fit_start(self) -> None:
        """Which testbed (and version) the run starts from, into every logger's hyper-parameters
        (``hparams.yaml``): `compare` reads it (the hparams a logger records are those of ``__init__``'s
        arguments, which name the testbed only as ``testbed``)."""
        if self.hparams.get("testbed"):
            for logger in self.loggers:
                logger.log_hyperparams({"testbed": self.hparams["testbed"]})

    # --- model construction -------------------------------------------------------------------

    def configure_model(self) -> None:
        """Load policy and frozen reference; under `FSDP2Strategy` shard each decoder layer.

        Sharded, only rank 0 reads the checkpoint: the other ranks build the models on the meta
        device and receive their shards from rank 0 (`aspo_lit.training.models.shard_and_broadcast`), so a
        node holds one full host copy instead of one per rank. The frozen reference is held in the
        strategy's compute dtype (bf16 on GPU, as verl): its forward runs in that dtype under the
        mixed-precision policy anyway, so its log-probs are the same, at half the memory. It is
        not part of the module's state dict (`aspo_lit.training.kl_reference`): checkpoints carry the policy
        only, and a resumed fit rebuilds the reference here from the base checkpoint, as a fresh one.
        """
        if self.policy is not None:
            return
        hp = self.hparams
        if self._trainer is not None:
            check_precision(self.trainer.precision)  # a Trainer built in Python; the CLI refused it already
        mesh = getattr(self, "device_mesh", None)
        if hp.share_prompt and (mesh is not None or (self._trainer is not None and self.trainer.world_size > 1)):
            raise ValueError(
                "model.share_prompt is for one process: under FSDP2 a layer reshards after its backward, "
                "possibly before the gradient that reaches its shared prompt through the KV cache needs its weights; "
                "under DDP the prompt pass runs outside the wrapper's forward, which its reducer does not follow "
                "(it stops with 'parameters that were not used in producing the loss'); set model.share_prompt: false")
        if mesh is not None and mesh["data_parallel"].size() != self.trainer.world_size:
            raise ValueError(
                f"trainer.strategy: FSDP2 would shard over {mesh['data_parallel'].size()} of {self.trainer.world_size} "
                f"processes (data parallel {mesh['data_parallel'].size()} x tensor parallel "
                f"{mesh['tensor_parallel'].size()}), so the other ranks would train independent copies; use "
                "aspo_lit.training.strategy.FSDP2Strategy (data parallel over every rank)")
        sharded = mesh is not None and self.trainer.world_size > 1
        materialize = not sharded or self.trainer.global_rank == 0
        mp_policy = getattr(self.trainer.strategy, "mp_policy", None) if mesh is not None else None
        if fsdp_needs_grad_scaler(mp_policy):  # fp16 on the gradient's path: scale the loss (aspo_lit.maths.fp16)
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            # verl's fp16 actor's scaler: from 2^16, halved on an overflow, doubled after 400 clean steps
            self.grad_scaler = ShardedGradScaler(device=self.trainer.strategy.root_device.type, growth_interval=400,
                                                 process_group=mesh["data_parallel"].get_group())

        def build(dtype):
            # one model at a time: rank 0 never holds the full policy and the full reference together
            model = load_policy(hp.model_name_or_path, dtype, materialize=materialize)
            if sharded:
                shard_and_broadcast(model, mesh["data_parallel"], mp_policy, self.trainer.strategy.root_device)
            elif mesh is not None:
                shard_decoder_layers(model, mesh["data_parallel"], mp_policy)
            return model

        # from_pretrained returns eval mode; HF checkpointing only runs in train mode
        self.policy = build(hp.torch_dtype).train()
        check_weights_dtype(next(self.policy.parameters()).dtype, f"{hp.torch_dtype} (a checkpoint stored in fp16)")
        if hp.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hp.kl_coef > 0:  # held outside the checkpoint: rebuilt here on resume too (aspo_lit.training.kl_reference)
            self.hold_reference(build(getattr(mp_policy, "param_dtype", None) or hp.torch_dtype))
            self.ref_policy.eval().requires_grad_(False)
        if hp.share_prompt and not prompt_sharing_applies(self.policy):
            raise ValueError(
                f"model.share_prompt does not apply to {type(self.policy).__name__} (model_type "
                f"{getattr(self.policy.config, 'model_type', None)!r}): it needs a fused model family "
                "(aspo_lit.training.forward.FUSED_MODEL_TYPES) with plain DynamicLayer caches; set model.share_prompt: false")

    def policy_handle(self) -> PolicyHandle:
        """The policy, its tokenizer, checkpoint and device, for the DataModule that samples with them
        (`data_modules.math.RLDataModule.policy_handle` takes it once a run). Available once
        `configure_model` has built the policy, which Lightning calls after every ``setup`` hook."""
        if self.policy is None:
            raise RuntimeError("ASPOModule.policy_handle(): configure_model has not built the policy yet")
        return PolicyHandle(tokenizer=self.tokenizer, policy=self.policy, model_path=self.hparams.model_name_or_path,
                            device=self.device)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.policy.parameters(),
            lr=self.hparams.lr,
            betas=tuple(self.hparams.betas),
            weight_decay=self.hparams.weight_decay,
        )
        warmup = max(int(self.hparams.warmup_steps), 0)
        # Stepped once per rollout batch by training_step: rollout batch k trains at lr * min(1, (k+1)/warmup).
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda batches: min(1.0, (batches + 1) / warmup) if warmup > 0 else 1.0
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # --- the step ---------------------------------------------------------------------------

    def _logprobs(self, model: torch.nn.Module, batch: RolloutBatch, rows: Tensor, with_entropy: bool,
                  prompts: EncodedPrompts | None = None):
        """`[len(rows), T]` log-probs (and entropy) of `rows`, computed at the rows' own width: the
        columns past their longest response are zeros (they are padding, masked out). With
        `prompts` (`share_prompt`), only the response columns run, against the encoded prompts."""
        input_ids, attention_mask = trim_to_micro_batch(batch.input_ids, batch.attention_mask, batch.prompt_length,
                                                        batch.response_lengths, rows)
        options = dict(temperature=self.hparams.temperature, chunk_size=self.hparams.logprob_chunk_size,
                       with_entropy=with_entropy)
        if prompts is None:
            logprobs, entropy = response_logprobs(model, input_ids, attention_mask, batch.prompt_length, **options)
        else:
            logprobs, entropy = responses_from_prompts(model, input_ids, attention_mask, batch.prompt_length,
                                                       prompts.states, prompts.slot[rows], **options)
        pad = batch.response_mask.shape[1] - logprobs.shape[1]
        if pad:
            logprobs = torch.nn.functional.pad(logprobs, (0, pad))
            entropy = None if entropy is None else torch.nn.functional.pad(entropy, (0, pad))
        return logprobs, entropy

    @torch.no_grad()
    def _pre_update_pass(self, batch: RolloutBatch, first_epoch: list[Tensor]) -> PreUpdate:
        """Old log-probs (recomputed by the training policy, as the paper's eq. 1 ratio needs, or
        the sampler's: ``old_logprobs``), their entropy, and the reference log-probs.

        Rows are computed mini-batch by mini-batch, in the micro-batches the first epoch's update
        will use, so the rows left to that update (the first mini-batch's, with ``recompute``;
        every row's entropy, with ``sampler``) get the numbers this pass would have given them.
        """
        shape = batch.response_mask.shape
        device = batch.response_mask.device
        pre = PreUpdate.empty(shape, device, with_ref=self.ref_policy is not None)
        check_truncated_support(batch.top_p, self.hparams.old_logprobs, self.hparams.rollout_is_cap)
        if self.hparams.old_logprobs == "sampler":
            if batch.rollout_logprobs is None:
                raise ValueError("model.old_logprobs=sampler needs the rollout engine's log-probs, but this batch has none")
            pre.old_logprobs.copy_(batch.rollout_logprobs)
            pre.pending_entropy[:] = True
            pre.trainer_rows[first_epoch[0]] = True
            pre.trainer_logprobs = torch.zeros_like(pre.old_logprobs)
        else:
            pre.leave_to_first_update(first_epoch[0])
        was_training = self.policy.training
        self.policy.eval()
        everything = torch.arange(shape[0], device=device)
        computed = ~(pre.pending_old | pre.pending_entropy)
        policy_prompts = self._encode_prompts(self.policy, batch, everything[computed]) if computed.any() else None
        ref_prompts = self._encode_prompts(self.ref_policy, batch, everything) if pre.ref_logprobs is not None else None
        for rows in first_epoch:
            for micro in self._micro_batches(batch, rows):
                if not bool(pre.pending_old[micro].any() or pre.pending_entropy[micro].any()):
                    pre.old_logprobs[micro], pre.entropy[micro] = self._logprobs(self.policy, batch, micro,
                                                                                 with_entropy=True,
                                                                                 prompts=policy_prompts)
                if pre.ref_logprobs is not None:
                    pre.ref_logprobs[micro] = self._logprobs(self.ref_policy, batch, micro, with_entropy=False,
                                                             prompts=ref_prompts)[0]
        self.policy.train(was_training)
        return pre

    def _encode_prompts(self, model: torch.nn.Module, batch: RolloutBatch, rows: Tensor) -> EncodedPrompts | None:
        """The distinct prompts of ``rows`` through ``model`` once (`share_prompt`; with the grad when
        enabled), or None (row-by-row forwards: the option is off, or no two rows share a prompt)."""
        if not self.hparams.share_prompt or batch.group_size < 2:
            return None
        P = batch.prompt_length
        first, owner = distinct_prompts(batch.input_ids[rows], batch.attention_mask[rows], P)
        slot = torch.full((batch.input_ids.shape[0],), -1, dtype=torch.long, device=rows.device)
        slot[rows] = owner
        states = encode_prompts(model, batch.input_ids[rows[first], :P], batch.attention_mask[rows[first], :P])
        return EncodedPrompts(states, slot)

    def _micro_batches(self, batch: RolloutBatch, rows: Tensor) -> list[Tensor]:
        """`rows` split for forward/backward: by token budget (`max_tokens_per_micro_batch`, rows of
        similar length together, as verl's dynamic batch size) or `micro_batch_size` rows at a time.

        Every rank must run the same number of forward passes (FSDP2 gathers weights in each), so
        the budgeted split takes the largest count over ranks, halving its biggest micro-batches
        until it has that many (each half stays within the budget).
        """
        budget = self.hparams.max_tokens_per_micro_batch
        if budget is None:
            size = self.hparams.micro_batch_size
            return [rows[i : i + size] for i in range(0, rows.numel(), size)]
        lengths = batch.response_lengths.to(rows.device)[rows]
        micro = [rows[i.to(rows.device)] for i in token_budget_micro_batches(lengths, budget,
                                                                            fixed_width=batch.prompt_length)]
        count = torch.tensor(len(micro), device=self.device)
        if self._trainer is not None and self.trainer.world_size > 1:
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        while len(micro) < int(count):
            big = max(range(len(micro)), key=lambda i: micro[i].numel())
            if micro[big].numel() < 2:
                raise RuntimeError(f"cannot split {rows.numel()} rows into the {int(count)} micro-batches another rank needs")
            half = micro[big].numel() // 2
            micro[big:big + 1] = [micro[big][:half], micro[big][half:]]
        return micro

    def _global_normalizer(self, mask: Tensor) -> Tensor:
        """The mini-batch's aggregation denominator, summed over ranks then divided by world size.

        DDP/FSDP average gradients over ranks, so dividing the global count by the world size
        makes the averaged gradient equal to the single-process gradient of the whole mini-batch.
        """
        local = agg_normalizer(mask, self.loss_fn.loss_agg, norm_length=getattr(self.loss_fn, "norm_length", None))
        local = torch.as_tensor(local, dtype=torch.float32, device=mask.device)
        world = self.trainer.world_size if self._trainer is not None else 1
        if world > 1:
            local = self.trainer.strategy.reduce(local, reduce_op="sum") / world
        return local

    def _declare_stats(self) -> dict[str, str]:
        """``{name: reduction}`` of the statistics the update makes, fixed before any step runs, so
        that every rank returns the same names (the callbacks reduce them with collectives)."""
        loss_stats = {_metric_name(name, "train"): reduce for name, reduce in self.loss_fn.stat_reductions().items()}
        own = {"train/pg_loss": "mean", "train/kl": "mean", "train/grad_norm": "mean"}
        clash = sorted(set(loss_stats) & {*own, "train/skipped_steps", "train/updates_per_rollout"})
        if clash:
            raise ValueError(f"the loss's statistics {clash} clash with the training step's own; rename them")
        return {**loss_stats, **own}

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> StepOutput:
        """One rollout batch: the pre-update pass, then ``ppo_epochs`` x mini-batches, one optimizer
        step each. Returns what the callbacks read (`StepOutput`)."""
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()

        minibatches = self._minibatch_plan(batch, batch_idx)
        per_epoch = len(minibatches) // self.hparams.ppo_epochs
        t0 = time.perf_counter()
        pre = self._pre_update_pass(batch, minibatches[:per_epoch])
        t_old = time.perf_counter() - t0

        t0 = time.perf_counter()
        record = UpdateRecord.before_update(pre.old_logprobs, pre.entropy, self.stat_reductions)
        for i, rows in enumerate(minibatches):
            self._update_minibatch(optimizer, batch, rows, pre, record,
                                   make_record=UpdateRecord.made_at(i, per_epoch, self.hparams.ppo_epochs))
        scheduler.step()  # once per rollout batch: warm-up is counted in rollout batches
        t_update = time.perf_counter() - t0

        if self.ref_policy is None:
            record.stats.add("train/kl", Stat.mean(0.0))  # no reference, no KL term
        # counts equal on every rank (the finite flag is all-reduced): maxima over ranks
        counts = {"train/updates_per_rollout": Stat.max(len(minibatches)),
                  "train/skipped_steps": Stat.max(record.skipped_steps)}
        if self.grad_scaler is not None:  # the scale the next rollout batch starts from (a checkpoint's)
            counts["train/grad_scale"] = Stat.max(self.grad_scaler.get_scale())
        timings = {"timing/old_logprob_s": t_old, "timing/update_s": t_update}
        first = torch.zeros(batch.input_ids.shape[0], dtype=torch.bool)
        if self.hparams.ppo_epochs == 1:         # else every response's last update follows a step
            first[minibatches[0].cpu()] = True
        return self._step_output(batch, pre, record, counts, timings, first)

    def _loss_advantages(self, batch: RolloutBatch, old_logprobs: Tensor, rows: Tensor) -> Tensor:
        """The advantages the loss sees for ``rows``: ``[n]``, or ``[n, T]`` with each token's
        truncated importance weight against the sampler (``rollout_is_cap``)."""
        advantages = batch.advantages.float()[rows]
        if self.hparams.rollout_is_cap is None:
            return advantages
        if batch.rollout_logprobs is None:
            raise ValueError("model.rollout_is_cap needs the rollout engine's log-probs, but this batch has none")
        weights = truncated_is_weights(old_logprobs[rows], batch.rollout_logprobs[rows], self.hparams.rollout_is_cap)
        return advantages[:, None] * weights  # per-token advantage: each token's term x weight

    def _minibatch_plan(self, batch: RolloutBatch, batch_idx: int) -> list[Tensor]:
        """This rank's rows of every optimizer step of the rollout batch, epoch after epoch."""
        rows_per_step = rows_per_minibatch(self.hparams.mini_batch_size, batch.group_size, self.trainer.world_size)
        generator = None
        if self.hparams.shuffle_mini_batches:
            generator = torch.Generator().manual_seed(derived_seed(self.seed, self.global_step, batch_idx))
        device = batch.input_ids.device
        return [rows.to(device) for rows in epoch_minibatches(batch.input_ids.shape[0], rows_per_step,
                                                              self.hparams.ppo_epochs, generator)]

    def _update_minibatch(self, optimizer, batch: RolloutBatch, rows: Tensor, pre: PreUpdate,
                          record: UpdateRecord, make_record: bool = True) -> None:
        """One optimizer step on mini-batch ``rows``: forward/backward of each micro-batch, clip, step.

        What the step reports of the update (`UpdateRecord`: each token's log-prob, entropy, ratio
        and weight at its last update) is recorded in the last epoch only (``make_record``:
        `UpdateRecord.made_at`), and the update forward computes the entropy only where it is read:
        there, and on the rows' first visit when it is π_old's (`PreUpdate.fill_from_update`). The
        log-probs and the loss do not depend on either, bit for bit."""
        mask = batch.response_mask.float()
        old_logprobs, entropy, ref_logprobs = pre.old_logprobs, pre.entropy, pre.ref_logprobs
        normalizer = self._global_normalizer(mask[rows])
        minibatch_loss, finite = 0.0, True
        prompts = self._encode_prompts(self.policy, batch, rows)  # with grad: its backward runs after the loop
        leaves = None if prompts is None else EncodedPrompts(prompts.states.leaves(), prompts.slot)
        for micro in self._micro_batches(batch, rows):
            with_entropy = make_record or bool(pre.pending_entropy[micro].any())
            logprobs, updated_entropy = self._logprobs(self.policy, batch, micro, with_entropy=with_entropy,
                                                       prompts=leaves)
            pre.fill_from_update(micro, logprobs.detach(), updated_entropy, record)
            inputs = [logprobs.detach(), old_logprobs[micro]] + ([ref_logprobs[micro]] if ref_logprobs is not None else [])
            if not all(bool(torch.isfinite(x).all()) for x in inputs):
                # Never raise on one rank: the others would wait in the next collective.
                # Run a zero backward (the same collectives as every rank) and skip the step.
                finite = False
                self._backward(logprobs.nan_to_num(0.0, 0.0, 0.0).sum() * 0.0)
                continue
            advantages = self._loss_advantages(batch, old_logprobs, micro)
            loss, policy_loss, stats = self._micro_batch_loss(logprobs, old_logprobs[micro],
                                                              ref_logprobs[micro] if ref_logprobs is not None else None,
                                                              advantages, mask[micro], entropy[micro], normalizer)
            self._backward(loss)
            minibatch_loss += float(policy_loss)
            finite &= bool(torch.isfinite(loss.detach()))
            record.stats.add_all({_metric_name(name, "train"): stat for name, stat in stats.items()})
            if make_record:
                record.at_last_update(micro, logprobs.detach(), updated_entropy,
                                      self.loss_fn.ratio(logprobs, old_logprobs[micro], mask[micro]),
                                      effective_token_weight(self.loss_fn, logprobs.detach(), old_logprobs[micro],
                                                             advantages, mask[micro], entropy=entropy[micro]))
        if prompts is not None:  # the prompt pass's backward, once, for every micro-batch's gradient
            self.manual_backward(prompt_backward_term(prompts.states, leaves.states))
        grad_norm = self._clip_and_step(optimizer, finite)
        stepped = math.isfinite(grad_norm)
        # this rank's share of the mini-batch loss (the sum of its micro-batch terms; the mean over
        # ranks is the mini-batch loss), one piece per optimizer step taken
        record.stats.add("train/pg_loss", Stat.mean(minibatch_loss, weight=float(stepped)))
        record.stats.add("train/grad_norm", Stat.mean(grad_norm, weight=float(stepped)))
        record.skipped_steps += int(not stepped)

    def _step_output(self, batch: RolloutBatch, pre: PreUpdate, record: UpdateRecord,
                     counts: dict[str, Stat], timings: dict[str, float], first_minibatch: Tensor) -> StepOutput:
        mask = batch.response_mask.float()
        old_logprobs, entropy = pre.old_logprobs, pre.entropy
        stats = {**record.stats.result(), **counts}
        stats.update(pre.mismatch_stats(batch, mask))
        stats.update({_metric_name(k, "batch"): v if isinstance(v, Stat) else Stat.mean(v) for k, v in batch.stats.items()})
        stats.update({_metric_name(k, "timing"): Stat.max(v) for k, v in {**batch.timings, **timings}.items()})
        return StepOutput(
            response_mask=mask,
            old_logprobs=old_logprobs.detach(),
            entropy=entropy.detach(),
            logprobs=record.logprobs,
            ratio=record.ratio,
            updated_entropy=record.entropy,
            token_weight=record.token_weight,
            advantages=batch.advantages.float(),
            rewards=batch.rewards.float(),
            response_lengths=batch.response_lengths,
            truncated=torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.bool),
            texts=list(batch.texts),
            stats=dict(sorted(stats.items())),  # one order on every rank
            first_minibatch=first_minibatch.to(mask.device),
        )

    def _micro_batch_loss(self, logprobs, old_logprobs, ref_logprobs, advantages, mask, entropy, normalizer):
        """Loss of one micro-batch (its rows of every input), normalised by the whole mini-batch's
        `normalizer`: the policy loss + beta * KL, the policy loss alone, and the statistics (the
        loss's, and ``train/kl``)."""
        policy_loss, stats = self.loss_fn(logprobs, old_logprobs, advantages, mask, entropy=entropy,
                                          normalizer=normalizer)
        loss = policy_loss
        if ref_logprobs is not None:
            kl = kl_penalty(logprobs, ref_logprobs, kind=self.hparams.kl_kind)
            kl_term = aggregate(kl, mask, self.loss_fn.loss_agg, normalizer=normalizer,
                                norm_length=getattr(self.loss_fn, "norm_length", None))
            loss = loss + self.hparams.kl_coef * kl_term
            stats = {**stats, "train/kl": Stat.mean_over(kl, where=mask)}
        return loss, policy_loss.detach(), stats

    def _backward(self, loss: Tensor) -> None:
        """`manual_backward` of ``loss``, times the grad scaler's scale under fp16 compute."""
        self.manual_backward(loss if self.grad_scaler is None else self.grad_scaler.scale(loss))

    def _all_ranks_finite(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, True only if it is True on every rank (one all-reduce), so all ranks skip a step together."""
        if self._trainer is None or self.trainer.world_size == 1:
            return flags
        bad = torch.tensor([0.0 if flag else 1.0 for flag in flags], device=self.device)
        return tuple(bool(b == 0) for b in self.trainer.strategy.reduce(bad, reduce_op="sum"))

    def _clip_and_step(self, optimizer, finite: bool) -> float:
        """Unscale (fp16: `grad_scaler`), clip, then step only when loss and grad norm are finite on
        every rank (skip, count, stop after N in a row).

        Under fp16 a step whose scaled gradients overflow is skipped on every rank and the scaler
        halves its scale (the scaler all-reduces what it found). Such a skip counts towards
        ``max_nonfinite_steps`` only once the scale is down to 1: a gradient that overflows unscaled
        is a diverged run, one that overflows scaled is the scaler finding its level."""
        scale = None
        if self.grad_scaler is not None:
            scale = self.grad_scaler.get_scale()
            self.grad_scaler.unscale_(optimizer)
        params = [p for p in self.policy.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.hparams.max_grad_norm) if params else torch.tensor(0.0)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        loss_finite, grad_finite = self._all_ranks_finite(finite, math.isfinite(grad_norm))
        if loss_finite and grad_finite:
            optimizer.step()
            self._nonfinite_in_a_row = 0
        else:
            self.skipped_steps_total += 1
            grad_norm = float("nan")
            if not (loss_finite and scale is not None and scale > 1):
                self._nonfinite_in_a_row += 1
                rank_zero_warn(f"step {self.global_step}: skipped an optimizer step with a non-finite "
                               f"{'gradient norm' if loss_finite else 'loss'} ({self._nonfinite_in_a_row} in a row; "
                               f"the run stops at model.max_nonfinite_steps={self.hparams.max_nonfinite_steps})")
            if self._nonfinite_in_a_row >= self.hparams.max_nonfinite_steps:
                raise NonFiniteTrainingError(
                    f"{self._nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                    f"norm (step {self.global_step}); lower model.lr, check the rewards, or use torch_dtype float32"
                )
        if self.grad_scaler is not None:
            self.grad_scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # --- evaluation during training ----------------------------------------------------------

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """`batch` is graded validation rollouts from the DataModule: correctness [P, K].

        Logs the `AvgAtK` / `PassAtK(K)` metric objects: Lightning computes them over all ranks'
        problems at the end of the epoch (torchmetrics syncs their sums) and resets them.
        """
        correct = batch["correct"]
        k = correct.shape[1]
        if f"avg@{k}" not in self.val_metrics:  # K is the DataModule's: known at the first batch
            self.val_metrics.update({f"avg@{k}": AvgAtK(), f"pass@{k}": PassAtK(k)})
            self.val_metrics.to(self.device)
        for name in (f"avg@{k}", f"pass@{k}"):
            self.val_metrics[name].update(correct)
            self.log(f"val/{name}", self.val_metrics[name], prog_bar=name.startswith("avg@"),
                     metric_attribute=f"val_metrics.{name}")

    # --- checkpoints and export --------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["aspo_lit"] = {"skipped_steps_total": self.skipped_steps_total,
                                  "nonfinite_in_a_row": self._nonfinite_in_a_row, "seed": self.seed}
        if self.grad_scaler is not None:  # equal on every rank: rank 0's copy is the run's
            checkpoint["aspo_lit"]["grad_scaler"] = self.grad_scaler.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        drop_reference_weights(checkpoint)  # an older checkpoint's ref_policy.*: the base's, rebuilt by configure_model
        self._check_same_base(checkpoint)
        state = checkpoint.get("aspo_lit", {})
        self.skipped_steps_total = state.get("skipped_steps_total", 0)
        self._nonfinite_in_a_row = state.get("nonfinite_in_a_row", 0)
        if state.get("seed") is not None:  # a resumed run keeps its own shuffles (seed_everything may be random)
            self.seed = int(state["seed"])
        if self.grad_scaler is not None and state.get("grad_scaler"):  # configure_model made it
            self.grad_scaler.load_state_dict(state["grad_scaler"])

    def _check_same_base(self, checkpoint: dict[str, Any]) -> None:
        """Warn when the checkpoint was trained from another base than this run's: the KL reference
        is rebuilt from this run's ``model.model_name_or_path`` (both are the resolved paths)."""
        saved = (checkpoint.get("hyper_parameters") or {}).get("model_name_or_path")
        current = self.hparams.model_name_or_path
        if self.ref_policy is not None and saved is not None and saved != current:
            rank_zero_warn(f"model.model_name_or_path is {current!r}, but the checkpoint was trained from {saved!r}: "
                           f"the KL reference is rebuilt from {current!r}. Resume with the run's own base model")

    def export_hf(self, out_dir: str) -> str:
        """Save the policy in HF format (`save_pretrained`) with its tokenizer, for vLLM evaluation."""
        from aspo_lit.training.models import full_state_dict

        state = full_state_dict(self.policy)
        if self.trainer is None or self.trainer.is_global_zero:
            self.policy.save_pretrained(out_dir, state_dict=state)
            self.tokenizer.save_pretrained(out_dir)
        return out_dir


def _metric_name(key: str, prefix: str) -> str:
    """The logged name: a key without a ``/`` goes under ``prefix/``."""
    return key if "/" in key else f"{prefix}/{key}"


def _validate_hparams(args: dict[str, Any]) -> None:
    """Fail before any model loads, naming the key. The settings of one key only: those across the
    module and the DataModule are `aspo_lit.cli.check_config`'s."""
    for key in ("ppo_epochs", "mini_batch_size", "micro_batch_size", "logprob_chunk_size"):
        check_positive_int(f"model.{key}", args[key])
    check_positive_int("model.max_tokens_per_micro_batch", args["max_tokens_per_micro_batch"], or_null=True)
    for key, hint in (("old_logprobs", OldLogprobs), ("kl_kind", KLKind), ("torch_dtype", TorchDType)):
        check_choice(f"model.{key}", args[key], hint)
    check_weights_dtype(args["torch_dtype"])
    cap = args["rollout_is_cap"]
    if cap is not None and not cap > 0:
        raise ValueError(f"model.rollout_is_cap must be > 0 or null, got {cap!r}")
    if args["old_logprobs"] == "sampler" and cap is not None:
        raise ValueError("model.rollout_is_cap weighs each token by min(π_old / π_sampler, cap), which is 1 when "
                         "model.old_logprobs=sampler takes π_old from the sampler: set rollout_is_cap: null, or "
                         "old_logprobs: recompute")
    if args["share_prompt"] and args["gradient_checkpointing"]:
        raise ValueError("model.share_prompt needs the KV cache of the prompt pass, which transformers drops under "
                         "gradient checkpointing: set model.gradient_checkpointing: false, or model.share_prompt: false")
    for key in ("lr", "max_grad_norm", "temperature"):
        if not args[key] > 0:
            raise ValueError(f"model.{key} must be > 0, got {args[key]!r}")
    for key in ("kl_coef", "weight_decay", "warmup_steps"):
        if args[key] < 0:
            raise ValueError(f"model.{key} must be >= 0, got {args[key]!r}")
