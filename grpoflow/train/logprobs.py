"""Per-token logprobs of the policy, with the LM head applied only to trained positions.

Prompt, tool output and padding are never projected, and the head runs in row chunks that keep no (N, V)
logits alive: backward recomputes each chunk (`_TokenLogprobs`). Sequences are right-padded and run without an
attention mask: under causal attention, padding at the end cannot influence earlier positions, and SDPA keeps
its fast is_causal path.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import PreTrainedModel

# Row chunk of the LM head: chunk * vocab fp32 logits = 64 MiB at most (341 rows for a 49k vocabulary).
_LOGIT_CHUNK_ELEMS = 1 << 24


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


# A model's own entry to `token_logprobs`, when it has one: a sharded policy's (its FSDP hooks must run around the
# whole pass, LM head included: `grpoflow.train.fsdp`) or a LoRA policy seen with its adapters off (`lora.AdapterOff`).
OWN_LOGPROBS = "grpoflow_token_logprobs"


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
    own = getattr(model, OWN_LOGPROBS, None)
    if own is not None:
        return own(input_ids, mask, autocast_dtype, temperature)
    return plain_token_logprobs(model, input_ids, mask, autocast_dtype, temperature)


def plain_token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    autocast_dtype: torch.dtype | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` on the model's modules as they are (no entry of its own)."""
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


@torch.no_grad()
def check_logprob_path(model: PreTrainedModel, n_tokens: int = 16, atol: float = 1e-3) -> None:
    """Raise `NotImplementedError` unless `token_logprobs` (the backbone's last hidden state through the LM head)
    gives the model's own log-softmax: a model that transforms its logits in a way the attribute check above does
    not know (a multiplier, a soft cap, a bias) would otherwise train on other logprobs than it samples with."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, n_tokens), generator=torch.Generator().manual_seed(0)).to(model.device)
    mask = torch.ones(1, n_tokens - 1, dtype=torch.bool, device=model.device)
    ours, _ = token_logprobs(model, ids, mask)
    full = model(input_ids=ids[:, :-1], use_cache=False).logits.float().log_softmax(-1)  # (1, n - 1, V)
    theirs = full.gather(-1, ids[:, 1:, None]).squeeze(-1)
    gap = (ours - theirs).abs().max().item()
    if gap > atol:
        raise NotImplementedError(
            f"{type(model).__name__}: its logits are not the LM head of its last hidden state (logprobs {gap:.3g} "
            "apart on a probe): a logit transform grpoflow does not apply"
        )
