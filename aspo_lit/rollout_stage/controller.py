"""The rollout stage: prompt records in, graded group rollouts out (the paper's §2 sampling and eq. 1).

`RolloutController` owns the engine's lifecycle, the weight push, the two schedules (synchronous,
and bounded staleness with an engine process, docs/staleness.md), grading, the group filter, the
overlong penalty, packing, and the validation loop's sampling. It needs a policy (`PolicyHandle`,
asked for when first needed), a grader with ``.batch(texts, golds)`` and the ranks it runs on
(`aspo_lit.rollout_stage.ranks.RankContext`): no Trainer, so a benchmark, a test or an offline
evaluation drives it as a fit's DataModule does.
"""

from __future__ import annotations

import pickle
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from aspo_lit.maths.advantages import group_advantages
from aspo_lit.maths.seeding import derived_seed
from aspo_lit.maths.stats import Stat
from aspo_lit.rewards.shaping import overlong_penalty
from aspo_lit.rollout.base import RolloutEngine, SamplingConfig
from aspo_lit.rollout.batch import RolloutBatch, pack_rollouts
from aspo_lit.rollout.process import EngineProcess, EngineProcessError
from aspo_lit.rollout.registry import build_engine
from aspo_lit.rollout_stage.ranks import RankContext
from aspo_lit.rollout_stage.settings import RolloutSettings

if TYPE_CHECKING:
    from aspo_lit.training.module import PolicyHandle


def rank_share(batch: list[Any], ranks: RankContext) -> list[Any]:
    """This rank's prompts of a global batch: rank r of W takes r, r + W, ..."""
    return batch[ranks.rank::ranks.world_size]


def val_seed(seed: int, rank: int = 0) -> int:
    """The seed of rank `rank`'s validation calls: the run's seed itself on rank 0 (one process
    samples as it always did), ``derived_seed(seed, rank)`` on the others, so that no two ranks draw
    the same stream (docs/gpu.md, "Validation shards")."""
    return seed if rank == 0 else derived_seed(seed, rank)


