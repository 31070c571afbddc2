"""Hand-made `Sample`s for tests of what happens to samples after a rollout (selection, staleness, training)."""

from __future__ import annotations

from grpoflow.samples import Sample


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
