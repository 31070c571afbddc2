"""The engine and the trainer must score tokens alike: the PPO ratio and every correction rest on it.

`logprob_gap` has the engine sample a short reply to a fixed prompt at the run's sampling settings and scores the
same tokens with the trainer: the mean and largest |engine - trainer| logprob. A run checks it once the engine is
up and fails with one line naming the likely causes when it is too large (another dtype or model on the engine,
another temperature, top-p/top-k logprob semantics, a changed server flag), instead of training on ratios that
are noise.
"""

from __future__ import annotations

import torch

from grpoflow.config import RunConfig
from grpoflow.engine.client import EngineClient
from grpoflow.engine.protocol import SamplingParams
from grpoflow.errors import EngineError
from grpoflow.train.logprobs import token_logprobs
from grpoflow.train.trainer import TrainerState

PROBE_MESSAGES = [{"role": "user", "content": "Write one bash command that lists the files in /app."}]
PROBE_TOKENS = 64


def logprob_gap(client: EngineClient, state: TrainerState, cfg: RunConfig, seed: int = 0) -> dict[str, float]:
    """{mean, max} of |engine - trainer| logprob over a probe reply the engine samples."""
    r = cfg.rollout
    text = state.tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = state.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(
        max_new_tokens=PROBE_TOKENS, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, sampling_seed=seed
    )
    resp = client.generate(prompt, params, return_logprob=True)
    out = list(resp.output_ids)
    if not out:
        return {"mean": 0.0, "max": 0.0, "tokens": 0.0}
    ids = torch.tensor([prompt + out], device=state.device)  # (1, L)
    mask = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool, device=state.device)
    mask[0, len(prompt) - 1 :] = True  # position t scores token t + 1: the reply's tokens
    with torch.no_grad():
        trainer, _ = token_logprobs(state.model, ids, mask, state.autocast_dtype, r.temperature)
    gap = (trainer[mask].float().cpu() - torch.tensor(resp.logprobs)).abs()
    return {"mean": gap.mean().item(), "max": gap.max().item(), "tokens": float(len(out))}


def check_logprob_agreement(client: EngineClient, state: TrainerState, cfg: RunConfig) -> dict[str, float]:
    """`logprob_gap`, raising `EngineError` when its mean is beyond `train.max_probe_logprob_gap`."""
    gap = logprob_gap(client, state, cfg, seed=cfg.seed)
    limit = cfg.train.max_probe_logprob_gap
    if limit is not None and gap["mean"] > limit:
        raise EngineError(
            f"engine and trainer score the same {int(gap['tokens'])} tokens {gap['mean']:.3f} nats apart on "
            f"average (max {gap['max']:.3f}; train.max_probe_logprob_gap={limit}): check that the engine serves "
            "this model in the trainer's precision, samples at rollout.temperature, and returns the logprobs of "
            "the distribution it samples from (top-p/top-k, SGLANG_RETURN_ORIGINAL_LOGPROB)"
        )
    return gap
