"""Peak host RSS per rank of building the policy and the reference under FSDP2 on 2 CPU processes.

    python -m tools.perf.bench_load_memory                  # a 151M-parameter llama (~600 MB in fp32)
    python -m tools.perf.bench_load_memory --layers 4       # smaller

Writes a random-init llama checkpoint (fp32) once to `.cache/aspo_lit/bench_load_memory/`, then runs
`ASPOModule.configure_model` under `FSDP2Strategy(param_dtype="bfloat16")` on 2 CPU processes
(Lightning's launcher) and stops before the first batch. Prints, per rank, the process's peak RSS
before the models were built and after, and their difference, beside the model's fp32 size, so the
per-rank cost of loading can be read off: every rank reading the checkpoint costs about
2 x fp32 size per rank (policy and reference); rank 0 alone reading it costs rank 0 about
1.5 x (fp32 policy + bf16 reference) and the other ranks only their shards.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_checkpoint(folder: Path, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.char_tokenizer import build_char_tokenizer

    if (folder / "config.json").is_file():
        return folder
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the per-rank figures as JSON here")
    args = parser.parse_args()
    folder = build_checkpoint(REPO / ".cache" / "aspo_lit" / f"bench_load_memory_l{args.layers}", args.layers)

    from lightning.pytorch import Callback, Trainer

    from aspo_lit.training.module import ASPOModule
    from aspo_lit.training.strategy import FSDP2Strategy

    class Measure(Callback):
        def on_train_start(self, trainer, pl_module):
            record = {"rank": trainer.global_rank, "before_models_mib": before, "after_models_mib": _peak_rss_mib()}
            gathered = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, record)
            if trainer.is_global_zero:
                params = sum(p.numel() for p in pl_module.policy.parameters())  # global shapes of the shards
                fp32_mib = params * 4 / 2**20
                print(f"model: {params / 1e6:.0f}M parameters, {fp32_mib:.0f} MiB in fp32")
                print("| rank | peak RSS before models (MiB) | after (MiB) | models' cost (MiB) | x fp32 size |")
                print("|---|---|---|---|---|")
                for r in gathered:
                    cost = r["after_models_mib"] - r["before_models_mib"]
                    print(f"| {r['rank']} | {r['before_models_mib']:.0f} | {r['after_models_mib']:.0f} | {cost:.0f} | "
                          f"{cost / fp32_mib:.2f} |")
                if args.out:
                    Path(args.out).write_text(json.dumps({"fp32_mib": fp32_mib, "ranks": gathered}, indent=1))
            trainer.should_stop = True

    from tools.fixed_rollouts import FixedRollouts

    module = ASPOModule(model_name_or_path=str(folder), kl_coef=0.001, mini_batch_size=8, micro_batch_size=2)
    before = _peak_rss_mib()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(param_dtype="bfloat16"), max_steps=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Measure()], num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, datamodule=FixedRollouts(steps=1))


if __name__ == "__main__":
    main()
