"""Hand-made `Sample`s for tests of what happens to samples after a rollout (selection, staleness, training)."""

from __future__ import annotations

import random

import torch

from grpoflow.samples import Sample
from grpoflow.train.logprobs import token_logprobs


def make_sample(
    group: str,
    k: int = 0,
    reward: float | None = 1.0,
    status: str = "COMPLETED",
    *,
    tokens: list[int] | None = None,
    mask: list[int] | None = None,
    logprobs: list[float] | None = None,
    weight_version: str | None = None,
) -> Sample:
    """Sample `k` of `group`: by default a 1-token prompt and 1 generated token; a FAILED one with a sandbox
    error as its exit status."""
    mask = mask if mask is not None else [0, 1]
    return Sample(
        run_id="t",
        step=0,
        instance_id=group,
        group_id=group,
        sample_index=k,
        rollout_id=f"{group}-{k}",
        tokens=tokens if tokens is not None else [1] * len(mask),
        loss_mask=mask,
        rollout_logprobs=logprobs if logprobs is not None else [0.0] * len(mask),
        prompt_len=mask.index(1) if 1 in mask else 0,
        reward=reward,
        status=status,
        exit_status="Submitted" if status != "FAILED" else "SandboxError",
        weight_version=weight_version,
    )


def agentic_samples(model, n_groups=3, per_group=4, seed=0):
    """prompt | turn 1 | tool output (masked) | turn 2, random tokens; rollout logprobs = the model's + noise."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    out = []
    for g in range(n_groups):
        for i in range(per_group):
            p, a, t, b = rng.randint(4, 12), rng.randint(3, 20), rng.randint(2, 10), rng.randint(3, 25)
            tokens = [rng.randrange(3, vocab) for _ in range(p + a + t + b)]
            mask = [0] * p + [1] * a + [0] * t + [1] * b
            out.append(make_sample(f"g{g}", i, float(rng.random() < 0.5), tokens=tokens, mask=mask))
    # make every group's rewards vary so nothing is filtered
    for g in range(n_groups):
        out[g * per_group].reward, out[g * per_group + 1].reward = 1.0, 0.0
    with torch.no_grad():
        for s in out:
            ids = torch.tensor([s.tokens])
            lp, _ = token_logprobs(model, ids, torch.tensor([s.loss_mask[1:]], dtype=torch.bool))
            noisy = lp[0] + 0.05 * torch.randn(lp.shape[1], generator=torch.Generator().manual_seed(len(s.tokens)))
            s.rollout_logprobs = [0.0] + [v if m else 0.0 for v, m in zip(noisy.tolist(), s.loss_mask[1:])]
    return out
