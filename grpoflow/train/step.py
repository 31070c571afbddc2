"""The GRPO train step: samples -> advantages -> micro-batched forward/backward -> clipped AdamW step(s).

Layout: a `Sample`'s `tokens`, `loss_mask` and `rollout_logprobs` are aligned (length T); the model reads
`tokens[:-1]` and position t scores `tokens[t + 1]`, so training uses `loss_mask[1:]` and
`rollout_logprobs[1:]`.

An optimizer minibatch whose advantages are all zero is skipped (no forward, no `optimizer.step`): AdamW would
still move the weights through weight decay and momentum. A KL term alone does not justify a step either. A
minibatch whose gradient norm is not finite, or whose every token fell outside `train.loss.mismatch_band`, is skipped
too (counted).
"""

from __future__ import annotations

import math
import time

import torch

from grpoflow.config import RunConfig, TrainConfig
from grpoflow.figures import Figures
from grpoflow.samples import Sample
from grpoflow.seeds import step_seed
from grpoflow.train.fsdp import clip_gradients, idle_pass, idle_passes, is_sharded, reduce_gradients_after
from grpoflow.train.grpo import LossInputs, group_advantages, policy_loss, zero_std_groups
from grpoflow.train.logprobs import token_logprobs
from grpoflow.train.parallel import all_reduce_grads, all_reduce_sums, local_rows
from grpoflow.train.trainer import TrainerState, use_activation_checkpointing


