"""The batched generator: finish reasons, logprobs, seeds, batching, weight updates (no HTTP)."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import save_file

from grpoflow.embedded.engine.scheduler import InvalidRequest
from grpoflow.engine.protocol import SamplingParams

PROMPTS = [
    [1, 302, 201, 538, 439, 2, 201, 1, 296, 201],
    [5, 6, 7, 8, 9],
    [100],
    list(range(200, 240)),
    [17, 18, 19, 700, 701, 702, 703],
]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0)


def _first_new_token_index(ids: list[int], start: int = 2) -> int:
    """An index i >= start whose token does not occur earlier, so stopping on it stops exactly there."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


def test_length_exactly_when_max_new_tokens_hit(scheduler):
    r = scheduler.generate(PROMPTS[0], SamplingParams(max_new_tokens=7, temperature=0))
    assert len(r.output_ids) == 7
    assert r.finish_reason == {"type": "length", "length": 7}
    assert r.prompt_tokens == len(PROMPTS[0])


def test_stop_token_ends_generation_and_is_kept_in_ids(scheduler):
    ref = scheduler.generate(PROMPTS[0], GREEDY).output_ids
    i = _first_new_token_index(ref)
    r = scheduler.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=[ref[i]]))
    assert r.output_ids == ref[: i + 1]
    assert r.finish_reason == {"type": "stop", "matched": ref[i]}
    assert r.text == scheduler.tokenizer.decode(ref[:i], skip_special_tokens=True)


def test_stop_token_on_last_allowed_token_is_stop_not_length(scheduler):
    ref = scheduler.generate(PROMPTS[0], GREEDY).output_ids
    i = _first_new_token_index(ref)
    r = scheduler.generate(PROMPTS[0], SamplingParams(max_new_tokens=i + 1, temperature=0, stop_token_ids=[ref[i]]))
    assert len(r.output_ids) == i + 1
    assert r.finish_reason["type"] == "stop"


def test_eos_stops_unless_ignore_eos(scheduler):
    ref = scheduler.generate(PROMPTS[1], GREEDY).output_ids
    i = _first_new_token_index(ref)
    eos_ids = set(scheduler.eos_ids)
    scheduler.eos_ids = frozenset(eos_ids | {ref[i]})  # pretend this token is the tokenizer's EOS
    try:
        stopped = scheduler.generate(PROMPTS[1], GREEDY)
        ignored = scheduler.generate(PROMPTS[1], GREEDY.model_copy(update={"ignore_eos": True}))
    finally:
        scheduler.eos_ids = frozenset(eos_ids)
    assert stopped.output_ids == ref[: i + 1] and stopped.finish_reason["type"] == "stop"
    assert ignored.output_ids == ref and ignored.finish_reason["type"] == "length"


def test_stop_string_cuts_text_before_match(scheduler):
    ref = scheduler.generate(PROMPTS[0], GREEDY)
    full = ref.text
    # A stop string that first occurs after some text: the decoded piece of a later token.
    for i in range(2, len(ref.output_ids)):
        piece = scheduler.tokenizer.decode([ref.output_ids[i]]).strip()
        if piece and full.find(piece) > 0:
            break
    else:
        pytest.skip("no usable stop string in this output")
    r = scheduler.generate(PROMPTS[0], GREEDY.model_copy(update={"stop": [piece]}))
    assert r.finish_reason == {"type": "stop", "matched": piece}
    assert r.text == full[: full.find(piece)]
    assert len(r.output_ids) < len(ref.output_ids)


def test_logprobs_match_full_forward_single(scheduler, reference_logprobs):
    params = SamplingParams(max_new_tokens=20, temperature=1.0, sampling_seed=3)
    r = scheduler.generate(PROMPTS[0], params, return_logprob=True)
    ref = reference_logprobs(PROMPTS[0], r.output_ids)
    assert len(r.output_logprobs) == len(r.output_ids) == 20
    assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-4


