"""Stability under an engine that scores tokens differently from the trainer: GRPO with and without correction.

    python bench/mismatch.py [--steps 6] [--noise 0.02] [--tail 0.005]

The learning task of the tests (the tiny random model learns to emit a target token), with the rollout logprobs
perturbed like a bf16 engine's (Gaussian noise of `--noise` nats on every token) and a heavier tail (a share
`--tail` of tokens the engine scored 3 to 10 nats below the trainer: ratios up to e^10). Side by side, one run
each from the same seeds: no correction, dual-clip (the default), recomputed old logprobs with truncated
importance weights, and with the mismatch band too. Prints the reward per step, the largest gradient norm before
clipping (spikes), the largest trainer/engine ratio seen, the reward rate after training and wall times beside a
baseline (tokens/s of the sampling loop on one thread).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpoflow.config import TrainConfig  # noqa: E402
from grpoflow.samples import Sample  # noqa: E402
from grpoflow.train.step import train_step  # noqa: E402
from grpoflow.train.trainer import load_trainer  # noqa: E402
from tests.fakes.tiny_model import build_tiny_model  # noqa: E402

VARIANTS = {  # train.loss settings
    "none": {"dual_clip": None},
    "dual-clip 3": {},
    "recompute + TIS 2": {"old_logprobs": "recompute"},
    "recompute + TIS + band 2": {"old_logprobs": "recompute", "mismatch_band": 2.0},
}
NEW_TOKENS, GROUPS, PER_GROUP = 8, 8, 8


def sample(model, prompt: list[int], n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestral sampling at temperature 1: (n, NEW_TOKENS) ids and the trainer's logprobs of them."""
    seq, lps = torch.tensor(prompt).repeat(n, 1), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logp = model(seq).logits[:, -1].float().log_softmax(-1)  # (n, V)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)  # (n, 1)
            lps.append(logp.gather(-1, nxt))
            seq = torch.cat([seq, nxt], 1)
    return seq[:, len(prompt) :], torch.cat(lps, 1)


def perturb(lps: torch.Tensor, noise: float, tail: float, gen: torch.Generator) -> torch.Tensor:
    """What a mismatched engine reports: Gaussian noise, and on a `tail` share of tokens 3-10 nats less."""
    out = lps + noise * torch.randn(lps.shape, generator=gen)
    hit = torch.rand(lps.shape, generator=gen) < tail
    return out - hit * (3 + 7 * torch.rand(lps.shape, generator=gen))


def run(model_dir: Path, overrides: dict, args) -> dict:
    cfg = TrainConfig(optimizer={"learning_rate": 3e-3, "max_grad_norm": 1.0}, loss=overrides)
    state = load_trainer(model_dir, cfg, seed=0)
    tok = state.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "List the files."}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    comp, _ = sample(state.model, prompt, 256, torch.Generator().manual_seed(1))
    target = max(comp.unique().tolist(), key=lambda t: (comp == t).any(1).float().mean().item())
    gen, noise_gen = torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)
    rewards, grad_norms, ratio_max, t0 = [], [], 0.0, time.perf_counter()
    for step in range(args.steps):
        samples = []
        for g in range(GROUPS):
            comp, lps = sample(state.model, prompt, PER_GROUP, gen)
            engine = perturb(lps, args.noise, args.tail, noise_gen)
            for i in range(PER_GROUP):
                tokens = prompt + comp[i].tolist()
                samples.append(
                    Sample(
                        run_id="bench",
                        step=step,
                        instance_id="t",
                        group_id=f"s{step}g{g}",
                        sample_index=i,
                        rollout_id=f"s{step}g{g}-{i}",
                        tokens=tokens,
                        loss_mask=[0] * len(prompt) + [1] * NEW_TOKENS,
                        rollout_logprobs=[0.0] * len(prompt) + engine[i].tolist(),
                        prompt_len=len(prompt),
                        reward=float(target in comp[i]),
                        status="COMPLETED",
                        exit_status="Submitted",
                    )
                )
        rewards.append(sum(s.reward for s in samples) / len(samples))
        m = train_step(state, samples, cfg, seed=step)
        grad_norms.append(m["grad_norm"])
        ratio_max = max(ratio_max, m["mismatch_ratio_max"])
    comp, _ = sample(state.model, prompt, 256, torch.Generator().manual_seed(123))
    after = (comp == target).any(1).float().mean().item()
    return {
        "rewards": rewards,
        "grad_max": max(grad_norms),
        "ratio_max": ratio_max,
        "after": after,
        "seconds": time.perf_counter() - t0,
    }


def baseline(model_dir: Path) -> float:
    """Tokens/s of the sampling loop (64 rows x 8 tokens) on this machine now."""
    state = load_trainer(model_dir, TrainConfig(), seed=0)
    t0 = time.perf_counter()
    sample(state.model, [1, 2, 3, 4], 64, torch.Generator().manual_seed(0))
    return 64 * NEW_TOKENS / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--noise", type=float, default=0.02, help="Gaussian noise on every engine logprob (nats)")
    ap.add_argument("--tail", type=float, default=0.005, help="share of tokens the engine scores 3-10 nats lower")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", seed=0)
        print(f"baseline: sampling loop {baseline(model_dir):.0f} tok/s on one thread")
        print(f"engine mismatch: N(0, {args.noise}) nats on every token, {args.tail:.1%} of tokens 3-10 nats lower")
        print(f"{'variant':<26} {'reward per step':<40} {'max grad norm':>13} {'max ratio':>10} {'after':>6} {'s':>5}")
        for name, overrides in VARIANTS.items():
            r = run(model_dir, overrides, args)
            curve = " ".join(f"{x:.2f}" for x in r["rewards"])
            print(
                f"{name:<26} {curve:<40} {r['grad_max']:>13.3f} {r['ratio_max']:>10.3g} {r['after']:>6.2f} "
                f"{r['seconds']:>5.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
