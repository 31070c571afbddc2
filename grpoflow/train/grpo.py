"""GRPO on tensors: group-relative advantages, the zero-std group filter, and the PPO-clipped token loss.

Textbook GRPO (DeepSeekMath) with these choices:
- the group std is the population std (divide by G, not G - 1), so the advantages of a group have unit
  variance exactly and a group of one is defined (advantage 0). TRL and verl use the sample std, which makes
  their advantages smaller by sqrt((G - 1) / G) (0.87 for G = 4): only the scale differs.
- the clip range is asymmetric (DAPO's clip-higher: `eps_high` > `eps_low`).
- the "old" logprobs are the inference engine's (the behaviour policy), so the ratio also carries the
  engine-vs-trainer mismatch; or, with `behaviour_logprobs`, the trainer's own recomputed before the update,
  and the mismatch is corrected apart: tokens whose trainer/engine ratio leaves a band are masked (IcePop) and
  the rest weighted by that ratio, capped (truncated importance sampling).
- dual-clip bounds the loss of a negative advantage (verl's `clip_ratio_c`): past ratio `dual_clip` the token
  keeps no gradient, so one mismatched token cannot set the step's direction.
- the optional KL penalty to a reference is the k3 estimator (Schulman), added to the per-token loss.
- `denominator` lets a caller that splits a batch into micro-batches normalise every micro-batch by the
  global count, so the accumulated gradients equal those of the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Literal

import torch

# |log ratio| beyond this is clipped anyway (exp(20) >> 1 + eps); the clamp keeps exp() finite, so a token
# with a wild rollout logprob cannot turn the loss into inf * 0 = nan.
_MAX_LOG_RATIO = 20.0
_MAX_K3 = 10.0


def _group_rows(group_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    rows: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        rows.setdefault(g, []).append(i)
    return rows


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable],
    scale_by_std: bool,
    eps: float = 1e-6,
    rollout_ids: Sequence[Hashable] | None = None,
) -> torch.Tensor:
    """(r - group mean) / (group population std + eps), or r - group mean when `scale_by_std` is False (Dr.GRPO).

    rewards (N,) -> advantages (N,). A group whose rewards are all equal gets exactly 0 (not a rounding residue
    of r - mean), so "no signal" stays recognisable downstream.

    `rollout_ids` (N,): rows with the same id are segments of one rollout (a trial whose context was compacted):
    the group's mean and std are taken over its rollouts, each counted once, and every segment gets its rollout's
    advantage. The segments of a rollout must carry the same reward and group. Without it each row is a rollout.
    """
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"{rewards.shape[0]} rewards but {len(group_ids)} group ids")
    if rollout_ids is not None and len(rollout_ids) != rewards.shape[0]:
        raise ValueError(f"{rewards.shape[0]} rewards but {len(rollout_ids)} rollout ids")
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for rows in _group_rows(group_ids).values():
        r = rewards[rows].float()  # (G,)
        if bool((r == r[0]).all()):
            continue
        index: dict[Hashable, int] = {}
        which = [index.setdefault(rollout_ids[i] if rollout_ids is not None else i, len(index)) for i in rows]
        u = torch.full((len(index),), float("nan"))  # (R,) one reward per rollout
        for k, w in enumerate(which):
            if u[w].isnan():
                u[w] = r[k]
            elif u[w] != r[k]:
                raise ValueError(f"rollout {rollout_ids[rows[k]]!r}: its segments carry different rewards")
        centered = u - u.mean()
        a = centered / (u.std(correction=0) + eps) if scale_by_std else centered  # (R,)
        adv[rows] = a[torch.tensor(which)]
    return adv


def zero_std_groups(rewards: torch.Tensor, group_ids: Sequence[Hashable]) -> list[Hashable]:
    """The groups whose rewards are all equal (no GRPO signal), in order of first appearance."""
    return [g for g, rows in _group_rows(group_ids).items() if bool((rewards[rows] == rewards[rows[0]]).all())]


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    aggregation: Literal["token", "sample"],
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    denominator: float | None = None,
    sample_tokens: torch.Tensor | None = None,
    dual_clip: float | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    mismatch_band: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clipped GRPO loss; returns (scalar loss, detached metrics).

    logprobs, old_logprobs, loss_mask, ref_logprobs, entropy: (B, T); advantages: (B,).
    aggregation `token`: sum over masked tokens / masked tokens in the batch; `sample`: per-sample masked mean,
    summed / samples. `denominator` overrides that count (masked tokens or samples of the *global* batch).
    `sample_tokens` (B,), for `sample`: what each row's token sum is divided by instead of its own masked count —
    the masked tokens of the row's whole rollout when a rollout is split into segments, so that a rollout
    weighs as one sample (pass the number of rollouts as `denominator`).
    Masked-out positions never reach the loss or its gradient, whatever their values.

    Off-policy correction: `dual_clip` (> 1) caps the loss of a token with a negative advantage at
    `-dual_clip * A`. `behaviour_logprobs` (B, T) are the engine's when `old_logprobs` are the trainer's: the
    per-token behaviour weight w = exp(old - behaviour) masks the token when it leaves
    [1 / mismatch_band, mismatch_band] and, capped at `tis_cap`, multiplies its policy-gradient loss (detached).
    """
    mask = loss_mask.bool()  # (B, T)
    adv = advantages.float()[:, None]  # (B, 1)
    behaviour_log_w = None
    if behaviour_logprobs is not None:  # (B, T): log(old / behaviour), the engine-vs-trainer mismatch
        behaviour_log_w = torch.where(mask, old_logprobs - behaviour_logprobs, 0.0).clamp(
            -_MAX_LOG_RATIO, _MAX_LOG_RATIO
        )
    in_band = mask
    if behaviour_log_w is not None and mismatch_band is not None:
        in_band = mask & (behaviour_log_w.abs() <= math.log(mismatch_band))
    trained = in_band  # (B, T): the tokens that reach the loss
    log_ratio = torch.where(trained, logprobs - old_logprobs, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()  # (B, T)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # (B, T)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -dual_clip * adv), per_token)
    if behaviour_log_w is not None and tis_cap is not None:
        per_token = per_token * behaviour_log_w.exp().clamp(max=tis_cap).detach()
    if ref_logprobs is not None and kl_coef > 0:
        d = torch.where(mask, ref_logprobs - logprobs, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        # k3: unbiased, always >= 0, low variance; capped (as verl does) so one far token cannot dominate the loss
        kl = (d.exp() - d - 1).clamp(max=_MAX_K3)
        per_token = per_token + kl_coef * kl
    per_token = torch.where(trained, per_token, 0.0)

    n_tok = trained.sum(-1)  # (B,)
    if aggregation == "token":
        total = per_token.sum()
        count = n_tok.sum().clamp(min=1)
    elif aggregation == "sample":
        per_row = n_tok if sample_tokens is None else sample_tokens.to(n_tok.device)
        total = (per_token.sum(-1) / per_row.clamp(min=1)).sum()
        count = (n_tok > 0).sum().clamp(min=1)
    else:
        raise ValueError(f"aggregation must be `token` or `sample`, got {aggregation!r}")
    loss = total / (count if denominator is None else denominator)

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        # the engine-vs-trainer mismatch: log(trainer / engine) on every token of the mask
        mismatch = (
            (logprobs - old_logprobs) if behaviour_logprobs is None else (old_logprobs - behaviour_logprobs)
        ).detach()
        gap = mismatch.abs()[mask]  # (M,)
        log_r = mismatch.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        mismatch_ratio = log_r.exp()
        metrics = {
            "n_tokens": trained.sum(),
            # tokens whose gradient the clip removed: ratio past the bound on the side the advantage pushes to
            "clip_frac_low": ((ratio < 1 - eps_low) & (adv < 0) & trained).sum() / n,
            "clip_frac_high": ((ratio > 1 + eps_high) & (adv > 0) & trained).sum() / n,
            "dual_clip_frac": ((ratio > (dual_clip or math.inf)) & (adv < 0) & trained).sum() / n,
            "logprob_gap_mean": gap.sum() / n,
            "logprob_gap_max": gap.max() if gap.numel() else gap.new_zeros(()),
            # k3 estimate of KL(engine || trainer) over the engine's own samples
            "mismatch_kl": torch.where(mask, mismatch_ratio - 1 - log_r, 0.0).sum() / n,
            "mismatch_ratio_max": mismatch_ratio[mask].max() if gap.numel() else gap.new_zeros(()),
            "mismatch_masked_frac": (mask & ~trained).sum() / n,
        }
        if ref_logprobs is not None and kl_coef > 0:
            metrics["kl"] = torch.where(mask, kl, 0.0).sum() / n
        if entropy is not None:
            metrics["entropy"] = torch.where(mask, entropy, 0.0).sum() / n
    return loss, metrics
