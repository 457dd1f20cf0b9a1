"""Deterministic per-step seeds, so sampling and shuffles do not depend on global RNG state."""


def derived_seed(*parts: int) -> int:
    """A deterministic seed from integers (e.g. run seed and step counter)."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (2**31 - 1)
    return seed
