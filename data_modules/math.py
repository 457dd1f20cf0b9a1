"""RLDataModule: prompt batches in, graded group rollouts out (math; the base of the testbed and code ones).

The dataloader yields plain prompt records (cheap; nothing generated in a worker). Rollouts are
produced in `on_after_batch_transfer`, which Lightning calls for the batch about to be trained on,
after the previous optimizer step: the engine always samples with the policy's current weights
(generating inside the dataloader would be one step stale, since Lightning prefetches a batch).

What varies between math, code and the testbeds is a `aspo_lit.tasks.base.Task`; the rollouts are
a `aspo_lit.rollout_stage.controller.RolloutController`'s; this module is the Lightning glue.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningDataModule

from aspo_lit.data.mixture import Source
from aspo_lit.data.sources import OnBadRow, PromptBatches
from aspo_lit.maths.seeding import derived_seed, run_seed
from aspo_lit.rewards.math import RewardFn
from aspo_lit.rollout.base import RolloutEngine
from aspo_lit.rollout.process import EngineProcessError
from aspo_lit.rollout_stage.controller import RolloutController, rank_share
from aspo_lit.rollout_stage.ranks import TrainerRanks
from aspo_lit.rollout_stage.settings import (
    AdvNorm,
    PromptTemplate,
    RolloutSettings,
    check_data_settings,
    prompts_per_rank,
    refuse_staleness_on_gpus,
)
from aspo_lit.tasks.base import Task
from aspo_lit.tasks.math import MathTask

if TYPE_CHECKING:
    from aspo_lit.training.module import PolicyHandle

log = logging.getLogger(__name__)

class RLDataModule(LightningDataModule):
    """Prompts → G sampled responses per prompt → rewards → group advantages (eq. 1).

    Lightning's side of the rollout stage: the loaders (`PromptBatches`), the run's seed as
    checkpoint state, the handshake with the LightningModule (`policy_handle`), and the hooks that
    hand each batch to the `RolloutController` (rollouts) and the `Task` (rows, prompt, reward).
    Math problems (`MathTask`); the testbed and code DataModules (`data_modules.testbed`,
    `data_modules.code`) build another task in `build_task`.

    Args:
        train_files: the training data: a list of `aspo_lit.data.mixture.Source` (hub ids or local
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
            so that one key seeds a run (aspo_lit/maths/seeding.py).
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
        check_data_settings(locals())
        self.save_hyperparameters(ignore=["engine", "reward"])
        self._reward = reward
        # the sources as given (LightningCLI gives `Source` objects; `hparams` holds their config form)
        self.data_sources = {"train": train_files, "val": val_files}
        self.train_batches: PromptBatches | None = None
        self._task: Task | None = None
        self._policy_handle: PolicyHandle | None = None
        hp = self.hparams
        settings = RolloutSettings(**{key: hp[key] for key in RolloutSettings.__dataclass_fields__})
        # the seed used (hparams keep the config's value; null = seed_everything's, in config.yaml);
        # LightningCLI has run seed_everything before building the classes
        self.controller = RolloutController(settings, engine, grader=self._grader, policy=self._policy,
                                            seed=run_seed(seed))

    def _grader(self):
        return self.task.reward

    def _policy(self) -> PolicyHandle:
        return self.policy_handle

    def build_task(self) -> Task:
        """The rows, prompt and reward of this DataModule's problems (a subclass builds its own)."""
        hp = self.hparams
        return MathTask(self.data_sources["train"], self.data_sources["val"], hp.problem_key, hp.answer_key,
                        hp.dedup, hp.on_bad_row, hp.prompt_template, self._reward)

    @property
    def task(self) -> Task:
        """The task, built when first asked for (a subclass's settings are in ``hparams`` by then)."""
        if self._task is None:
            self._task = self.build_task()
            self._task.on_stats = self._log_data_counts
        return self._task

    @property
    def seed(self) -> int:
        return self.controller.seed

    def setup(self, stage: str) -> None:
        prompts_per_rank(self.hparams.batch_size, self.trainer.world_size)
        refuse_staleness_on_gpus(self.hparams.max_staleness, self.trainer.accelerator)
        self.controller.ranks = TrainerRanks(self.trainer)
        if stage == "fit":
            self.task.check_ready()

    @property
    def policy_handle(self) -> PolicyHandle:
        """The policy this DataModule samples for, with its tokenizer, checkpoint and device.

        The one handshake with the LightningModule: taken from its ``policy_handle()`` (which
        `aspo_lit.training.module.ASPOModule` implements, and any module trained with this DataModule must)
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
            self.controller.seed = int(seed)

    @property
    def stats(self) -> dict[str, float]:
        """The data counts so far (``data/...``: the task's)."""
        return self.task.stats

    def _log_data_counts(self, stats: dict[str, float]) -> None:
        """Data counts, on a fresh run, into the run's loggers (step 0)."""
        trainer = self.trainer
        if trainer is not None and trainer.global_step == 0 and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(stats, step=0)

    def train_dataloader(self) -> PromptBatches:
        if self.train_batches is None:
            rows = self.task.encode(self.task.rows("train"), "train", self.policy_handle.tokenizer,
                                    self.hparams.max_prompt_length)
            self.train_batches = PromptBatches(rows, self.hparams.batch_size, seed=self.seed)
        return self.train_batches

    def val_rows(self) -> list[dict[str, Any]]:
        """The held-out problems the validation loop samples, in its order: the first
        ``val_max_problems`` rows, encoded (``prompt_ids``), those over ``max_prompt_length`` dropped.
        ``python -m aspo_lit evaluate --like_fit`` evaluates these (`aspo_lit.eval.like_fit`)."""
        rows = self.task.rows("val")
        if not rows:
            return []
        return self.task.encode(rows[: self.hparams.val_max_problems], "val", self.policy_handle.tokenizer,
                                self.hparams.max_prompt_length)

    def val_dataloader(self):
        rows = self.val_rows()
        if not rows:
            return []
        return PromptBatches(rows, self.hparams.val_batch_size, shuffle=False, drop_last=False)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is None or not isinstance(batch, list):
            return batch
        if not self.trainer.training:
            return self.controller.evaluate(batch)
        counter = self.train_batches.mark_consumed()
        ranks = self.controller.ranks
        if not self.hparams.max_staleness:
            return self.controller.rollout(rank_share(batch, ranks), seed=derived_seed(self.seed, counter))
        try:
            return self.controller.stale_rollout(rank_share(batch, ranks), counter,
                                                 lambda ticket: rank_share(self.train_batches.batch(ticket), ranks))
        except EngineProcessError:   # not consumed: a resume starts with this batch
            self.train_batches.consumed -= 1
            raise

    def teardown(self, stage: str) -> None:
        self.controller.close()
        if self._task is not None:
            self._task.close()
        self._policy_handle = None
