"""Per-row sampling: greedy, top-k, top-p, seeds, and raw logprobs."""

from __future__ import annotations

import pytest
import torch

from grpoflow.embedded.engine.sampling import sample_next_tokens
from grpoflow.engine.protocol import SamplingParams


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=_gen(seed)) * 3  # (B, V)


def test_greedy_is_argmax_and_logprob_is_raw_log_softmax():
    logits = _logits()
    params = [SamplingParams(temperature=0)] * 3
    tokens, lps = sample_next_tokens(logits, params, [_gen(i) for i in range(3)])
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor(tokens)]
    assert torch.allclose(torch.tensor(lps), expected)


@pytest.mark.parametrize("filters", [{"top_k": 4}, {"top_p": 0.5}, {"top_k": 6, "top_p": 0.8}])
def test_logprob_is_taken_at_the_temperature_before_top_k_and_top_p(filters):
    # SGLang's /generate default (SGLANG_RETURN_ORIGINAL_LOGPROB unset): log_softmax(logits / T) before the
    # filters, which is what the trainer recomputes at the rollout temperature
    logits = _logits(rows=1)
    for seed in range(5):
        tokens, lps = sample_next_tokens(logits, [SamplingParams(temperature=0.3, **filters)], [_gen(seed)])
        assert abs(lps[0] - torch.log_softmax(logits[0] / 0.3, -1)[tokens[0]].item()) < 1e-5


def test_top_k_only_picks_among_the_k_best():
    logits = _logits(rows=1, vocab=200)
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    seen = set()
    for seed in range(200):
        (tok,), _ = sample_next_tokens(logits, [SamplingParams(temperature=5.0, top_k=5)], [_gen(seed)])
        seen.add(tok)
    assert seen <= top5 and len(seen) > 1


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(300):
        (tok,), _ = sample_next_tokens(logits, [SamplingParams(top_p=0.7)], [_gen(seed)])
        seen.add(tok)
    assert seen == {0, 1}  # 0.5 alone < 0.7, 0.5 + 0.3 reaches it


def test_sampling_frequencies_follow_temperature_one():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = _gen(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        (tok,), _ = sample_next_tokens(logits, [SamplingParams()], [gen])
        counts[tok] += 1
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_row_result_depends_only_on_its_own_seed_and_logits():
    logits = _logits(rows=4, vocab=100)
    p = SamplingParams(temperature=1.0)
    batch, _ = sample_next_tokens(logits, [p] * 4, [_gen(s) for s in (10, 11, 12, 13)])
    alone = [sample_next_tokens(logits[i : i + 1], [p], [_gen(10 + i)])[0][0] for i in range(4)]
    assert batch == alone
