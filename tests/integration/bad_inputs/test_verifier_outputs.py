"""Broken verifiers in real trials (Harbor's `oracle` agent, the local bubblewrap sandbox): each trial is recorded
as FAILED with exit status VerifierError, a reason, and reward None — never 0 — and its group is left out of
training. One collect_step runs every case at once (module fixture)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from harbor.models.trial.config import AgentConfig

from grpoflow.config import parse_run_config
from grpoflow.prepare.dataset import load_task
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials
from grpoflow.samples import select_trainable

from .conftest import copy_task

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

_HEAD = "#!/bin/bash\nmkdir -p /logs/verifier\nrm -f /logs/verifier/reward.txt /logs/verifier/reward.json\n"

VERIFIERS = {
    # case -> body of tests/test.sh (runs after the oracle solved the task)
    "txt-not-a-number": "echo 'high' > /logs/verifier/reward.txt\n",
    "txt-empty": ": > /logs/verifier/reward.txt\n",
    "json-two-keys-no-reward": 'echo \'{"correct": 1, "style": 0}\' > /logs/verifier/reward.json\n',
    "json-non-numeric": 'echo \'{"reward": "lots"}\' > /logs/verifier/reward.json\n',
    "json-not-an-object": "echo '[1]' > /logs/verifier/reward.json\n",
    "crash-no-reward": "echo 'verifier blew up' >&2\nexit 1\n",
    "txt-nan": "echo nan > /logs/verifier/reward.txt\n",
    "txt-inf": "echo inf > /logs/verifier/reward.txt\n",
    "txt-two-numbers": "printf '1\\n0\\n' > /logs/verifier/reward.txt\n",
}
# The control: the unmodified verifier, which the oracle passes.
CONTROL = "ok-control"
# Accepted, documented: Harbor reads a JSON boolean as a number (true -> 1.0), as Python's bool is an int.
BOOL = "json-bool-reward"


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    root = tmp_path_factory.mktemp("verifiers")
    prompts = []
    for case, body in {
        CONTROL: None,
        BOOL: "echo '{\"reward\": true}' > /logs/verifier/reward.json\n",
        **VERIFIERS,
    }.items():
        task = copy_task(root / "tasks", "hello-file", as_name=case)
        if body is not None:
            (task / "tests" / "test.sh").write_text(_HEAD + body)
        prompts.append(PromptRecord(instance_id=case, task_path=str(task), instruction=load_task(task).instruction))
    cfg = parse_run_config(
        {"rollout": {"n_samples_per_prompt": 1, "concurrency": 8, "sandbox": {"retries": 1, "retry_backoff_s": 0.01}}}
    )
    res = asyncio.run(
        collect_step(
            "bad",
            0,
            plan_group_trials(prompts, 0, cfg.rollout.n_samples_per_prompt, 0),
            cfg.rollout,
            PolicyAccess(lambda spec: AgentConfig(name="oracle")),
            sandbox_config(cfg.rollout),
            root / "trials",
            root / "details",
        )
    )
    return {s.instance_id: s for s in res.samples}, res


@pytest.mark.parametrize("case", [CONTROL, BOOL])
def test_control_trials_score_one(outcome, case):
    samples, _ = outcome
    s = samples[case]
    assert (s.status, s.exit_status, s.reward) == ("COMPLETED", "Submitted", 1.0)


@pytest.mark.parametrize("case", list(VERIFIERS))
def test_broken_verifier_is_a_failed_verifier_error_never_zero(outcome, case):
    samples, _ = outcome
    s = samples[case]
    assert s.reward is None, f"{case}: scored {s.reward!r} ({s.exit_status}: {s.exit_reason})"
    assert (s.status, s.exit_status) == ("FAILED", "VerifierError"), (s.status, s.exit_status, s.exit_reason)
    assert s.exit_reason and "\n" not in s.exit_reason
    assert s.metrics["retries"] == 0  # a verifier failure is final, never retried as a sandbox fault


def test_failed_groups_are_dropped_and_samples_jsonl_records_them(outcome):
    samples, res = outcome
    kept, dropped = select_trainable(list(samples.values()), "drop_group")
    assert sorted(s.instance_id for s in kept) == sorted([CONTROL, BOOL])
    assert dropped == len(VERIFIERS)
    rows = [json.loads(line) for line in res.details_path.read_text().splitlines()]
    by_id = {r["instance_id"]: r for r in rows}
    assert by_id["crash-no-reward"]["reward"] is None and by_id["crash-no-reward"]["exit_status"] == "VerifierError"
    assert res.figures.computed["exit/VerifierError"] == len(VERIFIERS) and res.figures.computed["scored"] == 2
