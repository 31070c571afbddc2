"""The GRPO train step: samples -> advantages -> micro-batched forward/backward -> clipped AdamW step(s).

Layout: a `Sample`'s `tokens`, `loss_mask` and `rollout_logprobs` are aligned (length T); the model reads
`tokens[:-1]` and position t scores `tokens[t + 1]`, so training uses `loss_mask[1:]` and
`rollout_logprobs[1:]`.

Choices beyond the textbook step:
- weights are fp32 everywhere; on CUDA the backbone runs under bf16 autocast (pure bf16 AdamW would round away
  updates below the bf16 step of a weight, e.g. lr 1e-5 on a weight of 0.02);
- the LM head is applied only to trained positions (prompt, tool output and padding are never projected), in
  row chunks that keep no (N, V) logits alive: backward recomputes each chunk (`_TokenLogprobs`);
- sequences are right-padded and run without an attention mask: under causal attention, padding at the end
  cannot influence earlier positions, and SDPA keeps its fast is_causal path;
- an optimizer minibatch whose advantages are all zero is skipped (no forward, no `optimizer.step`): AdamW would
  still move the weights through weight decay and momentum. A KL term alone does not justify a step either.
  A minibatch whose gradient norm is not finite is skipped too (counted).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grpoflow.config import TrainConfig
from grpoflow.grpo import group_advantages, policy_loss, zero_std_groups
from grpoflow.samples import Sample

# Row chunk of the LM head: chunk * vocab fp32 logits = 64 MiB at most (341 rows for a 49k vocabulary).
_LOGIT_CHUNK_ELEMS = 1 << 24


@dataclass
class TrainerState:
    model: PreTrainedModel
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    ref_model: PreTrainedModel | None
    device: torch.device
    autocast_dtype: torch.dtype | None  # bf16 on CUDA, None (plain fp32) on CPU
    optimizer_steps: int = 0


def load_trainer(model_path: str | Path, cfg: TrainConfig, seed: int = 0, device: str | None = None) -> TrainerState:
    """Load the policy (and a frozen reference when `kl_coef > 0`) from an HF dir, with an AdamW over it.

    Determinism: on CPU, torch kernels are deterministic for a fixed thread count, so seeding is enough (steps
    from the same seed give bitwise-equal weights; tested). On CUDA, SDPA/matmul backward may use atomics:
    equal up to rounding, not bitwise.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(dev)
    disable_dropout(model)
    model.train()  # activation checkpointing only runs in training mode; dropout is off anyway
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable()
    ref = None
    if cfg.kl_coef > 0:
        ref_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # frozen: bf16 weights lose nothing
        ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=ref_dtype).to(dev).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return TrainerState(
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(model_path),
        optimizer=optimizer,
        ref_model=ref,
        device=dev,
        autocast_dtype=torch.bfloat16 if dev.type == "cuda" else None,
    )


