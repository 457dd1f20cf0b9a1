"""Checks of one setting's value, raised naming its config key (``model.kl_kind``, ``data.batch_size``).

A setting with a fixed set of values is typed ``Literal[...]`` in its class's ``__init__``: LightningCLI
(jsonargparse) then rejects a bad value while parsing, naming the key, before anything is built.
`check_choice` reads the same ``Literal`` for a class built in Python, so the values are written once.
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin


def choices(hint: Any) -> tuple:
    """The values a ``Literal[...]`` type admits (a union with ``None``: None too), in their written order."""
    if get_origin(hint) is Literal:
        return get_args(hint)
    return tuple(value for arg in get_args(hint) for value in ((None,) if arg is type(None) else choices(arg)))


def check_choice(key: str, value: Any, hint: Any) -> None:
    """Raise a ``ValueError`` naming ``key`` unless ``value`` is one the ``Literal`` type ``hint`` admits."""
    allowed = choices(hint)
    # the type counts too: True is not the level 1, nor 2.0 the level 2
    if not any(type(value) is type(choice) and value == choice for choice in allowed):
        names = ", ".join("null" if v is None else str(v) for v in allowed)
        raise ValueError(f"{key} must be one of {names}, got {value!r}")


def check_positive_int(key: str, value: Any, or_null: bool = False) -> None:
    """Raise naming ``key`` unless ``value`` is an integer >= 1 (or, with ``or_null``, None)."""
    if or_null and value is None:
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer{' or null' if or_null else ''}, got {value!r}")