def pack_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group sample indices so that (rows * longest row) <= budget; a sample longer than the budget goes alone.

    Longest first, so rows of similar length share a micro-batch and little is padding.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _collate(samples: list[Sample], device: torch.device, old: list[torch.Tensor] | None = None):
    """Right-padded (B, L) ids, and the (B, L - 1) train mask, rollout (engine) logprobs and "old" logprobs,
    shifted to score tokens[1:]. `old` (one (len - 1,) tensor per sample) are the trainer's recomputed logprobs;
    without them the old logprobs are the rollout's."""
    L = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), L, dtype=torch.long)  # pad id 0: never attended to by real tokens, never trained
    mask = torch.zeros(len(samples), L - 1, dtype=torch.bool)
    behaviour = torch.zeros(len(samples), L - 1, dtype=torch.float32)
    recomputed = torch.zeros(len(samples), L - 1, dtype=torch.float32) if old is not None else None
    for i, s in enumerate(samples):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens)
        mask[i, : n - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
        behaviour[i, : n - 1] = torch.tensor(s.rollout_logprobs[1:])
        if recomputed is not None:
            recomputed[i, : n - 1] = old[i]
    behaviour = behaviour.to(device)
    return ids.to(device), mask.to(device), behaviour, (recomputed.to(device) if recomputed is not None else behaviour)


@torch.no_grad()
def recompute_old_logprobs(
    state: TrainerState, samples: list[Sample], cfg: TrainConfig, temperature: float = 1.0
) -> list[torch.Tensor]:
    """The trainer's logprobs of each sample's tokens before the update (len - 1 each, zero off the loss mask):
    the "old" policy of the PPO ratio when `train.loss.old_logprobs` is `recompute`."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    batches = pack_micro_batches([len(s.tokens) for s in samples], cfg.batch.micro_batch_tokens)
    idle = idle_passes(len(batches), state)  # before any pass: its all-reduce must pair with the other ranks'
    for idx in batches:
        ids, mask, _, _ = _collate([samples[i] for i in idx], state.device)
        logp, _ = token_logprobs(state.model, ids, mask, state.autocast_dtype, temperature)  # (B, L-1)
        for row, i in enumerate(idx):
            out[i] = logp[row, : len(samples[i].tokens) - 1].float().cpu()
    for _ in range(idle):  # a sharded model's gathers pair up across the ranks
        idle_pass(state, temperature, backward=False)
    return out  # type: ignore[return-value]


def _local(kept: list[Sample], idx: list[int], state: TrainerState) -> list[int]:
    """Positions in minibatch `idx` (indices into `kept`) of the rows this rank computes."""
    return local_rows([kept[i].rollout_id for i in idx], [len(kept[i].tokens) for i in idx], state.dp)


def _n_trained(s: Sample) -> int:
    return sum(s.loss_mask[1:])  # position 0 has no logprob: nothing predicts the first token


def backward_minibatch(
    state: TrainerState,
    samples: list[Sample],
    advantages: torch.Tensor,
    cfg: TrainConfig,
    temperature: float = 1.0,
    old: list[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Forward/backward one optimizer minibatch in micro-batches, accumulating into `.grad` (no optimizer step).

    advantages (N,). Each micro-batch loss is divided by the minibatch's count (tokens or samples), so the
    accumulated gradient is that of the aggregation over the whole minibatch. The segments of one rollout
    (same `rollout_id`) count as one sample under `sample` aggregation: each is divided by the rollout's trained
    tokens and the count is of rollouts. (Under `token` aggregation nothing changes: tokens shared between
    segments are loss-masked in all but one, so every trained token counts once.) `old`: the samples' recomputed
    logprobs (`recompute_old_logprobs`), with the rollout's as the behaviour policy to correct for.
    """
    rollout_tokens: dict[str, int] = {}
    for s in samples:
        rollout_tokens[s.rollout_id] = rollout_tokens.get(s.rollout_id, 0) + _n_trained(s)
    row_tokens = torch.tensor([rollout_tokens[s.rollout_id] for s in samples])  # (N,)
    # the whole minibatch's count on every rank: the ranks' gradients then sum to the single-process one
    denom = sum(map(_n_trained, samples)) if cfg.loss.loss_aggregation == "token" else len(rollout_tokens)
    sums: dict[str, float] = {"loss": 0.0, "n_tokens": 0, "n_mask_tokens": 0, **dict.fromkeys(_MAX_KEYS, 0.0)}
    sums |= {"n_forward_tokens": 0, "n_micro_batches": 0} | dict.fromkeys(_MEAN_KEYS + ("kl", "entropy"), 0.0)
    mine = local_rows([s.rollout_id for s in samples], [len(s.tokens) for s in samples], state.dp)
    batches = pack_micro_batches([len(samples[i].tokens) for i in mine], cfg.batch.micro_batch_tokens)
    idle = idle_passes(len(batches), state)  # before any pass: its all-reduce must pair with the other ranks'
    passes = len(batches) + idle  # the same on every rank
    for k, packed in enumerate(batches):
        idx = [mine[j] for j in packed]
        ids, mask, behaviour, old_lp = _collate(
            [samples[i] for i in idx], state.device, [old[i] for i in idx] if old is not None else None
        )
        with use_activation_checkpointing(state.model, ids.shape[1], cfg):
            logp, ent = token_logprobs(state.model, ids, mask, state.autocast_dtype, temperature)  # (B, L-1)
        ref = None
        if state.ref_model is not None:
            with torch.no_grad():
                ref, _ = token_logprobs(state.ref_model, ids, mask, state.autocast_dtype, temperature)
        inputs = LossInputs(
            logprobs=logp,
            old_logprobs=old_lp,
            advantages=advantages[idx].to(state.device),
            loss_mask=mask,
            behaviour_logprobs=behaviour if old is not None else None,
            ref_logprobs=ref,
            entropy=ent,
            sample_tokens=row_tokens[idx],
            denominator=denom,
        )
        loss, m = policy_loss(inputs, cfg.loss)
        reduce_gradients_after(state, cfg, last=k == passes - 1)
        loss.backward()
        sums["loss"] += loss.item()
        sums["n_tokens"] += int(m.pop("n_tokens"))
        n = int(mask.sum())
        sums["n_mask_tokens"] += n
        for k in _MAX_KEYS:
            sums[k] = max(sums[k], m.pop(k).item())
        for k, v in m.items():  # means over the loss-mask tokens across micro-batches
            sums[k] += v.item() * n
        sums["n_forward_tokens"] += sum(len(samples[i].tokens) - 1 for i in idx)
        sums["n_micro_batches"] += 1
    for k in range(len(batches), passes):  # a sharded model's collectives pair up across the ranks
        reduce_gradients_after(state, cfg, last=k == passes - 1)
        idle_pass(state, temperature, backward=True)
    sums = all_reduce_sums(sums, _MAX_KEYS, state.dp)
    for k in _MEAN_KEYS + ("kl", "entropy"):
        sums[k] /= max(sums["n_mask_tokens"], 1)
    del sums["n_mask_tokens"]
    if state.ref_model is None:
        del sums["kl"]
    return sums


_MAX_KEYS = ("logprob_gap_max", "mismatch_ratio_max")  # maxima over the step, not means
_MEAN_KEYS = (
    "clip_frac_low",
    "clip_frac_high",
    "dual_clip_frac",
    "logprob_gap_mean",
    "mismatch_kl",
    "mismatch_masked_frac",
)


def prepare_samples(samples: list[Sample], cfg: TrainConfig) -> tuple[list[Sample], torch.Tensor, dict[str, int]]:
    """Advantages per group, then the zero-std filter; returns (kept samples, their advantages (K,), counts)."""
    for s in samples:
        if s.status == "FAILED" or s.reward is None:
            raise ValueError(
                f"sample {s.rollout_id} (group {s.group_id}): status {s.status}, reward {s.reward}: "
                "FAILED / unrewarded samples must be dropped before training"
            )
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # (N,)
    group_ids = [s.group_id for s in samples]
    # a trial split into segments (context compaction) is one rollout: one slot in its group's statistics
    adv = group_advantages(rewards, group_ids, cfg.loss.scale_by_std, rollout_ids=[s.rollout_id for s in samples])
    flat = set(zero_std_groups(rewards, group_ids))
    keep = [
        i for i, s in enumerate(samples) if _n_trained(s) > 0 and not (cfg.loss.filter_zero_std and s.group_id in flat)
    ]
    kept = set(keep)
    counts = {
        "n_groups": len(set(group_ids)),
        "zero_std_groups": len(flat),
        "filtered_samples": len(samples) - len(keep),
        # the rollout ledger (grpoflow.ledger): tokens of the groups filtered out
        "discarded/zero_std_group": sum(_n_trained(s) for i, s in enumerate(samples) if i not in kept),
    }
    return [samples[i] for i in keep], adv[keep], counts


def _rollout_minibatches(kept: list[Sample], size: int | None, seed: int) -> list[list[int]]:
    """Sample indices per optimizer minibatch: rollouts in a seeded random order, `size` rollouts each (all when
    None). With one sample per rollout this is a seeded permutation of the samples cut every `size`."""
    rows: dict[str, list[int]] = {}
    for i, s in enumerate(kept):
        rows.setdefault(s.rollout_id, []).append(i)
    rollouts = list(rows.values())
    order = torch.randperm(len(rollouts), generator=torch.Generator().manual_seed(seed)).tolist()
    size = size or max(len(rollouts), 1)
    return [[i for r in order[start : start + size] for i in rollouts[r]] for start in range(0, len(rollouts), size)]


def train_step(
    state: TrainerState, samples: list[Sample], cfg: TrainConfig, seed: int, temperature: float = 1.0
) -> dict[str, float]:
    """One GRPO update on a rollout step's samples: one optimizer step per `global_batch_size` rollouts.

    `temperature` is the rollout's sampling temperature (logprobs are taken under softmax(logits / T)).

    Minibatches are drawn in a seeded random order when there are several; `global_batch_size` counts rollouts,
    and the segments of one rollout stay in one minibatch. Returns the step's metrics.
    """
    torch.manual_seed(seed)
    kept, adv, counts = prepare_samples(samples, cfg)
    minibatches = _rollout_minibatches(kept, cfg.batch.global_batch_size, seed)
    old = None
    if cfg.old_logprobs_mode() == "recompute" and kept:
        # only the rows this rank trains (all of them on one rank); the others stay None
        mine = sorted(idx[j] for idx in minibatches for j in _local(kept, idx, state))
        old = [None] * len(kept)
        for i, lp in zip(mine, recompute_old_logprobs(state, [kept[i] for i in mine], cfg, temperature), strict=True):
            old[i] = lp
    params = [p for p in state.model.parameters() if p.requires_grad]
    if state.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(state.device)

    out: dict[str, float] = {
        "n_samples": 0,
        "n_tokens": 0,
        "n_forward_tokens": 0,
        "n_micro_batches": 0,
        "optimizer_steps": 0,
        "skipped_zero_advantage": 0,
        "skipped_nonfinite": 0,
        "skipped_masked": 0,
        **dict.fromkeys(_MAX_KEYS, 0.0),
        # the rollout ledger (grpoflow.ledger): tokens an optimizer step used, and those it did not, by reason
        "tokens_trained": 0,
        "discarded/zero_advantage": 0,
        "discarded/nonfinite": 0,
        "discarded/mismatch_masked": 0,
    }
    # every key present even when nothing was trained (optimizer_steps 0 says so), for steady metric columns
    for k in ("loss", "grad_norm", *_MEAN_KEYS, "entropy"):
        out[k] = 0.0
    means: dict[str, list[float]] = {}
    for idx in minibatches:
        in_batch = sum(_n_trained(kept[i]) for i in idx)
        if not bool(adv[idx].any()):
            out["skipped_zero_advantage"] += 1
            out["discarded/zero_advantage"] += in_batch
            continue
        state.optimizer.zero_grad(set_to_none=True)
        m = backward_minibatch(
            state, [kept[i] for i in idx], adv[idx], cfg, temperature, [old[i] for i in idx] if old else None
        )
        if is_sharded(state.model):  # FSDP reduce-scattered the gradients into the shards during backward
            shards = [p for group in state.optimizer.param_groups for p in group["params"]]
            grad_norm = clip_gradients(shards, cfg.optimizer.max_grad_norm)
        else:
            all_reduce_grads(params, state.dp)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optimizer.max_grad_norm).item()
        if not math.isfinite(grad_norm):
            out["skipped_nonfinite"] += 1
            out["discarded/nonfinite"] += in_batch
        elif m["n_tokens"] == 0:  # every token outside the mismatch band: no gradient, and no decay/momentum step
            out["skipped_masked"] += 1
            out["discarded/mismatch_masked"] += in_batch
        else:
            state.optimizer.step()
            state.optimizer_steps += 1
            out["optimizer_steps"] += 1
            out["tokens_trained"] += m["n_tokens"]
            out["discarded/mismatch_masked"] += in_batch - m["n_tokens"]
        state.optimizer.zero_grad(set_to_none=True)
        out["n_samples"] += len(idx)
        out["n_tokens"] += m.pop("n_tokens")
        out["n_forward_tokens"] += m.pop("n_forward_tokens")
        out["n_micro_batches"] += m.pop("n_micro_batches")
        for k in _MAX_KEYS:
            out[k] = max(out[k], m.pop(k))
        m["grad_norm"] = grad_norm
        for k, v in m.items():
            means.setdefault(k, []).append(v)
    out.update({k: sum(v) / len(v) for k, v in means.items()})
    out.update(counts)
    if state.device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(state.device) / 2**30
    return out


