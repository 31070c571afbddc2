"""Every seed a run derives from its own (`RunConfig.seed`), in one place and by one rule: a hash of the run seed
and the place it seeds (`derive`). A function of those only, never of timing or order, so a resumed or rerun run
draws the same ones; and a hash, so no two places collide however many prompts, samples or steps a run has (an
arithmetic mix such as `seed * 1_000_003 + step * 10_007 + prompt * 101 + sample` repeats itself once a step has
100 prompts or a group 101 samples)."""

from __future__ import annotations

import hashlib

SEED_RANGE = 2**31  # sampling seeds stay below it (SGLang and torch take them as int32 / int64)


def derive(*parts: object) -> int:
    """A seed in [0, 2**31) from the parts that name what it seeds, e.g. (run seed, "trial", step, prompt, sample)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEED_RANGE


def trial_seed(run_seed: int, step: int, instance_id: str, sample: int) -> int:
    """Trial `sample` of task instance `instance_id` in step `step`: the same trial wherever the prompt stands in
    the step's list (a refill round's, a resumed step's)."""
    return derive(run_seed, "trial", step, instance_id, sample)


def turn_seed(trial: int, turn: int) -> int:
    """The sampling seed of a trial's turn (a policy call): distinct across the turns of a trial and across
    trials."""
    return derive(trial, "turn", turn)


def step_seed(run_seed: int, step: int) -> int:
    """Training step `step`'s minibatch order and torch RNG."""
    return derive(run_seed, "step", step)


def refill_seed(run_seed: int, step: int, round_: int) -> int:
    """Dynamic sampling's draw of new prompts in round `round_` of step `step`."""
    return derive(run_seed, "refill", step, round_)
