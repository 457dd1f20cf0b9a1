"""The CPU testbeds: seeded task generators and the tiny policies built from them.

``arithmetic`` and ``multistep`` generate the math tasks, ``tiny_code`` the code task; ``build``
trains the tiny llama/qwen3 policy and tokenizer from a config (``PROFILES`` names the shipped
ones) and ``code`` the code policy. See the README's "The CPU testbed" and docs/testbed-long.md.
"""

from aspo_lit.testbed.build import (
    BUILDER_VERSION,
    CHAT_TEMPLATE,
    PROFILES,
    TestbedConfig,
    build_testbed,
    config_hash,
    default_cache_dir,
    held_out_accuracy,
    is_correct,
    testbed_dir,
)

__all__ = [
    "BUILDER_VERSION", "CHAT_TEMPLATE", "PROFILES", "TestbedConfig", "build_testbed", "config_hash",
    "default_cache_dir", "held_out_accuracy", "is_correct", "testbed_dir",
]