class RolloutController:
    """Samples G responses per prompt with the policy's current weights, grades them, and packs
    the group advantages (eq. 1) into a `RolloutBatch`.

    Args:
        settings: the sampling and grading settings.
        engine: ``auto``, ``hf``, ``vllm`` (`aspo_lit.rollout.build_engine`) or a `RolloutEngine`.
        grader: returns the reward (``.batch(texts, golds) -> list[float]``), asked when first needed.
        policy: returns the `PolicyHandle` to sample for, asked when first needed.
        seed: the run's seed: rollout batch c samples with ``derived_seed(seed, c)``.
        ranks: the ranks it runs on (default: one process).
    """

    def __init__(self, settings: RolloutSettings, engine: str | RolloutEngine, grader: Callable[[], Any],
                 policy: Callable[[], PolicyHandle], seed: int, ranks: RankContext | None = None) -> None:
        self.settings = settings
        self.engine_spec = engine
        self.grader = grader
        self.policy = policy
        self.seed = seed
        self.ranks = ranks or RankContext()
        # the engine process gets its own copy of the engine, as configured (before any attach)
        self._engine_blueprint = (None if isinstance(engine, str) or settings.max_staleness == 0
                                  else pickle.dumps(engine))
        self.engine: RolloutEngine | None = None
        self.engine_process: EngineProcess | None = None
        self._in_flight: dict[int, list[dict[str, Any]]] = {}
        self._pushed_version = -1
        self._synced_step = -1

    # --- engine ------------------------------------------------------------------------------------

    def ensure_engine(self) -> RolloutEngine:
        """The in-process engine, built and attached to the policy's checkpoint on first use."""
        if self.engine is None:
            handle = self.policy()
            self.engine = build_engine(self.engine_spec) if isinstance(self.engine_spec, str) else self.engine_spec
            # the engine starts from the checkpoint at model_path, not from the policy the trainer
            # holds (restored by --ckpt_path, or trained before a validation): the first
            # generate always pushes (_synced_step stays -1, as TRL's _last_loaded_step)
            self.engine.attach(handle.policy, handle.tokenizer, handle.model_path)
        return self.engine

    def sync_weights(self, engine: RolloutEngine) -> float:
        """Push the policy's weights when the optimizer step changed since the last push, or when
        the engine dropped them (a level-2 sleep); the seconds it took. The state dict's FSDP2 shards
        go to the engine as they are: it casts each to its dtype before gathering it
        (`aspo_lit.rollout.base.iter_named_tensors`: half the bytes of fp32 weights for a bf16 engine)."""
        if getattr(engine, "shares_policy", False):
            return 0.0
        if self._synced_step == self.ranks.step() and not getattr(engine, "needs_weight_push", False):
            return 0.0
        start = time.perf_counter()
        engine.update_weights(self.policy().policy.state_dict())
        self._synced_step = self.ranks.step()
        return time.perf_counter() - start

    def close(self) -> None:
        """Close the engine and the engine process; the next rollout builds them again."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self._synced_step = -1
        self.close_engine_process()

    def close_engine_process(self) -> None:
        if self.engine_process is not None:
            self.engine_process.close()
            self.engine_process = None
        self._in_flight.clear()
        self._pushed_version = -1

    # --- the synchronous schedule ------------------------------------------------------------------

    def _generate(self, records, n: int, sampling: SamplingConfig) -> tuple[list, dict[str, float]]:
        """The completions, and the seconds of each engine phase: ``timing/weight_sync_s`` (the
        push), ``timing/rollout_s`` (generation); with an engine that sleeps, waking (the weights
        before the push, the KV cache before generation) and the sleep after it apart, as
        ``timing/engine_wake_s`` and ``timing/engine_sleep_s``."""
        engine = self.ensure_engine()
        woken = getattr(engine, "take_wake_seconds", lambda: 0.0)   # optional, as `RolloutEngine`'s
        woken()   # a wake outside a rollout is not this rollout's
        push_s = self.sync_weights(engine)
        wake_push = woken()
        start = time.perf_counter()
        completions = engine.generate([r["prompt_ids"] for r in records], n=n, sampling=sampling)
        generate_s = time.perf_counter() - start
        wake_generate = woken()
        start = time.perf_counter()
        engine.sleep()  # vLLM with sleep mode frees its GPU memory for the update (wakes on the next push)
        sleep_s = time.perf_counter() - start
        if not getattr(engine, "sleeps", False):
            return completions, {"timing/weight_sync_s": push_s, "timing/rollout_s": generate_s + sleep_s}
        return completions, {"timing/weight_sync_s": push_s - wake_push, "timing/rollout_s": generate_s - wake_generate,
                             "timing/engine_wake_s": wake_push + wake_generate, "timing/engine_sleep_s": sleep_s}

    def rollout(self, records: list[dict[str, Any]], seed: int) -> RolloutBatch:
        """G samples per prompt of `records` (this rank's) with the current weights, graded."""
        s = self.settings
        completions, timings = self._generate(records, s.group_size, s.sampling(seed))
        batch, reward_s = self.grade(records, completions)
        batch.timings.update({**timings, "timing/reward_s": reward_s})
        return batch

    def grade(self, records: list[dict[str, Any]], completions) -> tuple[RolloutBatch, float]:
        """Rewards, group advantages (eq. 1), the group filter and the packed batch of these
        completions; and the seconds the reward took."""
        s = self.settings
        texts = [c.text for group in completions for c in group]
        golds = [r["answer"] for r in records for _ in range(s.group_size)]
        start = time.perf_counter()
        grader = self.grader()
        rewards = torch.tensor(grader.batch(texts, golds), dtype=torch.float32)
        bad = ~torch.isfinite(rewards)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"{type(grader).__name__} gave a reward of {float(rewards[i])} to sample {i % s.group_size} "
                             f"of prompt id {records[i // s.group_size].get('id')!r} (of {int(bad.sum())} "
                             f"non-finite in this batch): a reward must be a finite number; response starts "
                             f"{texts[i][:80]!r}")
        lengths = torch.tensor([len(c.token_ids) for group in completions for c in group])
        rewards = rewards + self.overlong_penalty(lengths)
        reward_s = time.perf_counter() - start
        advantages, all_equal = group_advantages(rewards, s.group_size, norm=s.adv_norm)
        solved = rewards.view(-1, s.group_size).max(1).values > 0
        groups = len(records)
        stats = {  # shares of this rank's groups (weighed by them over ranks) and counts (summed)
            "batch/solve_all": Stat.mean(float((all_equal & solved).float().mean()), weight=groups),
            "batch/solve_none": Stat.mean(float((all_equal & ~solved).float().mean()), weight=groups),
            "batch/filtered_groups": Stat.sum(0.0),
            "batch/filter_remainder_count": Stat.sum(0.0),
        }
        if s.filter_groups:
            records, completions, rewards, advantages, filter_stats = self.filter_groups(
                records, completions, rewards, advantages, all_equal)
            stats.update(filter_stats)
        batch = self.pack(records, completions, rewards, advantages)
        batch.stats.update(stats)
        return batch, reward_s

    # --- bounded staleness (max_staleness >= 1; docs/staleness.md) --------------------------------

    def _ensure_engine_process(self) -> EngineProcess:
        if self.engine_process is None:
            handle = self.policy()
            engine = (build_engine(self.engine_spec) if self._engine_blueprint is None
                      else pickle.loads(self._engine_blueprint))
            threads = self.settings.engine_threads or torch.get_num_threads()
            self.engine_process = EngineProcess(engine, handle.model_path, threads=threads).start()
        return self.engine_process

    def stale_rollout(self, records: list[dict[str, Any]], counter: int,
                      upcoming: Callable[[int], list[dict[str, Any]]]) -> RolloutBatch:
        """Rollout batch ``counter`` (``PromptBatches.mark_consumed``'s number) when the sampler may
        lag by k = ``max_staleness`` batches; ``upcoming(c)`` is this rank's share of batch c.

        The schedule: the weights after ``counter - 1`` trained batches are pushed to the engine
        process, then batches up to ``counter + k`` are requested (those not requested yet); the
        process serves one queue in order, so a batch requested after a push is sampled by exactly
        those weights. Batch ``counter`` was requested ``k`` batches ago (or now, for the first
        k + 1 of a run or a resume): its staleness, the trained batches between its sampling
        policy and the one it trains, is ``min(k, batches since the start)``. While it trains, the
        process generates the next ones. Seeds are the synchronous loop's (``derived_seed(seed,
        counter)``). Raises `EngineProcessError` on every rank when any rank's process failed."""
        s = self.settings
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
            process.push(version, self.policy().policy.state_dict())
            push_s, self._pushed_version = time.perf_counter() - start, version
        for ticket in range(counter, counter + s.max_staleness + 1):
            if ticket not in self._in_flight:
                share = records if ticket == counter else upcoming(ticket)
                process.submit(ticket, [r["prompt_ids"] for r in share], s.group_size,
                               s.sampling(derived_seed(self.seed, ticket)))
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
        batch, reward_s = self.grade(records, completions)
        staleness = float(version - made_by)
        batch.stats.update({"rollout/staleness": Stat.mean(staleness), "rollout/staleness_max": Stat.max(staleness),
                            "rollout/policy_version": Stat.max(float(made_by))})
        batch.timings.update({"timing/rollout_s": generate_s, "timing/reward_s": reward_s, "timing/weight_sync_s": push_s,
                              "timing/rollout_wait_s": wait_s, "timing/engine_idle_s": idle_s})
        return batch

    def _raise_if_any_failed(self, failure: EngineProcessError | None) -> None:
        """Raise when any rank's engine process failed: every rank raises together (one collective),
        none waits alone in the next one; the engine process is closed."""
        if self.ranks.any(failure is not None):
            self.close_engine_process()
            raise failure or EngineProcessError("the rollout engine process of another rank failed (see its log)")

    # --- filter, overlong penalty and packing -------------------------------------------------------

    def filter_groups(self, records, completions, rewards, advantages, all_equal):
        """Drop all-equal-reward groups of the *global* batch, then give each rank an equal share.

        Every rank gathers every rank's groups (global group g was generated by rank g % world),
        keeps those with differing rewards, and takes its slice of `kept // world` groups; the
        `kept % world` left over are dropped and counted, so all ranks run the same number of
        forward passes. When fewer groups than ranks survive, nothing is filtered (their zero
        advantages contribute no policy gradient). Counts are per generating rank (summed over
        ranks: `Stat.sum`).
        """
        G = self.settings.group_size
        world, rank = self.ranks.world_size, self.ranks.rank
        local = [(rec, comp, rewards[i * G:(i + 1) * G], advantages[i * G:(i + 1) * G], bool(eq))
                 for i, (rec, comp, eq) in enumerate(zip(records, completions, all_equal.tolist()))]
        gathered = self.ranks.all_gather(local)
        groups = [gathered[g % world][g // world] for g in range(sum(len(x) for x in gathered))]
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

    def overlong_penalty(self, lengths: torch.Tensor) -> torch.Tensor:
        """DAPO's soft overlong punishment, linear over the last `overlong_buffer` tokens."""
        s = self.settings
        if s.overlong_buffer <= 0:
            return torch.zeros(lengths.shape, dtype=torch.float32)
        return torch.tensor([overlong_penalty(int(n), s.max_response_length, s.overlong_buffer,
                                              s.overlong_penalty_factor) for n in lengths], dtype=torch.float32)

    def pack(self, records, completions, rewards, advantages) -> RolloutBatch:
        """One `RolloutBatch` of these groups on the policy's device."""
        G = self.settings.group_size
        flat = [c for group in completions for c in group]
        handle = self.policy()
        packed = pack_rollouts([r["prompt_ids"] for r in records], completions, handle.tokenizer.pad_token_id)
        return RolloutBatch(
            input_ids=packed["input_ids"],
            attention_mask=packed["attention_mask"],
            response_mask=packed["response_mask"],
            prompt_length=packed["prompt_length"],
            rewards=rewards,
            advantages=advantages,
            group_size=G,
            texts=[c.text for c in flat],
            prompts=[r["problem"] for r in records for _ in range(G)],
            answers=[r["answer"] for r in records for _ in range(G)],
            finish_reasons=[c.finish_reason for c in flat],
            response_lengths=packed["response_lengths"],
            stats={},
            timings={},
            rollout_logprobs=packed["engine_logprobs"],
            top_p=float(self.settings.top_p),
        ).to(handle.device)

    # --- validation --------------------------------------------------------------------------------

    def val_sampling(self, rank: int = 0) -> SamplingConfig:
        """Rank `rank`'s validation sampling (`RolloutSettings.val_sampling`), every call (its share
        of one batch of ``val_batch_size`` problems x ``val_k`` samples) seeded with `val_seed`."""
        return self.settings.val_sampling(val_seed(self.seed, rank))

    def val_share(self, batch: list[dict[str, Any]], engine: RolloutEngine) -> tuple[list, list]:
        """This rank's problems of a validation batch, and the filler prompts that pad them.

        Rank r of W takes problems r, r + W, ... of the batch (`rank_share`), so every problem is
        decoded and counted by one rank; a colocated vLLM engine with TP > 1 gathers its group's
        shares into one call (docs/gpu.md, "Validation shards"). An engine whose ranks must step
        together (``lockstep``: the transformers engine sampling with an FSDP2-sharded policy)
        needs as many prompts on every rank: a shorter share, even an empty one, is padded with
        the batch's first problem, decoded and dropped."""
        mine = rank_share(batch, self.ranks)
        if not getattr(engine, "lockstep", False):
            return mine, []
        width = -(-len(batch) // self.ranks.world_size)
        return mine, [batch[0]] * (width - len(mine))

    def evaluate(self, records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """K samples per held-out prompt of this rank's share (`val_share`) at the evaluation
        temperature, graded: correctness [P, K], P this rank's problems (0 when it has none)."""
        k = self.settings.val_k
        mine, filler = self.val_share(records, self.ensure_engine())
        completions, _ = self._generate(mine + filler, k, self.val_sampling(self.ranks.rank))
        texts = [c.text for group in completions[:len(mine)] for c in group]
        golds = [r["answer"] for r in mine for _ in range(k)]
        correct = torch.tensor(self.grader().batch(texts, golds) if texts else [], dtype=torch.float32) > 0.5
        return {"correct": correct.view(len(mine), k)}
