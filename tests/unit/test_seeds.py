"""Every seed a run derives is a function of the run seed and its place only, and no two places share one."""

from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.trials import EVAL_SEED_STEP, plan_group_trials
from grpoflow.seeds import SEED_RANGE, derive, step_seed, turn_seed


def _prompts(n: int) -> list[PromptRecord]:
    return [PromptRecord(instance_id=f"t{i}", task_path=f"/tasks/t{i}", instruction="x") for i in range(n)]


def test_trial_seeds_of_large_steps_do_not_repeat():
    """300 prompts x 120 samples over 3 steps and an evaluation: the arithmetic mix this replaced repeated itself
    from 100 prompts a step (prompt * 101 reaches the next step's step * 10_007) or 101 samples a group, in
    thousands of trials; hashed seeds only meet by chance (about n^2 / 2^32 pairs) and never within a group."""
    prompts = _prompts(300)
    plans = [plan_group_trials(prompts, step, 120, 7) for step in (0, 1, 2, EVAL_SEED_STEP)]
    seeds = [s.seed for plan in plans for s in plan]
    assert len(seeds) - len(set(seeds)) <= 20 and all(0 <= s < SEED_RANGE for s in seeds)
    for plan in plans:
        groups: dict[str, set[int]] = {}
        for s in plan:
            groups.setdefault(s.group_id, set()).add(s.seed)
        assert all(len(g) == 120 for g in groups.values())
    old = [
        (7 * 1_000_003 + step * 10_007 + p * 101 + k) % SEED_RANGE
        for step in (0, 1, 2)
        for p in range(300)
        for k in range(120)
    ]
    assert len(old) - len(set(old)) > 10_000  # what the old mix did


def test_seeds_depend_on_the_run_seed_and_the_place_only():
    a = plan_group_trials(_prompts(3), 5, 4, seed := 11)
    assert [s.seed for s in a] == [s.seed for s in plan_group_trials(_prompts(3), 5, 4, seed)]
    assert {s.seed for s in a}.isdisjoint(s.seed for s in plan_group_trials(_prompts(3), 5, 4, seed + 1))
    assert [s.seed for s in a[4:8]] == [s.seed for s in plan_group_trials(_prompts(3)[1:], 5, 4, seed)[:4]]
    assert turn_seed(a[0].seed, 0) != turn_seed(a[0].seed, 1) != turn_seed(a[1].seed, 0)
    assert step_seed(seed, 0) != step_seed(seed, 1) and derive(seed, "step", 0) == step_seed(seed, 0)
