"""The char-level tokenizer of the tests' tiny random models (tests/conftest.py) and of the
benchmarks that build one (tools/perf/bench_rollout.py, tools/perf/bench_load_memory.py)."""

from __future__ import annotations

# 4 special tokens + 60 characters = 64 ids.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz .,:;!?+-*/=()[]{}\\^_'\n$")


def build_char_tokenizer():
    """A char-level fast tokenizer (lower-cases its input; unknown chars map to <unk>)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    assert len(vocab) == len(SPECIAL_TOKENS) + len(CHARS), "duplicate characters"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
