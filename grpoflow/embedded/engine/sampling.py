"""Next-token choice for one decode step: per-row temperature, top-k, top-p and seed.

Each row samples with its own `torch.Generator` and draws exactly one uniform number per sampled token (none
when greedy), so a request's tokens depend on its seed and its logits only — not on which other requests share
the batch. The returned logprob is `log_softmax(logits / T)` at the chosen token, T the request's temperature
(T = 1 for greedy), before top-k/top-p: SGLang's default, and what the trainer recomputes (it scales its logits
by the rollout temperature), so the PPO ratio compares like with like.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpoflow.engine.protocol import SamplingParams


def sample_next_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` (B, V); return (token ids, logprobs of those tokens under softmax(logits/T))."""
    logits = logits.float()
    temps = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params]).unsqueeze(1)  # (B, 1)
    logprobs = torch.log_softmax(logits / temps, dim=-1)  # (B, V)
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done
    vocab = logits.shape[-1]
    plain, filtered = [], []  # rows sampled from the full softmax / with top-k or top-p
    for b, p in enumerate(params):
        if p.is_greedy or p.top_k == 1:
            continue
        (filtered if (p.top_k != -1 and p.top_k < vocab) or p.top_p < 1.0 else plain).append(b)
    if plain:
        # One batched softmax + cdf for the common case; still one uniform draw per row from its own generator.
        rows = torch.tensor(plain)
        temps = torch.tensor([params[b].temperature for b in plain]).unsqueeze(1)  # (P, 1)
        probs = torch.softmax(logits[rows] / temps, dim=-1)  # (P, V)
        u = torch.stack([torch.rand((), generator=generators[b]) for b in plain])  # (P,)
        picked = _invert_cdf(probs, u)
        for b, tok in zip(plain, picked, strict=True):
            tokens[b] = tok
    for b in filtered:
        tokens[b] = _sample_filtered(logits[b], params[b], generators[b])
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]  # (B,)
    return tokens, chosen.tolist()


def _invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Index per row of `probs` (R, N) where the cdf first exceeds u * total, `u` (R,) in [0, 1)."""
    cdf = torch.cumsum(probs, dim=-1)  # (R, N)
    target = (u * cdf[:, -1]).unsqueeze(1)  # (R, 1)
    pos = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)  # (R,)
    out = pos.tolist()
    # A zero-probability slot can only be hit through rounding at the top of the cdf: step back to a live one.
    for r, i in enumerate(out):
        while probs[r, i] <= 0 and i > 0:
            i -= 1
        out[r] = i
    return out


def _sample_filtered(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token from `logits` (V,) under top-k and/or top-p."""
    scaled = logits / p.temperature  # (V,)
    if p.top_k != -1 and p.top_k < logits.shape[-1]:
        values, index = torch.topk(scaled, p.top_k)  # (k,), sorted descending
    else:
        values, index = torch.sort(scaled, descending=True)  # (V,)
    probs = torch.softmax(values, dim=-1)
    if p.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = torch.cumsum(probs, dim=-1) - probs
        probs = torch.where(before < p.top_p, probs, torch.zeros_like(probs))
    u = torch.rand((), generator=gen).reshape(1)
    return int(index[_invert_cdf(probs.unsqueeze(0), u)[0]])