def disable_dropout(model: torch.nn.Module) -> None:
    # Train-time logprobs must match the engine's (no dropout) or every ratio is noise.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T)[target] and the entropy, in row chunks: no (N, V) tensor outlives a chunk.

    Forward keeps hidden (N, H), targets (N,) and the log-normaliser (N,); backward recomputes each chunk's
    logits. The entropy output carries no gradient (it is a metric).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets):  # hidden (N, H), weight (V, H), targets (N,)
        ctx.set_materialize_grads(False)
        n, chunk = hidden.shape[0], max(1, _LOGIT_CHUNK_ELEMS // weight.shape[0])
        w = weight.float()  # the head runs in fp32 even under autocast: logprob ratios need the precision
        logp, entropy, log_z = (hidden.new_empty(n, dtype=torch.float32) for _ in range(3))
        for s in range(0, n, chunk):
            logits = hidden[s : s + chunk].float() @ w.T  # (C, V)
            m = logits.amax(-1, keepdim=True)
            e = (logits - m).exp_()
            z = e.sum(-1)  # (C,)
            log_z[s : s + chunk] = m.squeeze(-1) + z.log()
            logp[s : s + chunk] = logits.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - log_z[s : s + chunk]
            entropy[s : s + chunk] = log_z[s : s + chunk] - (e * logits).sum(-1) / z
        ctx.save_for_backward(hidden, weight, targets, log_z)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):  # grad_logp (N,)
        hidden, weight, targets, log_z = ctx.saved_tensors
        if grad_logp is None:
            return None, None, None
        n, chunk = hidden.shape[0], max(1, _LOGIT_CHUNK_ELEMS // weight.shape[0])
        w = weight.float()
        grad_h = torch.zeros_like(hidden, dtype=torch.float32)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        for s in range(0, n, chunk):
            h, g = hidden[s : s + chunk].float(), grad_logp[s : s + chunk].float()
            # d logp_target / d logits = onehot(target) - softmax: (C, V)
            grad_logits = (h @ w.T - log_z[s : s + chunk, None]).exp_().mul_(-g[:, None])
            grad_logits.scatter_add_(-1, targets[s : s + chunk, None], g[:, None])
            grad_h[s : s + chunk] = grad_logits @ w
            grad_w.addmm_(grad_logits.T, h)
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    autocast_dtype: torch.dtype | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of each next token where `mask` is set, zero elsewhere, under softmax(logits / T).

    input_ids (B, L) right-padded; mask (B, L - 1) bool: position t scores input_ids[:, t + 1].
    `temperature` is the rollout's sampling temperature: the policy that produced the tokens is softmax(logits / T)
    (and the engine reports logprobs of that distribution), so the PPO ratio is taken under the same T.
    Returns (logprobs (B, L - 1), entropy (B, L - 1)).
    """
    cfg = model.config.get_text_config()
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier"):
        if getattr(cfg, attr, None) not in (None, 1.0):
            raise NotImplementedError(f"{type(model).__name__}: `{attr}` on the logits is not supported")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError(f"{type(model).__name__}: an LM head with a bias is not supported")
    amp = torch.autocast(input_ids.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    with amp:
        hidden = model.base_model(input_ids=input_ids[:, :-1], use_cache=False).last_hidden_state  # (B, L-1, H)
    scale = 1.0 / temperature if temperature > 0 else 1.0  # T = 0 (greedy) has no distribution: score at T = 1
    # logits / T == (hidden / T) @ W.T: scaling the (M, H) rows is cheaper than the (M, V) logits
    logp, ent = _TokenLogprobs.apply(hidden[mask] * scale, head.weight, input_ids[:, 1:][mask])  # (M,), (M,)
    # masked_scatter keeps the graph connected even when M == 0
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=input_ids.device)
    return zeros.masked_scatter(mask, logp), zeros.masked_scatter(mask, ent.detach())


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


def _collate(samples: list[Sample], device: torch.device):
    """Right-padded (B, L) ids and the (B, L - 1) train mask / rollout logprobs, shifted to score tokens[1:]."""
    L = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), L, dtype=torch.long)  # pad id 0: never attended to by real tokens, never trained
    mask = torch.zeros(len(samples), L - 1, dtype=torch.bool)
    old = torch.zeros(len(samples), L - 1, dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens)
        mask[i, : n - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
        old[i, : n - 1] = torch.tensor(s.rollout_logprobs[1:])
    return ids.to(device), mask.to(device), old.to(device)


def _n_trained(s: Sample) -> int:
    return sum(s.loss_mask[1:])  # position 0 has no logprob: nothing predicts the first token


def backward_minibatch(
    state: TrainerState, samples: list[Sample], advantages: torch.Tensor, cfg: TrainConfig, temperature: float = 1.0
) -> dict[str, float]:
    """Forward/backward one optimizer minibatch in micro-batches, accumulating into `.grad` (no optimizer step).

    advantages (N,). Each micro-batch loss is divided by the minibatch's count (tokens or samples), so the
    accumulated gradient is that of the aggregation over the whole minibatch. The segments of one rollout
    (same `rollout_id`) count as one sample under `sample` aggregation: each is divided by the rollout's trained
    tokens and the count is of rollouts. (Under `token` aggregation nothing changes: tokens shared between
    segments are loss-masked in all but one, so every trained token counts once.)
    """
    rollout_tokens: dict[str, int] = {}
    for s in samples:
        rollout_tokens[s.rollout_id] = rollout_tokens.get(s.rollout_id, 0) + _n_trained(s)
    row_tokens = torch.tensor([rollout_tokens[s.rollout_id] for s in samples])  # (N,)
    denom = sum(map(_n_trained, samples)) if cfg.loss_aggregation == "token" else len(rollout_tokens)
    sums: dict[str, float] = {"loss": 0.0, "n_tokens": 0, "logprob_gap_max": 0.0}
    for idx in pack_micro_batches([len(s.tokens) for s in samples], cfg.micro_batch_tokens):
        ids, mask, old = _collate([samples[i] for i in idx], state.device)
        logp, ent = token_logprobs(state.model, ids, mask, state.autocast_dtype, temperature)  # (B, L-1)
        ref = None
        if state.ref_model is not None:
            with torch.no_grad():
                ref, _ = token_logprobs(state.ref_model, ids, mask, state.autocast_dtype, temperature)
        loss, m = policy_loss(
            logp, old, advantages[idx].to(state.device), mask, cfg.eps_low, cfg.eps_high, cfg.loss_aggregation,
            ref_logprobs=ref, kl_coef=cfg.kl_coef, entropy=ent, denominator=denom, sample_tokens=row_tokens[idx],
        )  # fmt: skip
        loss.backward()
        sums["loss"] += loss.item()
        n = int(m.pop("n_tokens"))
        sums["n_tokens"] += n
        sums["logprob_gap_max"] = max(sums["logprob_gap_max"], m.pop("logprob_gap_max").item())
        for k, v in m.items():  # token-weighted means across micro-batches
            sums[k] = sums.get(k, 0.0) + v.item() * n
        sums["n_forward_tokens"] = sums.get("n_forward_tokens", 0) + sum(len(samples[i].tokens) - 1 for i in idx)
        sums["n_micro_batches"] = sums.get("n_micro_batches", 0) + 1
    for k in ("clip_frac_low", "clip_frac_high", "logprob_gap_mean", "kl", "entropy"):
        if k in sums:
            sums[k] /= max(sums["n_tokens"], 1)
    return sums


def prepare_samples(samples: list[Sample], cfg: TrainConfig) -> tuple[list[Sample], torch.Tensor, dict[str, int]]:
    """Advantages per group, then the zero-std filter; returns (kept samples, their advantages (K,), counts)."""
    for s in samples:
        if s.status == "FAILED" or s.reward is None:
            raise ValueError(f"sample {s.rollout_id} (group {s.group_id}): status {s.status}, reward {s.reward}: "
                             "FAILED / unrewarded samples must be dropped before training")  # fmt: skip
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # (N,)
    group_ids = [s.group_id for s in samples]
    # a trial split into segments (context compaction) is one rollout: one slot in its group's statistics
    adv = group_advantages(rewards, group_ids, cfg.scale_by_std, rollout_ids=[s.rollout_id for s in samples])
    flat = set(zero_std_groups(rewards, group_ids))
    keep = [
        i for i, s in enumerate(samples)
        if _n_trained(s) > 0 and not (cfg.filter_zero_std and s.group_id in flat)
    ]  # fmt: skip
    counts = {"n_groups": len(set(group_ids)), "zero_std_groups": len(flat),
              "filtered_samples": len(samples) - len(keep)}
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
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    kept, adv, counts = prepare_samples(samples, cfg)
    minibatches = _rollout_minibatches(kept, cfg.global_batch_size, seed)
    params = [p for p in state.model.parameters() if p.requires_grad]
    if state.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(state.device)

    out: dict[str, float] = {"n_samples": 0, "n_tokens": 0, "n_forward_tokens": 0, "n_micro_batches": 0,
                             "optimizer_steps": 0, "skipped_zero_advantage": 0, "skipped_nonfinite": 0,
                             "logprob_gap_max": 0.0}  # fmt: skip
    # every key present even when nothing was trained (optimizer_steps 0 says so), for steady metric columns
    for k in ("loss", "grad_norm", "clip_frac_low", "clip_frac_high", "logprob_gap_mean", "entropy"):
        out[k] = 0.0
    means: dict[str, list[float]] = {}
    for idx in minibatches:
        if not bool(adv[idx].any()):
            out["skipped_zero_advantage"] += 1
            continue
        state.optimizer.zero_grad(set_to_none=True)
        m = backward_minibatch(state, [kept[i] for i in idx], adv[idx], cfg, temperature)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
        if not math.isfinite(grad_norm):
            out["skipped_nonfinite"] += 1
        else:
            state.optimizer.step()
            state.optimizer_steps += 1
            out["optimizer_steps"] += 1
        state.optimizer.zero_grad(set_to_none=True)
        out["n_samples"] += len(idx)
        out["n_tokens"] += m.pop("n_tokens")
        out["n_forward_tokens"] += m.pop("n_forward_tokens")
        out["n_micro_batches"] += m.pop("n_micro_batches")
        out["logprob_gap_max"] = max(out["logprob_gap_max"], m.pop("logprob_gap_max"))
        m["grad_norm"] = grad_norm
        for k, v in m.items():
            means.setdefault(k, []).append(v)
    out.update({k: sum(v) / len(v) for k, v in means.items()})
    out.update(counts)
    out["step_time_s"] = time.perf_counter() - t0
    out["tokens_per_s"] = out["n_forward_tokens"] / out["step_time_s"]
    if state.device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(state.device) / 2**30
    return out


OPTIMIZER_FILE = "optimizer.pt"  # AdamW state: a resumed run continues the same moments
TRAINER_FILE = "trainer.json"  # trainer counters
STEP_FILE = "step.json"  # the step's metrics + timings record; its presence marks a complete step


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: Any | None,
    out_dir: str | Path,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    counters: dict[str, Any] | None = None,
    step_record: dict[str, Any] | None = None,
    durable: bool = True,
) -> Path:
    """Write an HF dir (safetensors, config, tokenizer) atomically: a temp sibling renamed into place.

    With `optimizer`, `counters` and `step_record` the dir is the commit point of a training step: the optimizer
    state, the trainer counters and the step's record (`step.json`) land in the same rename as the weights, so a
    crash leaves either no checkpoint of the step or a complete one. Readers (the engine's weight update globs
    `*.safetensors`) never see a half-written dir. An existing `out_dir` (a retried step) is replaced.
    `durable` fsyncs the files before the rename (a power loss keeps them); off for checkpoints nothing resumes
    from.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    if counters is not None:
        (tmp / TRAINER_FILE).write_text(json.dumps(counters, indent=2) + "\n", encoding="utf-8")
    if step_record is not None:  # written last: the rename below publishes it with everything else
        (tmp / STEP_FILE).write_text(json.dumps(step_record) + "\n", encoding="utf-8")
    if durable:  # the rename is only as durable as the bytes it points at
        fsync_files(tmp)
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)
    if durable:
        fsync_path(out_dir.parent)
    return out_dir


