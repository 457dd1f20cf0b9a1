"""Fixed synthetic rollout batches as a LightningDataModule: the same batches on every rank, each
rank taking its share of the step's groups, and graded validation rollouts split unevenly over 2
ranks. The sharded and fp16 fit tests train on them (tests/multiproc/sharded_fit.py,
tests/multiproc/fp16_fit.py, tests/multiproc/sharded_resume.py), and so does
tools/perf/bench_load_memory.py."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from aspo_lit.maths.advantages import group_advantages
from aspo_lit.rollout.batch import RolloutBatch

GROUPS, G, P, T = 8, 4, 6, 10
VAL_K = 4


def fixed_rollout(step: int, vocab: int, pad: int) -> RolloutBatch:
    """A deterministic synthetic rollout batch: random prompts/responses, varied lengths, 0/1 rewards."""
    gen = torch.Generator().manual_seed(1000 + step)
    n = GROUPS * G
    prompt = torch.randint(4, vocab, (GROUPS, P), generator=gen).repeat_interleave(G, 0)
    response = torch.randint(4, vocab, (n, T), generator=gen)
    lengths = torch.randint(3, T + 1, (n,), generator=gen)
    response_mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    response = torch.where(response_mask.bool(), response, torch.full_like(response, pad))
    input_ids = torch.cat([prompt, response], 1)
    attention_mask = torch.cat([torch.ones(n, P, dtype=torch.long), response_mask.long()], 1)
    rewards = (torch.rand(n, generator=gen) > 0.5).float()
    advantages, _ = group_advantages(rewards, G)
    return RolloutBatch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                        prompt_length=P, rewards=rewards, advantages=advantages, group_size=G,
                        texts=[""] * n, prompts=[""] * n, answers=[""] * n, finish_reasons=["stop"] * n,
                        response_lengths=lengths)


def rank_share(batch: RolloutBatch, rank: int, world: int) -> RolloutBatch:
    groups = torch.arange(GROUPS)[rank::world]
    rows = (groups[:, None] * G + torch.arange(G)[None, :]).reshape(-1)
    fields = {}
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            fields[name] = value[rows]
        elif isinstance(value, list):
            fields[name] = [value[i] for i in rows.tolist()]
        else:
            fields[name] = value
    return RolloutBatch(**fields)


def val_correct() -> torch.Tensor:
    """Graded validation rollouts, correctness [8 problems, VAL_K]: the later problems are easier."""
    gen = torch.Generator().manual_seed(7)
    return torch.rand(8, VAL_K, generator=gen) < torch.linspace(0.1, 0.9, 8)[:, None]


class FixedRollouts(LightningDataModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def train_dataloader(self):
        # a DataLoader (Lightning would read a plain list of lists as one loader per inner list),
        # the same steps on every rank (the Trainer adds no distributed sampler: each rank takes its
        # share of the step's rollout batch in on_after_batch_transfer)
        return DataLoader(range(self.steps), batch_size=1)

    def val_dataloader(self):
        return [["val"]]

    def on_after_batch_transfer(self, batch, dataloader_idx):
        rank, world = self.trainer.global_rank, self.trainer.world_size
        if not self.trainer.training:  # validation: unequal shares, 3 problems on rank 0 and 5 on rank 1
            correct = val_correct()
            return {"correct": correct if world == 1 else (correct[:3], correct[3:])[rank]}
        module = self.trainer.lightning_module
        full = fixed_rollout(int(batch[0]), module.policy.config.vocab_size, module.tokenizer.pad_token_id)
        return rank_share(full, rank, world)
