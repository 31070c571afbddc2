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
- `LossInputs.denominator` lets a caller that splits a batch into micro-batches normalise every micro-batch by
  the global count, so the accumulated gradients equal those of the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the loss reads its settings' fields only: it runs where the config's dependencies do not
    from grpoflow.config import LossConfig

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


@dataclass
class LossInputs:
    """One micro-batch of the loss: B rows (samples), T positions (position t scores token t + 1)."""

    logprobs: torch.Tensor  # (B, T) the trainer's, with grad
    old_logprobs: torch.Tensor  # (B, T) the ratio's old policy: the engine's, or the trainer's recomputed
    advantages: torch.Tensor  # (B,)
    loss_mask: torch.Tensor  # (B, T) the generated tokens; masked-out positions never reach loss or gradient
    behaviour_logprobs: torch.Tensor | None = None  # (B, T) the engine's, when old_logprobs are recomputed
    ref_logprobs: torch.Tensor | None = None  # (B, T) the reference policy's (KL penalty)
    entropy: torch.Tensor | None = None  # (B, T) for the metrics only
    # `sample` aggregation: what each row's token sum is divided by instead of its own masked count (the trained
    # tokens of the row's whole rollout, when a rollout is split into segments, so a rollout weighs as one sample)
    sample_tokens: torch.Tensor | None = None  # (B,)
    # the count the sum is divided by (masked tokens or rollouts of the *global* batch), for micro-batches whose
    # accumulated gradients must equal the whole batch's; None: this micro-batch's own count
    denominator: float | None = None


def behaviour_log_weights(x: LossInputs) -> torch.Tensor | None:
    """(B, T) log(old / behaviour): the engine-vs-trainer mismatch when the old logprobs are the trainer's
    recomputed ones; None when the old policy is the engine itself."""
    if x.behaviour_logprobs is None:
        return None
    mask = x.loss_mask.bool()
    return torch.where(mask, x.old_logprobs - x.behaviour_logprobs, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def in_mismatch_band(
    mask: torch.Tensor, log_w: torch.Tensor | None, band: float | tuple[float, float] | None
) -> torch.Tensor:
    """(B, T) the tokens whose trainer/engine ratio lies in the band (IcePop): [1 / band, band] for a number, [low,
    high] for a pair; all of `mask` without one."""
    if log_w is None or band is None:
        return mask
    if isinstance(band, tuple):
        low, high = band
        return mask & (log_w >= math.log(low)) & (log_w <= math.log(high))
    return mask & (log_w.abs() <= math.log(band))


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """(B, T) PPO's pessimistic clipped loss, with the asymmetric clip range (DAPO's clip-higher) and dual-clip:
    past ratio `dual_clip` a token with a negative advantage keeps no gradient (verl's `clip_ratio_c`)."""
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if cfg.dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -cfg.dual_clip * adv), per_token)
    return per_token


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) Schulman's k3 estimate of KL(policy || reference): unbiased, >= 0, low variance; capped (as verl
    does) so one far token cannot dominate the loss."""
    d = torch.where(mask, ref_logprobs - logprobs, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (d.exp() - d - 1).clamp(max=_MAX_K3)


def aggregate(per_token: torch.Tensor, trained: torch.Tensor, x: LossInputs, how: str) -> torch.Tensor:
    """The scalar loss: `token`, the sum over trained tokens / their count; `sample`, each row's mean (over
    `sample_tokens` when given), summed / rows; either over `denominator` when given."""
    n_tok = trained.sum(-1)  # (B,)
    if how == "token":
        total, count = per_token.sum(), n_tok.sum().clamp(min=1)
    elif how == "sample":
        per_row = n_tok if x.sample_tokens is None else x.sample_tokens.to(n_tok.device)
        total, count = (per_token.sum(-1) / per_row.clamp(min=1)).sum(), (n_tok > 0).sum().clamp(min=1)
    else:
        raise ValueError(f"aggregation must be `token` or `sample`, got {how!r}")
    return total / (count if x.denominator is None else x.denominator)


def policy_loss(x: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one micro-batch (`cfg`: the clip range, dual-clip, the KL coefficient, the mismatch
    corrections, the aggregation); returns (scalar loss, detached metrics).

    With behaviour logprobs (recomputed old logprobs) the mismatch is corrected apart: tokens outside the band
    are masked, and the rest's loss is weighted by w = old / behaviour capped at `tis_cap` (truncated importance
    sampling, detached)."""
    mask = x.loss_mask.bool()  # (B, T)
    adv = x.advantages.float()[:, None]  # (B, 1)
    log_w = behaviour_log_weights(x)
    trained = in_mismatch_band(mask, log_w, cfg.mismatch_band)  # (B, T): the tokens that reach the loss
    log_ratio = torch.where(trained, x.logprobs - x.old_logprobs, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()  # (B, T)
    per_token = clipped_surrogate(ratio, adv, cfg)
    if log_w is not None and cfg.tis_cap is not None:
        per_token = per_token * log_w.exp().clamp(max=cfg.tis_cap).detach()
    kl = None
    if x.ref_logprobs is not None and cfg.kl_coef > 0:
        kl = k3_kl(x.logprobs, x.ref_logprobs, mask)
        per_token = per_token + cfg.kl_coef * kl
    per_token = torch.where(trained, per_token, 0.0)
    loss = aggregate(per_token, trained, x, cfg.loss_aggregation)
    return loss, _loss_metrics(x, cfg, mask, trained, ratio, adv, kl)


def _loss_metrics(x: LossInputs, cfg: LossConfig, mask, trained, ratio, adv, kl) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        # the engine-vs-trainer mismatch: log(trainer / engine) on every token of the mask
        behaviour = x.behaviour_logprobs
        mismatch = ((x.logprobs - x.old_logprobs) if behaviour is None else (x.old_logprobs - behaviour)).detach()
        gap = mismatch.abs()[mask]  # (M,)
        log_r = mismatch.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        mismatch_ratio = log_r.exp()
        metrics = {
            "n_tokens": trained.sum(),
            # tokens whose gradient the clip removed: ratio past the bound on the side the advantage pushes to
            "clip_frac_low": ((ratio < 1 - cfg.eps_low) & (adv < 0) & trained).sum() / n,
            "clip_frac_high": ((ratio > 1 + cfg.eps_high) & (adv > 0) & trained).sum() / n,
            "dual_clip_frac": ((ratio > (cfg.dual_clip or math.inf)) & (adv < 0) & trained).sum() / n,
            "logprob_gap_mean": gap.sum() / n,
            "logprob_gap_max": gap.max() if gap.numel() else gap.new_zeros(()),
            # k3 estimate of KL(engine || trainer) over the engine's own samples
            "mismatch_kl": torch.where(mask, mismatch_ratio - 1 - log_r, 0.0).sum() / n,
            "mismatch_ratio_max": mismatch_ratio[mask].max() if gap.numel() else gap.new_zeros(()),
            "mismatch_masked_frac": (mask & ~trained).sum() / n,
        }
        if kl is not None:
            metrics["kl"] = torch.where(mask, kl, 0.0).sum() / n
        if x.entropy is not None:
            metrics["entropy"] = torch.where(mask, x.entropy, 0.0).sum() / n
    return metrics
