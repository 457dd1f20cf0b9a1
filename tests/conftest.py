"""Shared pytest fixtures: a tiny random-init llama testbed model and the shared data folder.

`tiny_model_dir` / `tiny_tied_model_dir` are session-scoped directories holding a
`LlamaForCausalLM` (hidden 64, 2 layers, 2 heads -> head_dim 32, which vLLM's CPU attention
accepts; fp32) and a char-level `PreTrainedTokenizerFast`, both written with `save_pretrained`,
so `AutoModelForCausalLM.from_pretrained(dir)`, `AutoTokenizer.from_pretrained(dir)` and
`vllm.LLM(dir)` all load them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.char_tokenizer import build_char_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


# Whole modules by kind, for `make test-fast` (pyproject.toml names the markers), by file name: all in
# tests/integration/ (tests/unit/test_layout.py checks each names one file there). A test in another
# module that starts processes carries @pytest.mark.multiproc itself.
MODULE_MARKERS = {
    "multiproc": ("test_colocate", "test_sharded"),
    "e2e": ("test_training", "test_readme", "test_study", "test_rehearsal", "test_rehearsal_more", "test_seeds", "test_paper_data",
            "test_gpu_check", "test_extension_example", "test_staleness"),
    "sandbox": ("test_code_reward", "test_code_eval", "test_code_datamodule", "test_code_configs"),
}


def pytest_configure(config):
    """Under pytest-xdist each worker gets its share of the cores, as `FSDP2Strategy` gives each rank
    (aspo_lit.training.threads): torch's threads in the worker, and ``OMP_NUM_THREADS`` for the processes its
    tests start. With torch's default (one thread per core in every worker) two workers ran four
    OpenMP threads on two cores, and a fit's spinning threads slowed the other worker's fits ~5x
    (tools/gpu_check.py: 97 s alone, 489 s beside the other worker). A thread count the user set
    is kept."""
    config.addinivalue_line("markers", "alone: runs in `make test`'s serial phase, no other test beside it "
                                       "(tests/integration/test_sharded.py's validation test: see docs/ci.md)")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 2:
        return
    from aspo_lit.training.threads import set_threads_per_rank, user_thread_settings

    set_threads_per_rank(workers, user_thread_settings())


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        for marker, modules in MODULE_MARKERS.items():
            if module in modules:
                item.add_marker(marker)

def build_tiny_model_dir(path: Path, *, tie_word_embeddings: bool = False, seed: int = 0,
                         max_position_embeddings: int = 512) -> Path:
    """Write a random-init tiny llama + char tokenizer to `path` and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        # A wider init than the default (std 0.02) so the random model's next-token
        # distributions are far from uniform: samples differ visibly between weights.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 2:
                    p.normal_(0.0, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama_tied"), tie_word_embeddings=True)


# The staged benchmark copies next to the checkout are the suite's $ASPO_DATA_DIR (docs/data.md).
if (REPO_ROOT.parent / "shared" / "data").is_dir():
    os.environ.setdefault("ASPO_DATA_DIR", str(REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """$ASPO_DATA_DIR (../shared/data in a checkout that has it); skips the test when it is missing."""
    path = Path(os.environ.get("ASPO_DATA_DIR") or REPO_ROOT.parent / "shared" / "data")
    if not path.is_dir():
        pytest.skip(f"shared data dir {path} not found (set ASPO_DATA_DIR)")
    return path


@pytest.fixture
def one_thread():
    """One torch thread for the test (tests/helpers/tolerance.py's `torch_threads`): where results are
    claimed bit for bit (the lean sampling loop against `generate`, two fits of one seed)."""
    from tests.helpers.tolerance import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def testbed() -> str:
    """The default CPU testbed (the demo's model), as shipped with the package."""
    from aspo_lit.testbed.shipped import shipped_dir

    return str(shipped_dir("testbed"))


def _process_state() -> dict:
    """What a test could leave changed in its worker that decides later tests' float bits: torch's
    and MKL's/OpenMP's thread counts (and whether `torch.set_num_threads` is still torch's own,
    which vLLM's CPU worker replaces), the CPUs this process may run on, the thread variables its
    subprocesses inherit, and torch's matmul precision and deterministic mode."""
    import torch

    info = torch.__config__.parallel_info()
    return {
        "torch threads": torch.get_num_threads(),
        "omp/mkl max threads": [line.strip() for line in info.splitlines() if "max_threads" in line],
        "torch.set_num_threads": getattr(torch.set_num_threads, "__module__", None),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DYNAMIC", "OMP_DYNAMIC")},
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "default dtype": str(torch.get_default_dtype()),
    }


@pytest.fixture(autouse=True)
def _worker_state_unchanged(request):
    """Every test leaves its pytest worker as it found it: the bit-for-bit tests (same seed, resume)
    compare fits made in one worker with a subprocess's, minutes and other tests apart, and a thread
    count or CPU mask left changed by an earlier test in the same worker changes their float bits
    (a pytest-xdist worker's file order varies between runs, so such a leak fails a later test at
    random)."""
    before = _process_state()
    yield
    after = _process_state()
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    if changed:
        pytest.fail(f"{request.node.nodeid} left its worker changed (before, after): {changed}", pytrace=False)
