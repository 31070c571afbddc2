"""Batched prefill: requests waiting at admission share prefill forwards, exactly, with the prefix cache."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

from grpoflow.engine.protocol import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
MIXED = [  # different lengths: the group is left-padded
    [1, 302, 201, 538, 439, 2, 201, 1, 296, 201],
    [5, 6, 7, 8, 9],
    [100],
    list(range(200, 240)),
    [17, 18, 19, 700, 701, 702, 703],
]


@contextlib.contextmanager
def paused(sched, monkeypatch) -> Iterator[None]:
    """Hold the scheduler thread before its next admission while the block submits, so that everything
    submitted is waiting at that admission."""
    release = threading.Event()
    entered = threading.Event()
    admit = sched._admit

    def gated_admit() -> None:
        if not release.is_set():
            entered.set()
            release.wait(30)
        admit()

    monkeypatch.setattr(sched, "_admit", gated_admit)
    wake = sched.submit([1], SamplingParams(max_new_tokens=0))  # an idle thread only wakes for work
    assert entered.wait(30)
    try:
        yield
    finally:
        release.set()
        assert wake.result(timeout=30).output_ids == []


def _delta(sched, before: dict, key: str):
    return sched.internal_state()[key] - before[key]


def test_waiting_requests_share_one_prefill_with_exact_logprobs(fresh_scheduler, reference_logprobs, monkeypatch):
    params = [
        SamplingParams(max_new_tokens=10 + i, temperature=1.0 if i % 2 else 0.0, sampling_seed=i)
        for i in range(len(MIXED))
    ]
    before = fresh_scheduler.internal_state()
    with paused(fresh_scheduler, monkeypatch):
        futures = [fresh_scheduler.submit(p, sp, return_logprob=True) for p, sp in zip(MIXED, params)]
    results = [f.result(timeout=60) for f in futures]
    assert _delta(fresh_scheduler, before, "prefills") == len(MIXED)
    # Lengths 1, 5, 7, 10 run padded to 10 in one forward; padding them to 40 would cost more than a forward.
    assert _delta(fresh_scheduler, before, "prefill_forwards") == 2
    assert _delta(fresh_scheduler, before, "prefill_padding_tokens") == 4 * 10 - (1 + 5 + 7 + 10)
    assert _delta(fresh_scheduler, before, "prefill_tokens") == sum(map(len, MIXED))
    for prompt, r, sp in zip(MIXED, results, params):
        assert len(r.output_ids) == sp.max_new_tokens
        ref = reference_logprobs(prompt, r.output_ids)  # T=1 rows and greedy rows: both scored at T=1
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-4


def test_batched_prefill_gives_the_tokens_of_lone_runs(fresh_scheduler, monkeypatch):
    params = [SamplingParams(max_new_tokens=16, temperature=0.9, sampling_seed=40 + i) for i in range(len(MIXED))]
    alone = [fresh_scheduler.generate(p, sp).output_ids for p, sp in zip(MIXED, params)]
    greedy_alone = [fresh_scheduler.generate(p, GREEDY).output_ids for p in MIXED]
    fresh_scheduler.prefix_cache.clear()
    with paused(fresh_scheduler, monkeypatch):
        sampled = [fresh_scheduler.submit(p, sp) for p, sp in zip(MIXED, params)]
        greedy = [fresh_scheduler.submit(p, GREEDY) for p in MIXED]
    assert [f.result(timeout=60).output_ids for f in sampled] == alone
    assert [f.result(timeout=60).output_ids for f in greedy] == greedy_alone


def test_prefix_cache_hits_inside_a_batch(fresh_scheduler, reference_logprobs, monkeypatch):
    base = list(range(300, 360))
    fresh_scheduler.generate(base, SamplingParams(max_new_tokens=2))  # caches `base` (and base + reply)
    prompts = [base + [7, 8, 9], base, list(range(500, 508)), base[:30] + [1, 2, 3, 4, 5]]  # uncached: 3, 1, 8, 5
    before = fresh_scheduler.internal_state()
    with paused(fresh_scheduler, monkeypatch):
        futures = [
            fresh_scheduler.submit(p, SamplingParams(max_new_tokens=8, sampling_seed=i), return_logprob=True)
            for i, p in enumerate(prompts)
        ]
    results = [f.result(timeout=60) for f in futures]
    # One forward as wide as the fresh 8-token prompt: every row runs its last 8 tokens, recomputing a few
    # cached ones, over the cached KV of the rest.
    assert _delta(fresh_scheduler, before, "prefill_forwards") == 1
    cached = sum(max(len(p) - 8, 0) for p in prompts)
    assert _delta(fresh_scheduler, before, "cached_tokens") == cached
    assert _delta(fresh_scheduler, before, "prefill_tokens") == sum(map(len, prompts)) - cached
    for prompt, r in zip(prompts, results):
        ref = reference_logprobs(prompt, r.output_ids)
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-4


def test_shared_prompt_is_prefilled_once_then_reused(fresh_scheduler, reference_logprobs, monkeypatch):
    """A GRPO group: n samples of one prompt arrive together; the prompt is computed once, not n times."""
    prompt = list(range(600, 680))  # 80 tokens
    before = fresh_scheduler.internal_state()
    with paused(fresh_scheduler, monkeypatch):
        futures = [
            fresh_scheduler.submit(prompt, SamplingParams(max_new_tokens=6, sampling_seed=i), return_logprob=True)
            for i in range(4)
        ]
    results = [f.result(timeout=60) for f in futures]
    assert _delta(fresh_scheduler, before, "prefill_forwards") == 2  # the prompt, then 3 rows of its last token
    assert _delta(fresh_scheduler, before, "prefill_tokens") == 80 + 3
    assert len({tuple(r.output_ids) for r in results}) > 1  # own seeds, own samples
    for r in results:
        ref = reference_logprobs(prompt, r.output_ids)
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-4


def test_without_prefix_cache_shared_prompts_run_together(tiny_model_dir, monkeypatch):
    from grpoflow.embedded.engine.scheduler import Scheduler

    prompt = list(range(600, 680))
    with Scheduler(tiny_model_dir, max_batch_size=8, prefix_cache_tokens=0) as sched:
        with paused(sched, monkeypatch):
            futures = [sched.submit(prompt, GREEDY) for _ in range(3)]
        outputs = [f.result(timeout=60).output_ids for f in futures]
        assert sched.stats.prefill_forwards == 1 and sched.stats.prefill_tokens == 3 * 80
    assert outputs[0] == outputs[1] == outputs[2]


def test_very_different_lengths_are_prefilled_apart(fresh_scheduler, monkeypatch):
    prompts = [[5, 6, 7], list(range(100, 300))]  # padding the short one to 200 would double the work
    before = fresh_scheduler.internal_state()
    with paused(fresh_scheduler, monkeypatch):
        futures = [fresh_scheduler.submit(p, GREEDY) for p in prompts]
    results = [f.result(timeout=60) for f in futures]
    assert _delta(fresh_scheduler, before, "prefill_forwards") == 2
    assert _delta(fresh_scheduler, before, "prefill_padding_tokens") == 0
    assert _delta(fresh_scheduler, before, "decode_steps") < 2 * 11  # but they decode together
    assert [len(r.output_ids) for r in results] == [12, 12]


def test_rows_finishing_on_their_first_token_leave_the_others_going(fresh_scheduler, monkeypatch):
    lone = [fresh_scheduler.generate(p, GREEDY).output_ids for p in MIXED]
    fresh_scheduler.prefix_cache.clear()
    with paused(fresh_scheduler, monkeypatch):
        firsts = [fresh_scheduler.submit(p, SamplingParams(max_new_tokens=1, temperature=0)) for p in MIXED[:3]]
        zero = fresh_scheduler.submit(MIXED[0], SamplingParams(max_new_tokens=0))
        rest = [fresh_scheduler.submit(p, GREEDY) for p in MIXED]
    assert [f.result(timeout=60).output_ids for f in firsts] == [ids[:1] for ids in lone[:3]]
    assert zero.result(timeout=60).output_ids == []
    assert [f.result(timeout=60).output_ids for f in rest] == lone


def test_a_failing_prefill_fails_its_group_only(fresh_scheduler, monkeypatch):
    real_prefill = fresh_scheduler._prefill

    def flaky(jobs):
        if any(len(j.input_ids) == 3 for j in jobs):
            raise RuntimeError("boom")
        return real_prefill(jobs)

    monkeypatch.setattr(fresh_scheduler, "_prefill", flaky)
    with paused(fresh_scheduler, monkeypatch):
        bad = fresh_scheduler.submit([5, 6, 7], GREEDY)
        good = fresh_scheduler.submit(list(range(100, 300)), GREEDY)  # its own group (see above)
    with pytest.raises(Exception, match="prefill failed: RuntimeError: boom"):
        bad.result(timeout=60)
    assert len(good.result(timeout=60).output_ids) == 12
