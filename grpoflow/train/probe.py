"""The engine and the trainer must score tokens alike: the PPO ratio and every correction rest on it.

`logprob_gap` has the engine sample a short reply to a fixed prompt at the run's sampling settings and scores the
same tokens with the trainer: the mean and largest |engine - trainer| logprob. A run checks it once the engine is
up and fails with one line naming the likely causes when it is too large (another dtype or model on the engine,
another temperature, top-p/top-k logprob semantics, a changed server flag), instead of training on ratios that
are noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpoflow.config import RunConfig
from grpoflow.engine.client import EngineClient
from grpoflow.engine.protocol import SamplingParams
from grpoflow.errors import EngineError
from grpoflow.train.fsdp import scored
from grpoflow.train.trainer import TrainerState

PROBE_MESSAGES = [{"role": "user", "content": "Write one bash command that lists the files in /app."}]
PROBE_TOKENS = 64


def _probe_reply(
    client: EngineClient, state: TrainerState, params: SamplingParams, temperature: float
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The engine's reply to the probe prompt under `params`: (reply ids, the engine's logprobs of them, the
    trainer's logprobs of them under softmax(logits / temperature)), logprobs (n,) on the CPU."""
    text = state.tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = state.tokenizer.encode(text, add_special_tokens=False)
    resp = client.generate(prompt, params, return_logprob=True)
    out = list(resp.output_ids)
    if not out:
        return [], torch.zeros(0), torch.zeros(0)
    ids = torch.tensor([prompt + out], device=state.device)  # (1, L)
    mask = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool, device=state.device)
    mask[0, len(prompt) - 1 :] = True  # position t scores token t + 1: the reply's tokens
    trainer = scored(state, ids, mask, temperature)  # a sharded policy's worker ranks join its gathers
    return out, torch.tensor(resp.logprobs, dtype=torch.float32), trainer[mask].float().cpu()


def logprob_gap(client: EngineClient, state: TrainerState, cfg: RunConfig, seed: int = 0) -> dict[str, float]:
    """{mean, max} of |engine - trainer| logprob over a probe reply the engine samples."""
    r = cfg.rollout
    params = SamplingParams(
        max_new_tokens=PROBE_TOKENS,
        temperature=r.sampling.temperature,
        top_p=r.sampling.top_p,
        top_k=r.sampling.top_k,
        sampling_seed=seed,
    )
    out, engine, trainer = _probe_reply(client, state, params, r.sampling.temperature)
    if not out:
        return {"mean": 0.0, "max": 0.0, "tokens": 0.0}
    gap = (trainer - engine).abs()
    return {"mean": gap.mean().item(), "max": gap.max().item(), "tokens": float(len(out))}


SYNC_PROBE_TOKENS = 16
# How many times the engine's own gap to the trainer a step must move the trainer's logprobs by before the probe
# can tell new weights from old ones (see `SyncProbe`).
NOISE_FACTOR = 4.0


@dataclass
class SyncProbe:
    """After every weight sync: proof that the engine serves the trainer's new weights, or the run fails.

    The engine answers the probe prompt greedily (logprobs at T = 1) and the trainer scores the same tokens. The
    engine must be within `limit` nats (mean) of the trainer's current weights; and when the trainer has moved
    since the last sync and the reply is the same tokens as then, the engine must not be clearly closer (half
    the distance or less) to the trainer's previous logprobs than to its current ones: that is an engine still
    serving the old weights (a sync it acknowledged but ignored). The second test asks only about a step that
    moved the trainer's logprobs by more than `NOISE_FACTOR` times the engine's gap at the last check: an engine
    serving in bfloat16 rounds a smaller update of the weights away, so it rightly still looks like the old ones.
    The first test bounds such an engine.
    """

    limit: float
    # per engine (base URL; replicas are checked one by one): (reply ids, the trainer's logprobs of them then),
    # the trainer's optimizer steps and the engine's gap to the trainer at the last check
    _last: dict[str, tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    _last_steps: dict[str, int] = field(default_factory=dict)
    _last_gap: dict[str, float] = field(default_factory=dict)

    def check(self, client: EngineClient, state: TrainerState, version: str) -> dict[str, float]:
        # ignore_eos: always SYNC_PROBE_TOKENS tokens to compare (an empty reply would prove nothing)
        params = SamplingParams(max_new_tokens=SYNC_PROBE_TOKENS, temperature=0.0, ignore_eos=True)
        ids, engine, trainer = _probe_reply(client, state, params, 1.0)
        gap = (engine - trainer).abs().mean().item() if ids else 0.0
        key = client.base_url
        last = self._last.get(key)
        moved = key in self._last_steps and state.optimizer_steps != self._last_steps[key]
        if moved and last is not None and last[0] == ids and ids:
            to_old = (engine - last[1]).abs().mean().item()
            step = (trainer - last[1]).abs().mean().item()  # how far the trainer's own logprobs moved
            if step > NOISE_FACTOR * self._last_gap[key] and to_old * 2 < gap:
                raise EngineError(
                    f"the engine still serves the old weights after the sync to version {version}: its logprobs "
                    f"of a probe reply are {to_old:.2e} nats from the trainer's before the update and {gap:.2e} "
                    "from its current ones (the engine acknowledged a sync it did not apply)"
                )
        if gap > self.limit:
            raise EngineError(
                f"after the sync to version {version} the engine's logprobs of a probe reply are {gap:.3f} nats "
                f"from the trainer's on average (train.max_probe_logprob_gap={self.limit}): the engine does not "
                "serve the trainer's weights"
            )
        self._last[key], self._last_steps[key], self._last_gap[key] = (ids, trainer), state.optimizer_steps, gap
        return {"probe_gap": gap}


def check_logprob_agreement(client: EngineClient, state: TrainerState, cfg: RunConfig) -> dict[str, float]:
    """`logprob_gap`, raising `EngineError` when its mean is beyond `train.max_probe_logprob_gap`."""
    gap = logprob_gap(client, state, cfg, seed=cfg.seed)
    limit = cfg.train.max_probe_logprob_gap
    if limit is not None and gap["mean"] > limit:
        raise EngineError(
            f"engine and trainer score the same {int(gap['tokens'])} tokens {gap['mean']:.3f} nats apart on "
            f"average (max {gap['max']:.3f}; train.max_probe_logprob_gap={limit}): check that the engine serves "
            "this model in the trainer's precision, samples at rollout.sampling.temperature, and returns the logprobs of "
            "the distribution it samples from (top-p/top-k, SGLANG_RETURN_ORIGINAL_LOGPROB)"
        )
    return gap
