"""One rank under torch.distributed.run, one colocated VLLMEngine: it starts with random weights
(``load_format="dummy"``), so before the first push its weight checksum differs from the
checkpoint's and ``generate`` refuses to run; after the push the checksums match and its samples'
log-probs are the policy's. Prints one JSON line with what it saw.

    python -m torch.distributed.run --nproc_per_node 1 -m tests.multiproc.colocated_first_push MODEL_DIR
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from aspo_lit.rollout import SamplingConfig
from aspo_lit.rollout.checksum import checksum_of, weights_match
from aspo_lit.rollout.vllm import VLLMEngine
from tests.unit.test_rollout import policy_logprob_gap


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dist.init_process_group("gloo")
    model_dir = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = VLLMEngine(dtype="float32", max_model_len=128, kv_cache_gb=1, enable_sleep_mode=True)
    engine.attach(policy, tokenizer, model_dir)  # the policy it is pushed from: started with random weights
    trainer = checksum_of(policy.state_dict().items(), engine.model_dtype)
    seen = {"topology": engine.topology, "needs_push_at_start": engine.needs_weight_push}
    seen["before"] = weights_match(engine.weights_checksum(), trainer, engine.model_dtype)
    try:
        engine.generate([[1, 2, 3]], n=1, sampling=SamplingConfig(max_tokens=2))
        seen["generate_before_push"] = "ran"
    except RuntimeError as e:
        seen["generate_before_push"] = str(e)
    engine.update_weights(policy.state_dict())
    seen["after"] = weights_match(engine.weights_checksum(), trainer, engine.model_dtype)
    ids = [tokenizer("2+2=")["input_ids"], tokenizer("hello there")["input_ids"]]
    out = engine.generate(ids, n=2, sampling=SamplingConfig(max_tokens=8, seed=0, logprobs=True))
    seen["gap_after"] = policy_logprob_gap(policy, ids, out)
    print("SEEN " + json.dumps(seen), flush=True)
    engine.close()  # vLLM's shutdown also ends the process group


if __name__ == "__main__":
    main()
