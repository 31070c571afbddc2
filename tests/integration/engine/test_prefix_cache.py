"""Prompt prefix reuse: the lookup itself, and the scheduler's outputs with it."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from grpoflow.embedded.engine.prefix_cache import PrefixCache
from grpoflow.engine.protocol import SamplingParams


def _kv(n: int, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of (1, H=2, n, D=3) whose column t holds t + fill, so slices are easy to check."""
    col = (torch.arange(n, dtype=torch.float32) + fill).view(1, 1, n, 1).expand(1, 2, n, 3)
    return [(col.clone(), -col.clone()) for _ in range(2)]


def test_longest_prefix_wins_and_one_token_is_left_to_run():
    cache = PrefixCache(max_tokens=1000, min_match=2)
    cache.insert(list(range(10)), _kv(10))
    cache.insert([0, 1, 2, 99, 98], _kv(5, fill=100.0))
    n, kv = cache.lookup(list(range(6)) + [7, 7])
    assert n == 6 and kv[0][0].shape == (1, 2, 6, 3) and kv[0][0][0, 0, -1, 0].item() == 5.0
    n, _ = cache.lookup(list(range(10)))  # fully cached: the last token must still run
    assert n == 9
    assert cache.lookup([0, 5, 6]) == (0, None)  # below min_match
    assert cache.stats.hits == 2 and cache.stats.reused_tokens == 15


def test_budget_evicts_least_recently_used_and_prefixes_are_subsumed():
    cache = PrefixCache(max_tokens=20, min_match=2)
    cache.insert([1, 2, 3, 4], _kv(4))
    cache.insert([1, 2, 3, 4, 5, 6], _kv(6))  # covers the first entry
    assert len(cache) == 1 and cache.cached_tokens == 6
    cache.insert([7] * 8, _kv(8))
    cache.lookup([1, 2, 3, 4, 5, 6, 0])  # touch the first entry
    cache.insert([9] * 8, _kv(8))  # 22 tokens > 20: the [7]*8 entry is the least recently used
    assert cache.lookup([7] * 8 + [0]) == (0, None)
    assert cache.lookup([9] * 9)[0] == 8 and cache.cached_tokens == 14
    cache.clear()
    assert len(cache) == 0 and cache.lookup([9] * 9) == (0, None)


def test_repeated_prompt_reuses_kv_with_exact_logprobs(fresh_scheduler, reference_logprobs):
    prompt = list(range(300, 364))
    params = SamplingParams(max_new_tokens=10, temperature=1.0, sampling_seed=5)
    first = fresh_scheduler.generate(prompt, params, return_logprob=True)
    hits = fresh_scheduler.prefix_cache.stats.hits
    second = fresh_scheduler.generate(prompt, params, return_logprob=True)
    assert fresh_scheduler.prefix_cache.stats.hits == hits + 1
    assert second.output_ids == first.output_ids
    ref = reference_logprobs(prompt, second.output_ids)
    assert max(abs(a - b) for a, b in zip(second.output_logprobs, ref)) < 1e-4


def test_next_turn_reuses_previous_prompt_and_reply(fresh_scheduler, reference_logprobs):
    turn1 = list(range(400, 440))
    r1 = fresh_scheduler.generate(turn1, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    turn2 = turn1 + r1.output_ids + [2, 201, 1, 302, 201]  # the reply, then a new user message
    reused_before = fresh_scheduler.prefix_cache.stats.reused_tokens
    r2 = fresh_scheduler.generate(turn2, SamplingParams(max_new_tokens=8, temperature=0.8), return_logprob=True)
    assert fresh_scheduler.prefix_cache.stats.reused_tokens - reused_before == len(turn1) + len(r1.output_ids) - 1
    ref = reference_logprobs(turn2, r2.output_ids, 0.8)
    assert max(abs(a - b) for a, b in zip(r2.output_logprobs, ref)) < 1e-4


def test_weight_update_clears_the_cache(fresh_scheduler, reference_model, tmp_path):
    fresh_scheduler.generate(list(range(500, 540)), SamplingParams(max_new_tokens=4))
    assert len(fresh_scheduler.prefix_cache) > 0
    new_dir = tmp_path / "w"
    new_dir.mkdir()
    save_file({k: v.contiguous() for k, v in reference_model.state_dict().items()}, str(new_dir / "model.safetensors"))
    assert fresh_scheduler.update_weights_from_disk(new_dir).result(timeout=30).success
    assert len(fresh_scheduler.prefix_cache) == 0
