"""Retries of sandbox failures through the real trial runner, Harbor and the local sandbox (oracle agent)."""

import asyncio
import shutil

import pytest
from harbor.models.trial.config import AgentConfig

from grpoflow.config import parse_run_config
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials
from grpoflow.samples import select_trainable
from tests.fakes.prompts import builtin_prompts

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
    pytest.mark.usefixtures("faulty_sandbox"),
]


def _collect(tmp_path, prompts, retries, breaker=None, **sandbox_kwargs):
    cfg = parse_run_config(
        {
            "rollout": {
                "n_samples_per_prompt": 4,
                "concurrency": 8,
                "sandbox": {"retries": retries, "retry_backoff_s": 0.01, "breaker": breaker or {}},
            }
        }
    )
    retried = []
    res = asyncio.run(
        collect_step(
            "t",
            0,
            plan_group_trials(prompts, 0, cfg.rollout.n_samples_per_prompt, 0),
            cfg.rollout,
            PolicyAccess(lambda spec: AgentConfig(name="oracle")),
            sandbox_config(cfg.rollout, work_dir=str(tmp_path / "sb"), **sandbox_kwargs),
            tmp_path / "trials",
            tmp_path / "details",
            on_retry=lambda spec, att: retried.append(spec.rollout_id),
        )
    )
    return res, retried


def test_flaky_sandbox_start_is_retried_until_every_trial_finishes(tmp_path):
    (tmp_path / "sb").mkdir()
    res, retried = _collect(
        tmp_path,
        builtin_prompts("hello-file", "make-dir", "copy-file", "count-lines"),
        retries=8,
        fail_start_probability=0.3,
        fail_start_seed=11,
    )
    assert len(res.samples) == 16
    assert all(s.status == "COMPLETED" and s.reward == 1.0 for s in res.samples)
    assert res.figures.computed["retries"] == len(retried) > 0  # 30 % of starts fail: some trials needed retries
    assert res.figures.computed["trials_retried"] >= 1 and res.figures.computed["exit/Submitted"] == 16
    # Each failed attempt left its own trial dir; the retry ran in a fresh one.
    assert len(list((tmp_path / "trials").iterdir())) == 16 + len(retried)


def test_permanent_sandbox_failure_is_recorded_and_its_group_dropped(tmp_path):
    (tmp_path / "sb").mkdir()
    # Every start failing is what a provider outage looks like: the breaker (on by default) would wait it out
    # (tests/integration/faults/test_trial_faults.py). Off here: the trials' own retries are what is tested.
    never = {"failure_rate": 1.0}
    res, retried = _collect(tmp_path, builtin_prompts("hello-file"), 2, never, fail_start_probability=1.0)
    assert len(res.samples) == 4 and len(retried) == 4 * 2
    for s in res.samples:
        assert (s.status, s.exit_status, s.reward) == ("FAILED", "SandboxError", None)
        assert "SandboxStartError" in s.exit_reason and "after 2 retries" in s.exit_reason
    kept, dropped = select_trainable(res.samples, "drop_group")
    assert kept == [] and dropped == 1
    assert res.figures.computed["scored"] == 0 and res.figures.computed["exit/SandboxError"] == 4
