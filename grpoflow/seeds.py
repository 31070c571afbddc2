"""Every seed a run derives from its own (`RunConfig.seed`), in one place: a trial's, a turn's, a training step's
and a dynamic-sampling round's. Each is a function of the run seed and the place it seeds only, never of timing or
order, so a resumed or rerun run draws the same ones."""

from __future__ import annotations

import hashlib

SEED_RANGE = 2**31  # sampling seeds stay below it (SGLang and torch take them as int32 / int64)


def trial_seed(run_seed: int, step: int, prompt_index: int, sample: int) -> int:
    """Trial `sample` of the step's `prompt_index`-th prompt."""
    return (run_seed * 1_000_003 + step * 10_007 + prompt_index * 101 + sample) % SEED_RANGE


def turn_seed(trial: int, turn: int) -> int:
    """The sampling seed of a trial's turn (a policy call): distinct across the turns of a trial and across
    trials, whose seeds are neighbours (a group's samples differ by 1, so `seed + turn` would give trial k's
    second turn the noise of trial k + 1's first)."""
    digest = hashlib.sha256(f"{trial}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEED_RANGE


def step_seed(run_seed: int, step: int) -> int:
    """Training step `step`'s minibatch order and torch RNG: distinct per step."""
    return run_seed * 1_000_003 + step


def refill_seed(run_seed: int, step: int, round_: int) -> str:
    """Dynamic sampling's draw of new prompts in round `round_` of step `step` (a `random.Random` seed)."""
    return f"{run_seed}/{step}/{round_}"