def test_logprobs_match_full_forward_when_batched(scheduler, reference_logprobs):
    """Rows of different lengths share forwards (left padding): each row's logprobs are still its own."""
    steps_before = scheduler.stats.decode_steps
    params = [
        SamplingParams(max_new_tokens=n, temperature=t, top_k=k, sampling_seed=i)
        for i, (n, t, k) in enumerate([(30, 0.0, -1), (12, 1.0, -1), (25, 0.7, 50), (40, 1.3, -1), (18, 1.0, 5)])
    ]
    futures = [scheduler.submit(p, sp, return_logprob=True) for p, sp in zip(PROMPTS, params)]
    results = [f.result(timeout=60) for f in futures]
    total = sum(len(r.output_ids) for r in results)
    assert scheduler.stats.decode_steps - steps_before < total - 40  # rows did share decode steps
    for prompt, r, sp in zip(PROMPTS, results, params):
        ref = reference_logprobs(prompt, r.output_ids, sp.temperature)
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) < 1e-4


def test_concurrent_greedy_equals_sequential(scheduler):
    sequential = [scheduler.generate(p, GREEDY).output_ids for p in PROMPTS]
    futures = [scheduler.submit(p, GREEDY) for p in PROMPTS]
    assert [f.result(timeout=60).output_ids for f in futures] == sequential
    assert len(set(map(tuple, sequential))) == len(PROMPTS)  # not a degenerate model


def test_many_concurrent_requests_are_batched(scheduler):
    before = scheduler.stats.decode_steps
    params = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    futures = [scheduler.submit(PROMPTS[i % len(PROMPTS)], params) for i in range(8)]
    assert all(len(f.result(timeout=60).output_ids) == 16 for f in futures)
    steps = scheduler.stats.decode_steps - before
    assert steps < 8 * 15 / 2, f"{steps} decode steps for 8 x 16 tokens: requests were not batched"
    assert scheduler.stats.max_rows >= 4


def test_same_seed_same_tokens_different_seed_different_tokens(scheduler):
    p = SamplingParams(max_new_tokens=20, temperature=1.0, sampling_seed=1234)
    a = scheduler.generate(PROMPTS[2], p).output_ids
    b = scheduler.generate(PROMPTS[2], p).output_ids
    c = scheduler.generate(PROMPTS[2], p.model_copy(update={"sampling_seed": 1235})).output_ids
    assert a == b
    assert a != c


def test_seeded_sample_is_the_same_alone_and_in_a_batch(scheduler):
    p = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, sampling_seed=77)
    alone = scheduler.generate(PROMPTS[3], p).output_ids
    others = [scheduler.submit(q, SamplingParams(max_new_tokens=30, sampling_seed=i)) for i, q in enumerate(PROMPTS)]
    batched = scheduler.submit(PROMPTS[3], p)
    assert batched.result(timeout=60).output_ids == alone
    for f in others:
        f.result(timeout=60)


def test_engine_seed_makes_unseeded_runs_reproducible(tiny_model_dir):
    from grpoflow.embedded.engine.scheduler import Scheduler

    p = SamplingParams(max_new_tokens=12, temperature=1.0)
    runs = []
    for seed in (5, 5, 6):
        with Scheduler(tiny_model_dir, seed=seed) as s:
            runs.append([s.generate(PROMPTS[0], p).output_ids for _ in range(2)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert runs[0][0] != runs[0][1]  # the request counter moves the seed


def test_top_k_and_temperature_zero(scheduler, reference_model):
    greedy = scheduler.generate(PROMPTS[0], GREEDY).output_ids
    assert scheduler.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, top_k=1)).output_ids == greedy
    assert scheduler.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, top_p=1e-6)).output_ids == greedy
    r = scheduler.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, top_k=3, temperature=2.0, sampling_seed=9))
    with torch.no_grad():
        logits = reference_model(torch.tensor([PROMPTS[0] + r.output_ids])).logits[0]  # (T, V)
    for i, tok in enumerate(r.output_ids):
        top3 = torch.topk(logits[len(PROMPTS[0]) - 1 + i], 3).indices.tolist()
        assert tok in top3