def restore_training_state(state: TrainerState, ckpt: str | Path) -> dict[str, Any]:
    """Load a step checkpoint's weights, AdamW state and counters into `state` (a trainer from `load_trainer` on
    the same model); returns the counters. The model keeps its device and dtype (fp32)."""
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        weights.update(load_file(f, device=str(state.device)))
    # Tied weights (lm_head = embed_tokens) are saved once; strict=False lets the tie fill the other name.
    missing, unexpected = state.model.load_state_dict(weights, strict=False)
    params = state.model.state_dict(keep_vars=True)
    loaded = {params[n].data_ptr() for n in weights if n in params}
    untied = [n for n in missing if params[n].data_ptr() not in loaded]
    if unexpected or untied:
        raise ValueError(f"{ckpt}: weights do not match the model (missing {sorted(untied)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]})")  # fmt: skip
    state.optimizer.load_state_dict(torch.load(ckpt / OPTIMIZER_FILE, map_location=state.device, weights_only=True))
    counters = json.loads((ckpt / TRAINER_FILE).read_text(encoding="utf-8"))
    state.optimizer_steps = int(counters.get("optimizer_steps", 0))
    return counters


def fsync_files(folder: Path) -> None:
    for f in Path(folder).iterdir():
        fsync_path(f)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_of(path: Path) -> int | None:
    """N of a `step_<N>` checkpoint dir, else None."""
    name = path.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def prune_checkpoints(root: str | Path, latest: int) -> list[Path]:
    """Delete `root/step_<n>` dirs with n < latest that are not full checkpoints (no optimizer state); return
    the deleted paths.

    Full checkpoints (resume points) and the latest step are kept, and steps after `latest` are left alone.
    Leftover temp dirs of an interrupted `save_checkpoint` are removed too.
    """
    removed = []
    for p in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        n = step_of(p)
        stale_tmp = p.name.startswith(".step_") and (".tmp-" in p.name or ".old-" in p.name)
        if stale_tmp or (n is not None and n < latest and not (p / OPTIMIZER_FILE).is_file()):
            shutil.rmtree(p)
            removed.append(p)
    return removed
