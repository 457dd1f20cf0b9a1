"""A KV cache for the transformers engine that writes each decoding step in place.

transformers' default ``DynamicLayer`` concatenates the whole cache into a new tensor at every
decoding step: ``O(L^2)`` copying over an ``L``-token sequence (on the CPU testbed, 28 % of the
sampling time of a 320-token rollout batch). Once a sequence is longer than ``start`` positions,
``GrowingLayer`` moves its cache into one buffer per layer, writes each step's keys/values into
it and hands attention the filled prefix as a view. The buffer grows by doubling, never past
``limit`` (prompt + ``max_new_tokens``) unless a longer sequence asks for it, so memory stays
within twice what the default cache would hold. Below ``start`` the layer concatenates as
transformers does: attention over a strided view is slower than over a contiguous tensor
(CPU ``scaled_dot_product_attention``: ~20 % at 80 positions), which outweighs the copies of a
short cache (the 64-token demo testbed samples ~8 % slower with the buffer from the first step).

The view holds the same values as the concatenated tensor, row by row and in the same order, so
attention returns the same bits: the engine's samples and log-probs are those of the default
cache (tests/unit/test_rollout.py). transformers' ``StaticCache`` avoids the copies too, but attends
over the whole preallocated length (masked), which changes the log-probs in the 6th digit.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["GrowingLayer", "growing_kv_cache"]


#: positions after which the cache moves into a buffer (the crossover measured on the CPU testbeds)
START = 128


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values, past `start` positions, are views of a buffer grown by
    doubling up to `limit`."""

    def __init__(self, limit: int, start: int = START) -> None:
        super().__init__()
        self.limit = int(limit)
        self.start = int(start)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        filled = self.get_seq_length()
        need = filled + key_states.shape[-2]
        if self._key_buffer is None and need <= self.start:
            return super().update(key_states, value_states)
        # a buffer too short, or one the cache no longer views (an inherited crop / reorder /
        # batch selection replaced `self.keys`), is rebuilt from the cache's current content
        if not (_is_prefix_of(self.keys, self._key_buffer, filled, key_states)
                and need <= self._key_buffer.shape[-2]):
            capacity = max(need, min(2 * need, self.limit))
            self._key_buffer = _grown(self.keys, filled, key_states, capacity)
            self._value_buffer = _grown(self.values, filled, value_states, capacity)
        self._key_buffer[..., filled:need, :] = key_states
        self._value_buffer[..., filled:need, :] = value_states
        self.keys = self._key_buffer[..., :need, :]
        self.values = self._value_buffer[..., :need, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


def _is_prefix_of(states: torch.Tensor, buffer: torch.Tensor | None, filled: int, like: torch.Tensor) -> bool:
    """True when `states` is `buffer`'s first `filled` positions (the view `update` handed out)
    and `buffer` has the batch and head shape of the new states `like`."""
    if buffer is None or buffer.shape[:-2] != like.shape[:-2]:
        return False
    return filled == 0 or states.data_ptr() == buffer.data_ptr()


def _grown(states: torch.Tensor, filled: int, like: torch.Tensor, capacity: int) -> torch.Tensor:
    """A buffer shaped like `like` with `capacity` positions, its first `filled` a copy of `states`."""
    out = like.new_empty((*like.shape[:-2], capacity, like.shape[-1]))
    if filled:
        out[..., :filled, :] = states
    return out


def growing_kv_cache(model: Any, limit: int, start: int = START) -> DynamicCache | None:
    """A ``DynamicCache`` for `model` whose plain full-attention layers are `GrowingLayer`s
    (sliding-window and other layer kinds stay transformers' own); None when the config names no
    layers, and ``generate`` builds its default cache."""
    cache = DynamicCache(config=model.config)
    if not cache.layers:
        return None
    cache.layers = [GrowingLayer(limit, start) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
