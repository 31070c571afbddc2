"""A transformers KV cache for the running batch that appends in place instead of re-concatenating.

transformers' `DynamicLayer.update` does `torch.cat([keys, new], dim=-2)` every decode step, copying the whole
cache (O(T) per token). `GrowingLayer` keeps keys/values in a buffer (B, H_kv, capacity, D) with spare columns,
writes each step's column in place and exposes the filled part as a view, doubling the buffer when full. The
scheduler rebuilds the cache only when rows join or leave.

This leans on two transformers 5.x interfaces: `Cache(layers=[...])` and a layer's `keys` / `values` /
`update` / `get_seq_length`. If a transformers upgrade breaks them, `tests/integration/engine/test_kv_cache.py` fails.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

_MIN_SPARE = 64  # columns allocated ahead, so a buffer is regrown about every `capacity` tokens


class GrowingLayer(DynamicLayer):
    """One layer's cache; `keys`/`values` are (B, H_kv, T, D) views into a larger buffer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._length = keys.shape[-2]
        self._kbuf = self._alloc(keys, self._length + max(_MIN_SPARE, self._length))
        self._vbuf = self._alloc(values, self._kbuf.shape[-2])
        self._refresh_views()

    @staticmethod
    def _alloc(x: torch.Tensor, capacity: int) -> torch.Tensor:
        b, h, t, d = x.shape
        buf = x.new_empty(b, h, capacity, d)
        buf[:, :, :t] = x
        return buf

    def _refresh_views(self) -> None:
        self.keys = self._kbuf[:, :, : self._length]
        self.values = self._vbuf[:, :, : self._length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self._length + n > self._kbuf.shape[-2]:
            capacity = 2 * (self._length + n)
            self._kbuf = self._alloc(self.keys, capacity)
            self._vbuf = self._alloc(self.values, capacity)
        self._kbuf[:, :, self._length : self._length + n] = key_states
        self._vbuf[:, :, self._length : self._length + n] = value_states
        self._length += n
        self._refresh_views()
        return self.keys, self.values


class BatchKVCache(DynamicCache):
    """A DynamicCache (so model code treats it as one) whose layers are `GrowingLayer`s."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        Cache.__init__(self, layers=[GrowingLayer(k, v) for k, v in kv])


def kv_tensors(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values), each (B, H_kv, T, D), of a cache whose layers are all full-attention."""
    return [(layer.keys, layer.values) for layer in cache.layers]