def test_invalid_requests_are_refused(scheduler):
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        scheduler.submit([1, scheduler.vocab_size], SamplingParams())
    with pytest.raises(InvalidRequest, match="context length"):
        scheduler.submit([1] * scheduler.context_length, SamplingParams())
    with pytest.raises(InvalidRequest, match="empty"):
        scheduler.submit([], SamplingParams())


def test_max_new_tokens_is_clamped_to_the_context(scheduler):
    prompt = [7] * (scheduler.context_length - 3)
    r = scheduler.generate(prompt, SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True))
    assert len(r.output_ids) == 3 and r.finish_reason["type"] == "length"


def test_zero_max_new_tokens(scheduler):
    r = scheduler.generate(PROMPTS[0], SamplingParams(max_new_tokens=0))
    assert r.output_ids == [] and r.finish_reason == {"type": "length", "length": 0}


def _write_perturbed(model, out_dir, scale=0.5):
    state = {k: (v + scale * torch.randn_like(v)).contiguous() for k, v in model.state_dict().items()}
    out_dir.mkdir()
    save_file(state, str(out_dir / "model.safetensors"))
    return out_dir


def test_weight_update_changes_outputs_and_version(fresh_scheduler, reference_model, tmp_path):
    before = fresh_scheduler.generate(PROMPTS[0], GREEDY)
    new_dir = _write_perturbed(reference_model, tmp_path / "step1")
    res = fresh_scheduler.update_weights_from_disk(new_dir).result(timeout=30)
    assert res.success and res.weight_version == "1"
    after = fresh_scheduler.generate(PROMPTS[0], GREEDY)
    assert after.output_ids != before.output_ids
    assert (before.weight_version, after.weight_version) == ("0", "1")
    res = fresh_scheduler.update_weights_from_disk(new_dir, weight_version="step-7").result(timeout=30)
    assert res.weight_version == "step-7" == fresh_scheduler.weight_version


def test_weight_update_waits_for_running_requests(fresh_scheduler, reference_model, tmp_path):
    """FIFO: a request already submitted finishes on the old weights; one submitted after runs on the new."""
    new_dir = _write_perturbed(reference_model, tmp_path / "step1")
    long = fresh_scheduler.submit(PROMPTS[0], SamplingParams(max_new_tokens=300, ignore_eos=True))
    update = fresh_scheduler.update_weights_from_disk(new_dir)
    later = fresh_scheduler.submit(PROMPTS[1], GREEDY)
    long_result = long.result(timeout=60)
    assert update.result(timeout=60).success
    assert len(long_result.output_ids) == 300
    assert long_result.weight_version == "0"
    assert later.result(timeout=60).weight_version == "1"


def test_bad_weights_leave_the_model_untouched(fresh_scheduler, reference_model, tmp_path):
    before = fresh_scheduler.generate(PROMPTS[0], GREEDY).output_ids
    bad = tmp_path / "bad"
    bad.mkdir()
    # Every tensor perturbed, one with the wrong shape: nothing may be copied.
    state = {k: v + 1.0 for k, v in reference_model.state_dict().items()}
    state["model.norm.weight"] = torch.zeros(3)
    save_file(state, str(bad / "model.safetensors"))
    res = fresh_scheduler.update_weights_from_disk(bad).result(timeout=30)
    assert not res.success and "model.norm.weight has shape (3,)" in res.message
    missing = fresh_scheduler.update_weights_from_disk(tmp_path / "nope").result(timeout=30)
    assert not missing.success and "does not exist" in missing.message
    assert fresh_scheduler.weight_version == "0"
    assert fresh_scheduler.generate(PROMPTS[0], GREEDY).output_ids == before


def test_close_fails_queued_work(tiny_model_dir):
    from grpoflow.embedded.engine.scheduler import Scheduler
    from grpoflow.errors import EngineError

    s = Scheduler(tiny_model_dir, max_batch_size=1)
    futures = [s.submit(PROMPTS[0], SamplingParams(max_new_tokens=500, ignore_eos=True)) for _ in range(3)]
    threading.Timer(0.2, s.close).start()
    with pytest.raises(EngineError, match="shut down"):
        for f in futures:
            f.result(timeout=30)
    with pytest.raises(EngineError, match="shut down"):
        s.submit(PROMPTS[0])
