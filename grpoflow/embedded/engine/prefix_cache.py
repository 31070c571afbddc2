"""Reuse the KV of a cached token prefix so a prompt only prefills what is new.

A CPU prefill is compute-bound (SmolLM2-135M: ~150 ms per 32 tokens on one core), and RL rollouts repeat
prompts: the samples of one GRPO group share their prompt, and each agent turn's prompt extends the previous
turn's prompt + reply. This is a small stand-in for SGLang's radix cache: an LRU of token sequences with their
KV (1, H_kv, T, D) per layer, a budget in tokens, and a longest-common-prefix lookup by linear scan (entries
are few). Entries are inserted after a prompt's prefill and when a request finishes (prompt + reply).

KV depends on the weights, so the scheduler clears this cache on every successful weight update.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (1, H_kv, T, D)


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0


class PrefixCache:
    def __init__(self, max_tokens: int, min_match: int = 8):
        self.max_tokens = max_tokens
        self.min_match = min_match
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[bytes, tuple[np.ndarray, KV]] = OrderedDict()  # key -> (tokens, kv)
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def lookup(self, tokens: list[int], limit: int | None = None) -> tuple[int, KV | None]:
        """Longest cached prefix of `tokens`, leaving at least one token to run: (length, KV views) or (0, None).

        `limit` caps the length used (a batched prefill may use less than the match); the match itself must
        still reach `min_match`."""
        self.stats.lookups += 1
        best_len, best_key = self._longest(tokens)
        if limit is not None:
            best_len = min(best_len, limit)
        if best_key is None or best_len <= 0:
            return 0, None
        self._entries.move_to_end(best_key)
        self.stats.hits += 1
        self.stats.reused_tokens += best_len
        kv = self._entries[best_key][1]
        return best_len, [(k[:, :, :best_len], v[:, :, :best_len]) for k, v in kv]

    def match_length(self, tokens: list[int]) -> int:
        """What `lookup` would reuse for `tokens`, without counting a lookup or touching the LRU order."""
        return self._longest(tokens)[0]

    def _longest(self, tokens: list[int]) -> tuple[int, bytes | None]:
        """(length, key) of the longest usable cached prefix of `tokens`, or (0, None) below `min_match`."""
        query = np.asarray(tokens, dtype=np.int64)
        best_len, best_key = 0, None
        for key, (cached, _) in self._entries.items():
            n = min(len(cached), len(query) - 1)  # the last prompt token must run to give the next logits
            if n <= best_len:
                continue
            diff = np.flatnonzero(cached[:n] != query[:n])
            common = int(diff[0]) if diff.size else n
            if common > best_len:
                best_len, best_key = common, key
        if best_key is None or best_len < self.min_match:
            return 0, None
        return best_len, best_key

    def insert(self, tokens: list[int], kv: KV) -> None:
        """Store `kv` (covering exactly `tokens`); entries that are prefixes of `tokens` are dropped as covered."""
        if self.max_tokens <= 0 or len(tokens) < self.min_match or len(tokens) > self.max_tokens:
            return
        arr = np.asarray(tokens, dtype=np.int64)
        key = arr.tobytes()
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        for old_key in [k for k, (t, _) in self._entries.items() if len(t) < len(arr) and arr[: len(t)].tobytes() == k]:
            self._remove(old_key)
        # Own contiguous copies: the caller's tensors are views into buffers that keep changing.
        own = [
            (k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format))
            for k, v in kv
        ]
        self._entries[key] = (arr, own)
        self._tokens += len(arr)
        while self._tokens > self.max_tokens:
            self._remove(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def _remove(self, key: bytes) -> None:
        arr, _ = self._entries.pop(key)
        self._tokens -= len(arr)
