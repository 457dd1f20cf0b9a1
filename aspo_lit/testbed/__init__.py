"""The CPU testbeds: seeded task generators and the tiny policies built from them.

``arithmetic`` and ``multistep`` generate the math tasks, ``tiny_code`` the code task; ``build``
trains the tiny llama/qwen3 policy and tokenizer from a config (``config``: ``TestbedConfig``,
``PROFILES`` names the shipped ones, the cache folder) out of ``tokenizer``, ``model``, ``sft``
and ``evaluation``, and ``code`` the code policy. See docs/testbed.md and docs/studies/testbed-long.md.
"""

from aspo_lit.testbed.build import build_testbed
from aspo_lit.testbed.config import (
    BUILDER_VERSION,
    PROFILES,
    TestbedConfig,
    config_hash,
    default_cache_dir,
    testbed_dir,
)
from aspo_lit.testbed.evaluation import held_out_accuracy, is_correct
from aspo_lit.testbed.tokenizer import CHAT_TEMPLATE

__all__ = [
    "BUILDER_VERSION", "CHAT_TEMPLATE", "PROFILES", "TestbedConfig", "build_testbed", "config_hash",
    "default_cache_dir", "held_out_accuracy", "is_correct", "testbed_dir",
]
