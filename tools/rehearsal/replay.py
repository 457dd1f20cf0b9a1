"""ReplayRollouts: train one process on the rollout batches a multi-process run recorded.

The rehearsal's reference run: the same module and config, one process, fed the *global* batch
the ranks of the recorded run trained on. Rank r's j-th mini-batch is its rows
`[j*R, (j+1)*R)` (`aspo_lit.maths.update_plan.minibatch_rows`), so the global batch is laid out mini-batch
by mini-batch, rank by rank: the 1-process run's j-th mini-batch is then exactly the union of
the ranks' j-th mini-batches. Prompts are re-left-padded and responses re-right-padded to the
widest rank.
"""

from __future__ import annotations

from pathlib import Path

import torch

from aspo_lit.maths.update_plan import rows_per_minibatch
from aspo_lit.rollout.batch import RolloutBatch
from data_modules.math import RLDataModule


def _rows(fields: dict, rows: list[int], prompt_width: int, response_width: int, pad: int) -> dict:
    P = fields["prompt_length"]
    T = fields["input_ids"].shape[1] - P
    out = {}
    for key in ("input_ids", "attention_mask"):
        x = fields[key][rows]
        fill = pad if key == "input_ids" else 0
        left = torch.full((len(rows), prompt_width - P), fill, dtype=x.dtype)
        right = torch.full((len(rows), response_width - T), fill, dtype=x.dtype)
        out[key] = torch.cat([left, x[:, :P], x[:, P:], right], 1)
    for key in ("response_mask", "rollout_logprobs"):
        if fields.get(key) is not None:
            x = fields[key][rows]
            out[key] = torch.cat([x, torch.zeros(len(rows), response_width - T, dtype=x.dtype)], 1)
    for key in ("rewards", "advantages", "response_lengths"):
        out[key] = fields[key][rows]
    for key in ("texts", "prompts", "answers", "finish_reasons"):
        out[key] = [fields[key][i] for i in rows]
    return out


def merge_rank_batches(shares: list[dict], mini_batch_size: int, pad: int) -> RolloutBatch:
    """The global rollout batch of `shares` (rank order), laid out mini-batch by mini-batch."""
    world = len(shares)
    G = shares[0]["group_size"]
    R = rows_per_minibatch(mini_batch_size, G, world)
    n = shares[0]["input_ids"].shape[0]
    if any(s["input_ids"].shape[0] != n for s in shares):
        raise ValueError("ranks trained on different numbers of rows")
    P = max(s["prompt_length"] for s in shares)
    T = max(s["input_ids"].shape[1] - s["prompt_length"] for s in shares)
    parts = []
    for start in range(0, n, R):
        for share in shares:
            parts.append(_rows(share, list(range(start, min(start + R, n))), P, T, pad))
    merged = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        merged[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else sum(values, [])
    return RolloutBatch(prompt_length=P, group_size=G, stats=dict(shares[0].get("stats") or {}),
                        timings={}, **merged)


class _Indices:
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class ReplayRollouts(RLDataModule):
    """Feeds the recorded rollout batches of `rollout_dir` (`step*_rank*.pt`) to one process.

    A `RLDataModule` only so that the shipped config's data arguments (and the temperature
    link to the module) still apply; nothing is generated.
    """

    def __init__(self, rollout_dir: str, world_size: int, mini_batch_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dir = Path(rollout_dir)
        self.world_size = world_size
        self.mini_batch_size = mini_batch_size
        self.steps = sorted({p.name.split("_")[0] for p in self.dir.glob("step*_rank0.pt")})
        if not self.steps:
            raise FileNotFoundError(f"no recorded rollouts in {self.dir}")

    def train_dataloader(self):
        return _Indices(len(self.steps))  # not a DataLoader: Lightning would shuffle it (DistributedSampler)

    def val_dataloader(self):
        return []

    def on_after_batch_transfer(self, batch, dataloader_idx):
        step = self.steps[int(batch)]
        shares = [torch.load(self.dir / f"{step}_rank{r}.pt", weights_only=False) for r in range(self.world_size)]
        module = self.trainer.lightning_module
        return merge_rank_batches(shares, self.mini_batch_size, module.tokenizer.pad_token_id).to(module.device)
