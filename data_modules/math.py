"""RLDataModule: prompt batches in, graded group rollouts out (math; the base of the testbed and code ones).

The dataloader yields plain prompt records (cheap; nothing generated in a worker). Rollouts are
produced in `on_after_batch_transfer`, which Lightning calls for the batch about to be trained on,
after the previous optimizer step: the engine always samples with the policy's current weights
(generating inside the dataloader would be one step stale, since Lightning prefetches a batch).

What it needs of the LightningModule (its tokenizer, the policy to sample with, the device) it takes
once a run as one `aspo_lit.module.PolicyHandle` (`RLDataModule.policy_handle`).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from typing import TYPE_CHECKING, Any, Literal, Sequence

import torch
from lightning.pytorch import LightningDataModule

from aspo_lit.advantages import group_advantages
from aspo_lit.prompts import encode_prompt
from aspo_lit.rewards.math import RewardFn
from aspo_lit.rollout import RolloutBatch, RolloutEngine, SamplingConfig, build_engine, pack_rollouts
from aspo_lit.rollout.process import EngineProcess, EngineProcessError
from aspo_lit.seeding import derived_seed, run_seed
from aspo_lit.settings import check_choice, check_positive_int
from aspo_lit.stats import Stat
from data_modules.fields import math_row
from data_modules.mixture import Source, load_mixture, mixture_stats
from data_modules.sources import BadRowError, OnBadRow, PromptBatches, normalize_golds

if TYPE_CHECKING:
    from aspo_lit.module import PolicyHandle

log = logging.getLogger(__name__)

AdvNorm = Literal["std", "none"]
PromptTemplate = Literal["chat", "plain"]


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


def check_group_size(group_size: int) -> None:
    """``data.group_size`` responses per prompt: at least 2, or a group-relative advantage (eq. 1) is 0."""
    check_positive_int("data.group_size", group_size)
    if group_size < 2:
        raise ValueError(f"data.group_size must be >= 2 for group-relative advantages, got {group_size}")


class RLDataModule(LightningDataModule):
    """Prompts → G sampled responses per prompt → rewards → group advantages (eq. 1).

    Math problems as it stands; the testbed and code DataModules (`data_modules.testbed`,
    `data_modules.code`) change the rows, the prompt and the reward.

    Args:
        train_files: the training data: a list of `data_modules.mixture.Source` (hub ids or local
            files, each with its field mapping and filters; deduplicated across sources), or one
            local JSONL/JSON/parquet file or folder or HF hub id (``repo:config``). The paper's
            mixtures (§7.1) are in the shipped configs (docs/data.md); the default here is
            DeepScaleR-Preview alone.
        val_files: the same for held-out evaluation during training (``validate`` / val loop).
        problem_key, answer_key: field mapping of a plain-string source (a `Source` has its own).
        dedup: drop problems whose normalized text repeats one kept before (docs/data.md).
        batch_size: prompts per training step, over all ranks (paper: 64).
        group_size: G, responses per prompt (paper: 16).
        max_prompt_length: longer prompts are dropped, counted and logged (never truncated).
        max_response_length: max new tokens per response.
        temperature, top_p: rollout sampling (paper: 1.0, 1.0).
        val_temperature, val_k, val_batch_size, val_max_problems: held-out evaluation sampling.
        engine: ``auto``, ``hf``, ``vllm`` or a `RolloutEngine` (``class_path``).
        reward: a `RewardFn` (``class_path`` in YAML) with ``.batch(texts, golds)`` (default:
            ``MathReward()``, correct when DeepScaleR's or math-verify's verifier accepts;
            docs/grading.md).
        adv_norm: ``std`` (GRPO) or ``none`` (Dr.GRPO).
        filter_groups: drop groups whose rewards are all equal (the authors' code), decided on the
            global batch; the kept groups are shared equally over the ranks and the remainder is
            dropped and counted (``batch/filter_remainder_count``); no refill.
        overlong_buffer: DAPO soft overlong penalty buffer length in tokens (0 = off).
        overlong_penalty_factor: the penalty at the hard limit.
        prompt_template: ``chat`` (the tokenizer's chat template) or ``plain``.
        on_bad_row: ``error`` (stop, naming file and row) or ``skip`` (count and log).
        max_staleness: k, how many rollout batches the sampling policy may lag the trained one
            (docs/staleness.md). 0 (the default): every batch is sampled by the weights that train
            on it, in this process, as the paper does. k >= 1: the rollouts of the next k batches
            are generated while this one trains, by a copy of the engine in its own process
            (`aspo_lit.rollout.process.EngineProcess`), fed the weights after every rollout batch;
            batch b is sampled by the policy after batch b - k - 1 (after none for the first k + 1
            batches of a run or a resume), exactly, on every run. Validation samples in this process.
        engine_threads: the engine process's torch threads (k >= 1; null: this process's count).
        seed: shuffling and sampling seed; null (the default) takes the run's ``seed_everything``,
            so that one key seeds a run (aspo_lit/seeding.py).
    """

    def __init__(
        self,
        train_files: str | list[Source] = "agentica-org/DeepScaleR-Preview-Dataset",
        val_files: str | list[Source] | None = None,
        problem_key: str = "problem",
        answer_key: str = "answer",
        dedup: bool = True,
        batch_size: int = 64,
        group_size: int = 16,
        max_prompt_length: int = 1024,
        max_response_length: int = 8192,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        val_temperature: float = 0.8,
        val_k: int = 4,
        val_batch_size: int = 64,
        val_max_problems: int | None = None,
        engine: str | RolloutEngine = "auto",
        reward: RewardFn | None = None,
        adv_norm: AdvNorm = "std",
        filter_groups: bool = False,
        overlong_buffer: int = 0,
        overlong_penalty_factor: float = 1.0,
        prompt_template: PromptTemplate = "chat",
        on_bad_row: OnBadRow = "error",
        max_staleness: int = 0,
        engine_threads: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        _validate(locals())
        self.save_hyperparameters(ignore=["engine", "reward"])
        # the seed used (hparams keep the config's value; null = seed_everything's, in config.yaml)
        self.seed = run_seed(seed)  # LightningCLI has run seed_everything before building the classes
        self._engine_spec = engine
        # the engine process gets its own copy of the engine, as configured (before any attach)
        self._engine_blueprint = None if isinstance(engine, str) or max_staleness == 0 else pickle.dumps(engine)
        self.engine_process: EngineProcess | None = None
        self._in_flight: dict[int, list[dict[str, Any]]] = {}
        self._pushed_version = -1
        self._reward = reward
        # the sources as given (LightningCLI gives `Source` objects; `hparams` holds their config form)
        self.data_sources = {"train": train_files, "val": val_files}
        self.engine: RolloutEngine | None = None
        self.train_batches: PromptBatches | None = None
        self.stats: dict[str, float] = {}
        self._synced_step = -1
        self._policy_handle: PolicyHandle | None = None

    def setup(self, stage: str) -> None:
        prompts_per_rank(self.hparams.batch_size, self.trainer.world_size)
        refuse_staleness_on_gpus(self.hparams.max_staleness, self.trainer.accelerator)

    @property
    def policy_handle(self) -> PolicyHandle:
        """The policy this DataModule samples for, with its tokenizer, checkpoint and device.

        The one handshake with the LightningModule: taken from its ``policy_handle()`` (which
        `aspo_lit.module.ASPOModule` implements, and any module trained with this DataModule must)
        at the first prompt encoding or rollout of a run, and dropped at ``teardown`` with the engine
        it was attached to. Not in ``setup``: Lightning builds the policy in the module's
        ``configure_model``, after every ``setup`` hook. `attach_policy` hands one over without a Trainer.
        """
        if self._policy_handle is None:
            self._policy_handle = self.trainer.lightning_module.policy_handle()
        return self._policy_handle

    def attach_policy(self, handle: PolicyHandle) -> None:
        """Sample for ``handle``'s policy: a DataModule driven by hand (a benchmark, a test) instead of
        by a Trainer's LightningModule."""
        self._policy_handle = handle

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resumed run keeps its own seed (``seed_everything: true`` draws a new one each launch)."""
        seed = state_dict.get("seed")
        if seed is not None and seed != self.seed:
            log.warning("resuming a run of seed %s: its rollouts and shuffles continue from that seed, not %s",
                        seed, self.seed)
            self.seed = int(seed)

    # --- data -----------------------------------------------------------------------------

    def sources(self, spec: str | os.PathLike | Sequence[Source]) -> list[Source]:
        """The sources of a ``train_files`` / ``val_files`` value (a plain string is one source
        read with ``problem_key`` / ``answer_key``)."""
        if isinstance(spec, (str, os.PathLike)):
            hp = self.hparams
            return [Source(path=os.fspath(spec), fields={"problem": hp.problem_key, "answer": hp.answer_key})]
        sources = [s if isinstance(s, Source) else Source(**s) for s in spec]
        for source in sources:
            if source.layout != "fields":
                raise ValueError(f"source {source.tag!r}: layout {source.layout!r} is for code rows; math "
                                 "sources map their fields (layout: fields)")
        return sources

    def convert_row(self, raw: dict[str, Any], source: Source, where: str, staged: bool) -> dict[str, Any]:
        """One upstream row as ``{id, problem, answer}`` (a staged copy is already normalized)."""
        if staged:
            return math_row(raw, {}, [], None, where)
        return math_row(raw, source.fields, source.json_fields, source.template, where)

    def _load_split(self, spec, split: str) -> list[dict[str, Any]]:
        sources = self.sources(spec)
        rows, reports = load_mixture(sources, self.convert_row, self.hparams.on_bad_row, self.hparams.dedup, split)
        rows, gold_stats = self.normalize_answers(rows, split)
        self._record_data_counts({**mixture_stats(reports, split), **gold_stats})
        if not rows:
            raise BadRowError(f"data.{split}_files: no usable rows in {[s.tag for s in sources]}")
        return rows

    def normalize_answers(self, rows: list[dict[str, Any]], split: str) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Gold answers as a model writes them, as evaluation reads them (`normalize_golds`), and
        the count rewritten (``data/<split>/golds_rewritten``)."""
        rows, rewritten = normalize_golds(rows, f"data.{split}_files")
        return rows, {f"data/{split}/golds_rewritten": float(rewritten)}

    def _record_data_counts(self, stats: dict[str, float]) -> None:
        """Data counts into ``self.stats`` and, on a fresh run, into the run's loggers (step 0)."""
        self.stats.update(stats)
        trainer = self.trainer
        if trainer is not None and trainer.global_step == 0 and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(stats, step=0)

    def load_train_rows(self) -> list[dict[str, Any]]:
        """Rows `{id, problem, answer}` for training; subclasses (the testbed) override."""
        return self._load_split(self.data_sources["train"], "train")

    def load_val_rows(self) -> list[dict[str, Any]] | None:
        spec = self.data_sources["val"]
        return self._load_split(spec, "val") if spec else None

    def _encode(self, rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
        """Tokenize prompts; drop (and count) those over `max_prompt_length`."""
        kept = []
        for row in rows:
            ids = self.encode_row(row)
            if len(ids) <= self.hparams.max_prompt_length:
                kept.append(dict(row, prompt_ids=ids))
        dropped = len(rows) - len(kept)
        self._record_data_counts({f"data/{split}_prompts": float(len(kept)), f"data/{split}_dropped_long_prompts": float(dropped)})
        if dropped:
            log.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%d",
                        split, dropped, len(rows), self.hparams.max_prompt_length)
        if not kept:
            raise ValueError(f"data.max_prompt_length={self.hparams.max_prompt_length} drops every {split} prompt")
        return kept

    def encode_row(self, row: dict[str, Any]) -> list[int]:
        """Prompt token ids of a row (subclasses change the prompt, e.g. code with starter code)."""
        return encode_prompt(row["problem"], self.policy_handle.tokenizer, self.hparams.prompt_template)

    def _rank_share(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """This rank's prompts of a global batch (batch_size counts prompts over all ranks)."""
        world, rank = self.trainer.world_size, self.trainer.global_rank
        return batch[rank::world]

    def _val_share(self, batch: list[dict[str, Any]], engine: RolloutEngine) -> tuple[list, list]:
        """This rank's problems of a validation batch, and the filler prompts that pad them.

        Rank r of W takes problems r, r + W, ... of the batch (`_rank_share`), so every problem
        is decoded and counted by one rank; a colocated vLLM engine with TP > 1 gathers its group's
        shares into one call (docs/gpu.md, "Validation shards"). An engine whose ranks must step
        together (``lockstep``: the transformers engine sampling with an FSDP2-sharded policy)
        needs as many prompts on every rank: a shorter share, even an empty one, is padded with
        the batch's first problem, decoded and dropped."""
        mine = self._rank_share(batch)
        if not getattr(engine, "lockstep", False):
            return mine, []
        width = -(-len(batch) // self.trainer.world_size)
        return mine, [batch[0]] * (width - len(mine))

    def train_dataloader(self) -> PromptBatches:
        if self.train_batches is None:
            rows = self._encode(self.load_train_rows(), "train")
            self.train_batches = PromptBatches(rows, self.hparams.batch_size, seed=self.seed)
        return self.train_batches

    def val_rows(self) -> list[dict[str, Any]]:
        """The held-out problems the validation loop samples, in its order: the first
        ``val_max_problems`` rows, encoded (``prompt_ids``), those over ``max_prompt_length`` dropped.
        ``python -m aspo_lit evaluate --like_fit`` evaluates these (`aspo_lit.eval.like_fit`)."""
        rows = self.load_val_rows()
        if not rows:
            return []
        return self._encode(rows[: self.hparams.val_max_problems], "val")

    def val_dataloader(self):
        rows = self.val_rows()
        if not rows:
            return []
        return PromptBatches(rows, self.hparams.val_batch_size, shuffle=False, drop_last=False)

    # --- engine and reward ---------------------------------------------------------------------

    @property
    def engine_spec(self) -> str | RolloutEngine:
        """The ``engine`` setting as given: a name for `aspo_lit.rollout.build_engine` or an engine."""
        return self._engine_spec

    @property
    def reward(self):
        if self._reward is None:
            from aspo_lit.rewards import MathReward

            self._reward = MathReward()
        return self._reward

    def _ensure_engine(self) -> RolloutEngine:
        if self.engine is None:
            handle = self.policy_handle
            self.engine = build_engine(self._engine_spec) if isinstance(self._engine_spec, str) else self._engine_spec
            # the engine starts from the checkpoint at model_path, not from the policy the trainer
            # holds (restored by --ckpt_path, or trained before a validation): the first
            # generate always pushes (_synced_step stays -1, as TRL's _last_loaded_step)
            self.engine.attach(handle.policy, handle.tokenizer, handle.model_path)
        return self.engine

    def _sync_weights(self, engine: RolloutEngine) -> float:
        """Push the policy's weights when the optimizer step changed since the last push, or when
        the engine dropped them (a level-2 sleep). The state dict's FSDP2 shards go to the engine as
        they are: it casts each to its dtype before gathering it (`aspo_lit.rollout.base.iter_named_tensors`:
        half the bytes of the fp32 master weights for a bf16 engine)."""
        if getattr(engine, "shares_policy", False):
            return 0.0
        if self._synced_step == self.trainer.global_step and not getattr(engine, "needs_weight_push", False):
            return 0.0
        start = time.perf_counter()
        engine.update_weights(self.policy_handle.policy.state_dict())
        self._synced_step = self.trainer.global_step
        return time.perf_counter() - start

    def teardown(self, stage: str) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self._synced_step = -1
        self._close_engine_process()
        self._policy_handle = None

    def _close_engine_process(self) -> None:
        if self.engine_process is not None:
            self.engine_process.close()
            self.engine_process = None
        self._in_flight.clear()
        self._pushed_version = -1

    # --- rollouts -------------------------------------------------------------------------------

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is None or not isinstance(batch, list):
            return batch
        if self.trainer.training:
            counter = self.train_batches.mark_consumed()
            if self.hparams.max_staleness:
                return self.stale_rollout(self._rank_share(batch), counter)
            return self.rollout(self._rank_share(batch), seed=derived_seed(self.seed, counter))
        return self.evaluate(batch)

    def _generate(self, records, n: int, sampling: SamplingConfig):
        engine = self._ensure_engine()
        sync_s = self._sync_weights(engine)
        start = time.perf_counter()
        completions = engine.generate([r["prompt_ids"] for r in records], n=n, sampling=sampling)
        engine.sleep()  # vLLM with sleep mode frees its GPU memory for the update (wakes on the next push)
        return completions, sync_s, time.perf_counter() - start

    def _sampling(self, seed: int) -> SamplingConfig:
        hp = self.hparams
        return SamplingConfig(temperature=hp.temperature, top_p=hp.top_p, max_tokens=hp.max_response_length,
                              stop=hp.stop, seed=seed, logprobs=True)

    def rollout(self, records: list[dict[str, Any]], seed: int) -> RolloutBatch:
        """G samples per prompt with the current weights, graded, with group advantages."""
        completions, sync_s, rollout_s = self._generate(records, self.hparams.group_size, self._sampling(seed))
        batch, reward_s = self._grade(records, completions)
        batch.timings.update({"timing/rollout_s": rollout_s, "timing/reward_s": reward_s,
                              "timing/weight_sync_s": sync_s})
        return batch

    def _grade(self, records: list[dict[str, Any]], completions) -> tuple[RolloutBatch, float]:
        """Rewards, group advantages (eq. 1), the group filter and the packed batch of these
        completions; and the seconds the reward took."""
        hp = self.hparams
        texts = [c.text for group in completions for c in group]
        golds = [r["answer"] for r in records for _ in range(hp.group_size)]
        start = time.perf_counter()
        rewards = torch.tensor(self.reward.batch(texts, golds), dtype=torch.float32)
        lengths = torch.tensor([len(c.token_ids) for group in completions for c in group])
        rewards = rewards + self._overlong_penalty(lengths)
        reward_s = time.perf_counter() - start
        advantages, all_equal = group_advantages(rewards, hp.group_size, norm=hp.adv_norm)
        solved = rewards.view(-1, hp.group_size).max(1).values > 0
        groups = len(records)
        stats = {  # shares of this rank's groups (weighed by them over ranks) and counts (summed)
            "batch/solve_all": Stat.mean(float((all_equal & solved).float().mean()), weight=groups),
            "batch/solve_none": Stat.mean(float((all_equal & ~solved).float().mean()), weight=groups),
            "batch/filtered_groups": Stat.sum(0.0),
            "batch/filter_remainder_count": Stat.sum(0.0),
        }
        if hp.filter_groups:
            records, completions, rewards, advantages, filter_stats = self._filter_groups(
                records, completions, rewards, advantages, all_equal)
            stats.update(filter_stats)
        batch = self._pack(records, completions, rewards, advantages, torch.ones(len(records), dtype=torch.bool))
        batch.stats.update(stats)
        return batch, reward_s

    # --- bounded staleness (max_staleness >= 1; docs/staleness.md) --------------------------------

    def _ensure_engine_process(self) -> EngineProcess:
        if self.engine_process is None:
            handle = self.policy_handle
            engine = (build_engine(self._engine_spec) if self._engine_blueprint is None
                      else pickle.loads(self._engine_blueprint))
            threads = self.hparams.engine_threads or torch.get_num_threads()
            self.engine_process = EngineProcess(engine, handle.model_path, threads=threads).start()
        return self.engine_process

    def stale_rollout(self, records: list[dict[str, Any]], counter: int) -> RolloutBatch:
        """Rollout batch ``counter`` (``PromptBatches.mark_consumed``'s number) when the sampler may
        lag by k = ``max_staleness`` batches.

        The schedule: the weights after ``counter - 1`` trained batches are pushed to the engine
        process, then batches up to ``counter + k`` are requested (those not requested yet); the
        process serves one queue in order, so a batch requested after a push is sampled by exactly
        those weights. Batch ``counter`` was requested ``k`` batches ago (or now, for the first
        k + 1 of a run or a resume): its staleness, the trained batches between its sampling
        policy and the one it trains, is ``min(k, batches since the start)``. While it trains, the
        process generates the next ones. Seeds are the synchronous loop's (``derived_seed(seed,
        counter)``)."""
        hp = self.hparams
        version = counter - 1        # rollout batches trained before this one
        failure = None
        try:
            process = self._ensure_engine_process()
        except EngineProcessError as exc:
            failure = exc
        self._raise_if_any_failed(failure)   # before the push: it is a collective under FSDP2
        push_s = 0.0
        if self._pushed_version != version:
            start = time.perf_counter()
            process.push(version, self.policy_handle.policy.state_dict())
            push_s, self._pushed_version = time.perf_counter() - start, version
        for ticket in range(counter, counter + hp.max_staleness + 1):
            if ticket not in self._in_flight:
                share = records if ticket == counter else self._rank_share(self.train_batches.batch(ticket))
                process.submit(ticket, [r["prompt_ids"] for r in share], hp.group_size,
                               self._sampling(derived_seed(self.seed, ticket)))
                self._in_flight[ticket] = share
        try:
            made_by, completions, generate_s, idle_s, wait_s = process.result(counter)
        except EngineProcessError as exc:
            failure = exc
        self._raise_if_any_failed(failure)
        requested = self._in_flight.pop(counter)
        if [r["prompt_ids"] for r in requested] != [r["prompt_ids"] for r in records]:
            raise RuntimeError(f"rollout batch {counter}: the prompts requested ahead are not the loader's "
                               "(the prompt order changed under the running pipeline)")
        batch, reward_s = self._grade(records, completions)
        staleness = float(version - made_by)
        batch.stats.update({"rollout/staleness": Stat.mean(staleness), "rollout/staleness_max": Stat.max(staleness),
                            "rollout/policy_version": Stat.max(float(made_by))})
        batch.timings.update({"timing/rollout_s": generate_s, "timing/reward_s": reward_s, "timing/weight_sync_s": push_s,
                              "timing/rollout_wait_s": wait_s, "timing/engine_idle_s": idle_s})
        return batch

    def _raise_if_any_failed(self, failure: EngineProcessError | None) -> None:
        """Raise when any rank's engine process failed: every rank raises together (one collective),
        none waits alone in the next one. The batch being made is not counted as consumed, so a
        resume starts with it; the engine process is closed."""
        failed = failure is not None
        if self.trainer is not None and self.trainer.world_size > 1:
            failed = bool(self.trainer.strategy.reduce_boolean_decision(failed, all=False))
        if failed:
            self.train_batches.consumed -= 1
            self._close_engine_process()
            raise failure or EngineProcessError("the rollout engine process of another rank failed (see its log)")

    def _filter_groups(self, records, completions, rewards, advantages, all_equal):
        """Drop all-equal-reward groups of the *global* batch, then give each rank an equal share.

        Every rank gathers every rank's groups (global group g was generated by rank g % world),
        keeps those with differing rewards, and takes its slice of `kept // world` groups; the
        `kept % world` left over are dropped and counted, so all ranks run the same number of
        forward passes. When fewer groups than ranks survive, nothing is filtered (their zero
        advantages contribute no policy gradient). Counts are per generating rank (summed over
        ranks: `Stat.sum`).
        """
        G = self.hparams.group_size
        world, rank = self.trainer.world_size, self.trainer.global_rank
        local = [(rec, comp, rewards[i * G:(i + 1) * G], advantages[i * G:(i + 1) * G], bool(eq))
                 for i, (rec, comp, eq) in enumerate(zip(records, completions, all_equal.tolist()))]
        if world > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, local)
            groups = [gathered[g % world][g // world] for g in range(sum(len(x) for x in gathered))]
        else:
            groups = local
        kept = [g for g, item in enumerate(groups) if not item[4]]
        share = len(kept) // world
        stats = {"batch/filtered_groups": Stat.sum(0.0), "batch/filter_remainder_count": Stat.sum(0.0)}
        if share == 0:
            return records, completions, rewards, advantages, stats
        mine = kept[rank * share:(rank + 1) * share]
        removed = set(range(len(groups))) - set(kept)
        remainder = set(kept[share * world:])
        stats["batch/filtered_groups"] = Stat.sum(float(sum(1 for g in removed if g % world == rank)))
        stats["batch/filter_remainder_count"] = Stat.sum(float(sum(1 for g in remainder if g % world == rank)))
        picked = [groups[g] for g in mine]
        return ([p[0] for p in picked], [p[1] for p in picked], torch.cat([p[2] for p in picked]),
                torch.cat([p[3] for p in picked]), stats)

    def _overlong_penalty(self, lengths: torch.Tensor) -> torch.Tensor:
        """DAPO's soft overlong punishment, linear over the last `overlong_buffer` tokens."""
        hp = self.hparams
        if hp.overlong_buffer <= 0:
            return torch.zeros(lengths.shape, dtype=torch.float32)
        from aspo_lit.rewards import overlong_penalty

        return torch.tensor([overlong_penalty(int(n), hp.max_response_length, hp.overlong_buffer,
                                              hp.overlong_penalty_factor) for n in lengths], dtype=torch.float32)

    def _pack(self, records, completions, rewards, advantages, keep) -> RolloutBatch:
        G = self.hparams.group_size
        rows = torch.arange(len(records) * G).view(-1, G)[keep].reshape(-1)
        kept_records = [r for r, k in zip(records, keep.tolist()) if k]
        kept_completions = [c for c, k in zip(completions, keep.tolist()) if k]
        handle = self.policy_handle
        packed = pack_rollouts([r["prompt_ids"] for r in kept_records], kept_completions, handle.tokenizer.pad_token_id)
        flat = [c for group in kept_completions for c in group]
        return RolloutBatch(
            input_ids=packed["input_ids"],
            attention_mask=packed["attention_mask"],
            response_mask=packed["response_mask"],
            prompt_length=packed["prompt_length"],
            rewards=rewards[rows],
            advantages=advantages[rows],
            group_size=G,
            texts=[c.text for c in flat],
            prompts=[r["problem"] for r in kept_records for _ in range(G)],
            answers=[r["answer"] for r in kept_records for _ in range(G)],
            finish_reasons=[c.finish_reason for c in flat],
            response_lengths=packed["response_lengths"],
            stats={},
            timings={},
            rollout_logprobs=packed["engine_logprobs"],
            top_p=float(self.hparams.top_p),
        ).to(handle.device)

    def val_sampling(self, rank: int = 0) -> SamplingConfig:
        """The validation loop's sampling: ``val_temperature``, no nucleus cut (top_p 1.0), the
        rollouts' ``max_response_length`` and ``stop``, and every call (rank `rank`'s share of one
        batch of ``val_batch_size`` problems x ``val_k`` samples) seeded with `val_seed`."""
        hp = self.hparams
        return SamplingConfig(temperature=hp.val_temperature, top_p=1.0, max_tokens=hp.max_response_length,
                              stop=hp.stop, seed=self.val_seed(rank))

    def val_seed(self, rank: int = 0) -> int:
        """The seed of rank `rank`'s validation calls: the run's seed itself on rank 0 (one process
        samples as it always did), ``derived_seed(seed, rank)`` on the others, so that no two
        ranks draw the same stream (docs/gpu.md, "Validation shards")."""
        return self.seed if rank == 0 else derived_seed(self.seed, rank)

    def evaluate(self, records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """K samples per held-out prompt of this rank's share (`_val_share`) at the evaluation
        temperature, graded: correctness [P, K], P this rank's problems (0 when it has none)."""
        hp = self.hparams
        mine, filler = self._val_share(records, self._ensure_engine())
        sampling = self.val_sampling(self.trainer.global_rank)
        completions, _, _ = self._generate(mine + filler, hp.val_k, sampling)
        texts = [c.text for group in completions[:len(mine)] for c in group]
        golds = [r["answer"] for r in mine for _ in range(hp.val_k)]
        correct = torch.tensor(self.reward.batch(texts, golds) if texts else [], dtype=torch.float32) > 0.5
        return {"correct": correct.view(len(mine), hp.val_k)}


def _validate(args: dict[str, Any]) -> None:
    """Invalid settings fail before any model loads, naming the key."""
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


#: The name of `RLDataModule` before the testbed and code DataModules were built on it; configs
#: written with ``class_path: data_modules.math.MathRLDataModule`` load the same class.
MathRLDataModule = RLDataModule
