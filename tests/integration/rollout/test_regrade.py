"""Harbor's regrade of a run's stored trials, on the local sandbox: trials that recorded their task's workdir are
graded again in a fresh sandbox; a verifier that reads state the trial did not record gives another verdict and is
flagged in task health, a faithful one is not. The trials are Harbor's oracle agent's (no model)."""

import asyncio
import json
import shutil

import pytest
from harbor.models.trial.config import AgentConfig

from grpoflow.config import parse_run_config
from grpoflow.prepare.dataset import builtin_dataset_path
from grpoflow.rollout.step import collect_step, sandbox_config
from grpoflow.run.health import TaskHealth, health_markdown, run_tasks
from grpoflow.run.regrade import REGRADES_FILE, pick_trials, read_regrades, regrade_trials
from tests.fakes.prompts import builtin_prompts

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def _variant(tmp_path, name: str, solve: str, verify: str):
    """hello-file under another name, with its own solution and verifier."""
    task = tmp_path / "tasks" / name
    shutil.copytree(builtin_dataset_path() / "hello-file", task)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve)
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nmkdir -p /logs/verifier\n" + verify)
    prompt = builtin_prompts("hello-file")[0]
    return prompt.model_copy(update={"instance_id": name, "task_path": str(task)})


@pytest.fixture
def run_root(tmp_path):
    """A run dir with one step of oracle trials of three tasks: hello-file (the built-in verifier), a verifier
    that also asks for a file outside the workdir (the agent's /tmp: never recorded), and a task never solved."""
    prompts = [
        *builtin_prompts("hello-file"),
        _variant(
            tmp_path,
            "reads-tmp",
            "echo hello > /app/hello.txt; touch /tmp/solved\n",
            "[ -f /app/hello.txt ] && [ -f /tmp/solved ] && r=1 || r=0; echo $r > /logs/verifier/reward.txt\n",
        ),
        _variant(
            tmp_path, "unsolved", "true\n", "[ -f /app/hello.txt ] && r=1 || r=0; echo $r > /logs/verifier/reward.txt\n"
        ),
    ]
    root = tmp_path / "run"
    root.mkdir()
    (root / "prompts.jsonl").write_text("".join(p.model_dump_json() + "\n" for p in prompts))
    cfg = parse_run_config({"rollout": {"n_samples_per_prompt": 2, "concurrency": 6}})
    for step, record in ((0, True), (1, False)):  # step 1 records no workdir: nothing there to regrade
        asyncio.run(
            collect_step(
                "t",
                step,
                prompts,
                cfg.rollout,
                0,
                lambda spec: AgentConfig(name="oracle"),
                sandbox_config(cfg.rollout),
                root / "trials" / f"step_{step}",
                root / "details" / f"step_{step}",
                record_workdir=record,
            )
        )
    return root


def test_regrade_flags_a_verifier_that_reads_unrecorded_state(run_root):
    recorded = run_root / "trials" / "step_0" / "hello-file__0__a0" / "artifacts"
    assert (recorded / "app" / "hello.txt").read_text().strip() == "hello"  # the workdir, kept by Harbor
    assert not (run_root / "trials" / "step_1" / "hello-file__0__a0" / "artifacts" / "app").exists()

    stored = pick_trials(run_root, per_task=5)
    assert sorted((t.task, t.reward) for t in stored) == [
        ("hello-file", 1.0),
        ("hello-file", 1.0),
        ("reads-tmp", 1.0),
        ("reads-tmp", 1.0),
        ("unsolved", 0.0),
        ("unsolved", 0.0),
    ]
    assert {t.trial_dir.parent.name for t in stored} == {"step_0"}
    assert len(pick_trials(run_root, per_task=1)) == 3

    regrades = asyncio.run(regrade_trials(run_root, stored, sandbox_config(parse_run_config({}).rollout), 4))
    by_task = {}
    for r in regrades:
        assert r.error is None, r
        by_task.setdefault(r.task, []).append((r.recorded, r.regraded, r.differs))
    assert by_task["hello-file"] == [(1.0, 1.0, False)] * 2  # the recorded /app is what the verifier reads again
    assert by_task["unsolved"] == [(0.0, 0.0, False)] * 2
    assert by_task["reads-tmp"] == [(1.0, 0.0, True)] * 2  # /tmp/solved was the agent's sandbox's, not recorded
    assert read_regrades(run_root) == regrades
    # Harbor's own regrade trial dirs, beside the run's; the source trials are left as they were.
    assert (run_root / "regrade" / "trials" / "step_0" / "hello-file__0__a0" / "result.json").is_file()
    source = json.loads((run_root / "trials" / "step_0" / "reads-tmp__0__a0" / "result.json").read_text())
    assert source["verifier_result"]["rewards"] == {"reward": 1.0}

    _, counts = run_tasks(run_root, recount=True)
    assert {k: (c.regraded, c.regrade_differs) for k, c in counts.items()} == {
        "hello-file": (2, 0),
        "reads-tmp": (2, 2),
        "unsolved": (2, 0),
    }
    health = {k: TaskHealth(k, [c]) for k, c in counts.items()}
    assert health["reads-tmp"].flag == "always 1, flaky verifier"
    assert health["unsolved"].flag == "always 0" and health["hello-file"].flag == "always 1"
    table = health_markdown(["run"], list(health.values()))
    assert "| reads-tmp | 1.00 (4) | always 1, flaky verifier | 2 of 2 | - |" in table
    assert "| hello-file | 1.00 (4) | always 1 | 0 of 2 | - |" in table


def test_a_trial_whose_record_is_gone_is_reported_not_graded(run_root):
    stored = [t for t in pick_trials(run_root, per_task=1) if t.task == "hello-file"]
    shutil.rmtree(stored[0].trial_dir / "artifacts" / "app")  # the manifest still lists it
    (r,) = asyncio.run(regrade_trials(run_root, stored, sandbox_config(parse_run_config({}).rollout), 1))
    assert r.regraded is None and not r.differs
    assert r.error.startswith("RegradeError: ") and "/app" in r.error
    assert (run_root / REGRADES_FILE).read_text().count("\n") == 1
    _, counts = run_tasks(run_root, recount=True)
    assert counts["hello-file"].regraded == 0  # no verdict: neither agreeing nor differing