def _turn_lengths(s: Sample) -> list[int]:
    """Lengths of the generated runs of a sample (its turns' outputs)."""
    runs, n = [], 0
    for m in s.loss_mask:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs + ([n] if n else [])


def overlong_penalty(s: Sample, max_new_tokens: int, cache: int) -> float:
    """DAPO's soft overlong penalty on the longest turn: 0 up to max_new_tokens - cache, then down linearly to
    -1 at max_new_tokens."""
    longest = max(_turn_lengths(s), default=0)
    return -min(max(longest - (max_new_tokens - cache), 0), cache) / cache


def shape_overlong(samples: list[Sample], cfg: RunConfig) -> tuple[list[Sample], dict[str, float]]:
    """`train.loss.truncated` applied to a step's trainable samples (copies; the journaled samples stay as they were):
    `mask` zeroes the loss mask of TRUNCATED ones, `penalize` adds `overlong_penalty` to every reward."""
    mode = cfg.train.loss.truncated
    if mode == "mask":
        out = [
            s.model_copy(update={"loss_mask": [0] * len(s.loss_mask)}) if s.status == "TRUNCATED" else s
            for s in samples
        ]
        return out, {"truncated_masked": float(sum(s.status == "TRUNCATED" for s in samples))}
    if mode == "penalize":
        limit = cfg.rollout.sampling.max_new_tokens
        cache = min(cfg.train.loss.overlong_cache or max(limit // 4, 1), limit)
        # one penalty per rollout (its longest turn in any segment): the segments of a rollout share one reward
        per_rollout: dict[str, float] = {}
        for s in samples:
            per_rollout[s.rollout_id] = min(per_rollout.get(s.rollout_id, 0.0), overlong_penalty(s, limit, cache))
        out = [
            s.model_copy(update={"reward": s.reward + per_rollout[s.rollout_id]}) if per_rollout[s.rollout_id] else s
            for s in samples
        ]
        return out, {"overlong_penalty_mean": sum(per_rollout.values()) / max(len(per_rollout), 1)}
    return samples, {}


def grpo_update(state: TrainerState, samples: list[Sample], cfg: RunConfig, step: int) -> Figures:
    """Step `step`'s GRPO update on its trainable samples: its metrics, and its seconds and forward tokens per
    second. With none (every group dropped) the weights stay as they are and the metrics, every key of them, say
    so (`n_samples` 0)."""
    t0 = time.perf_counter()
    masked = sum(_n_trained(s) for s in samples if s.status == "TRUNCATED") if cfg.train.loss.truncated == "mask" else 0
    samples, shaped = shape_overlong(samples, cfg)
    shaped["discarded/masked_overlong"] = masked  # their tokens left every loss (grpoflow.ledger)
    metrics = train_step(
        state, samples, cfg.train, seed=step_seed(cfg.seed, step), temperature=cfg.rollout.sampling.temperature
    )
    seconds = time.perf_counter() - t0
    return Figures(metrics | shaped, {"step_time_s": seconds, "tokens_per_s": metrics["n_forward_tokens"] / seconds})
