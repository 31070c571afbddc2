"""Dynamic sampling (DAPO): groups without a GRPO signal are replaced by new prompts' groups, bounded, counted,
through the real trial runner, Harbor and the local sandbox. Harbor's oracle agent solves a task, its nop agent
does nothing (reward 0), so which groups carry a signal is chosen per prompt."""

import asyncio
import shutil

import pytest
from harbor.models.trial.config import AgentConfig

from grpoflow.config import parse_run_config
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import GroupRefill, collect_step, informative_groups
from grpoflow.rollout.trials import plan_group_trials
from tests.fakes.prompts import builtin_prompts
from tests.fakes.samples import make_sample

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

FLAT = {"hello-file", "make-dir", "copy-file", "touch-done"}  # every trial solved: rewards all 1, no signal


def _agent(spec):
    # sample 0 of every group solves its task; the others solve only FLAT tasks
    return AgentConfig(name="oracle" if spec.instance_id in FLAT or spec.sample_index == 0 else "nop")


def _collect(tmp_path, step_prompts, pool, rounds):
    cfg = parse_run_config({"rollout": {"n_samples_per_prompt": 2, "concurrency": 8, "refill_rounds": rounds}})
    refill = GroupRefill(
        pool=pool,
        used=list(step_prompts),
        target=len(step_prompts),
        max_rounds=rounds,
        n_samples=2,
        seed=5,
        step=3,
    )
    (tmp_path / "sb").mkdir(parents=True, exist_ok=True)
    res = asyncio.run(
        collect_step(
            "t",
            3,
            plan_group_trials(step_prompts, 3, cfg.rollout.n_samples_per_prompt, 5),
            cfg.rollout,
            PolicyAccess(_agent),
            sandbox_config(cfg.rollout, work_dir=str(tmp_path / "sb")),
            tmp_path / "trials",
            tmp_path / "details",
            refill=refill,
        )
    )
    return res, refill


@needs_bwrap
def test_flat_groups_are_refilled_from_new_prompts_until_the_step_has_its_informative_groups(tmp_path):
    step_prompts = builtin_prompts("hello-file", "answer-42")  # one flat group, one with a signal
    pool = builtin_prompts("hello-file", "answer-42", "make-dir", "count-lines", "sort-lines")
    res, refill = _collect(tmp_path, step_prompts, pool, rounds=4)
    groups = {s.group_id for s in res.samples}
    assert informative_groups(res.samples, "drop_group") and res.figures.computed["informative_groups"] == 2.0
    # one prompt was missing: each round asks for exactly the missing number, so a flat draw (make-dir) takes
    # another round; the step never trains more groups than it asked for
    assert res.figures.computed["refill_groups"] == res.figures.computed["refill_rounds"] == len(groups) - 2 >= 1
    assert len(res.samples) == 2 * len(groups) and res.figures.computed["trials"] == len(res.samples)
    assert len({s.rollout_id for s in res.samples}) == len(res.samples)  # no refill trial collides

    # the same step again (a resume): the journal gives back every trial, none runs again
    before = sorted(p.name for p in (tmp_path / "trials").iterdir())
    again, _ = _collect(tmp_path, step_prompts, pool, rounds=4)
    assert sorted(p.name for p in (tmp_path / "trials").iterdir()) == before
    assert [s.rollout_id for s in again.samples] == [s.rollout_id for s in res.samples]


@needs_bwrap
def test_refill_stops_after_its_rounds_and_when_the_pool_runs_out(tmp_path):
    step_prompts = builtin_prompts("hello-file")
    res, refill = _collect(tmp_path / "a", step_prompts, builtin_prompts(*sorted(FLAT)), rounds=2)
    assert (res.figures.computed["refill_rounds"], res.figures.computed["informative_groups"], len(res.samples)) == (
        2.0,
        0.0,
        6,
    )

    res, _ = _collect(tmp_path / "b", step_prompts, builtin_prompts("hello-file", "make-dir"), rounds=5)
    assert (res.figures.computed["refill_rounds"], res.figures.computed["refill_groups"], len(res.samples)) == (
        1.0,
        1.0,
        4,
    )


def _sample(group, k, reward, status="COMPLETED"):
    return make_sample(group, k, reward, status, tokens=[1, 2], logprobs=[0.0, -1.0])


def test_a_group_with_a_failed_trial_is_informative_only_when_it_is_kept():
    samples = [_sample("g", 0, 1.0), _sample("g", 1, 0.0), _sample("g", 2, None, "FAILED"), _sample("h", 0, 1.0)]
    assert informative_groups(samples, "drop_group") == set()
    assert informative_groups(samples, "keep_group") == {"g"}


def test_refill_plans_are_seeded_and_continue_the_step_plan():
    pool = builtin_prompts("hello-file", "answer-42", "make-dir", "count-lines", "sort-lines", "copy-file")
    plans = []
    for _ in range(2):
        r = GroupRefill(pool=pool, used=pool[:2], target=2, max_rounds=3, n_samples=2, seed=1, step=0)
        plans.append(r([_sample("step0-hello-file", 0, 1.0), _sample("step0-hello-file", 1, 1.0)]))
    assert [s.rollout_id for s in plans[0]] == [s.rollout_id for s in plans[1]]  # same draw each time
    assert len(plans[0]) == 2 * 2  # nothing informative yet: both groups are replaced
    assert {s.instance_id for s in plans[0]}.isdisjoint({"hello-file", "answer-42"})
    assert all(s.group_id.startswith("step0-") for s in plans[0])
    step_seeds = {s.seed for s in plan_group_trials(pool[:2], 0, 2, 1)}
    assert step_seeds.isdisjoint(s.seed for s in plans[0]) and len({s.seed for s in plans[0]}) == 4
