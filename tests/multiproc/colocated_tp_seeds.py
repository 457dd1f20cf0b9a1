"""2 ranks under torch.distributed.run, one colocated VLLMEngine with tensor_parallel_size=2, each
rank asking for a *different* sampling seed (as a caller that seeds per rank would): the TP group
must sample with one seed (its leader's), else the sharded model is fed two different token streams.
Prints, per rank, the engine's effective all-reduce + RMSNorm fusion setting (off at TP > 1) and the
mean |vLLM log-prob - transformers log-prob| of its samples.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.multiproc.colocated_tp_seeds MODEL_DIR
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from aspo_lit.rollout import SamplingConfig
from aspo_lit.rollout.vllm import VLLMEngine
from tests.unit.test_rollout import policy_logprob_gap


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dist.init_process_group("gloo")
    rank, model_dir = dist.get_rank(), sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = VLLMEngine(tensor_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_gb=1)
    engine.attach(policy, tokenizer, model_dir)  # the policy it is pushed from: started with random weights
    engine.update_weights(policy.state_dict())  # a colocated engine starts with random weights
    ids = [tokenizer("2+2=")["input_ids"], tokenizer("hello there")["input_ids"]]
    out = engine.generate(ids, n=2, sampling=SamplingConfig(max_tokens=8, seed=100 + rank, logprobs=True))
    # one write per line: print() writes the text and the newline apart, and the ranks share stdout
    fusion = engine.llm.llm_engine.vllm_config.compilation_config.pass_config.fuse_allreduce_rms
    sys.stdout.write(f"rank {rank} topology {engine.topology} fuse_allreduce_rms {fusion} "
                     f"gap {policy_logprob_gap(policy, ids, out):.3e}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
