"""Harbor's regrade of a run's stored trials, on the local sandbox: trials that recorded their task's workdir are
graded again in a fresh sandbox; a verifier that reads state the trial did not record gives another verdict and is
flagged in task health, a faithful one is not. The trials are Harbor's oracle agent's (no model)."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from harbor.models.trial.config import AgentConfig

from grpoflow.config import parse_run_config
from grpoflow.paths import RunPaths
from grpoflow.prepare.dataset import builtin_dataset_path, load_dataset
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials
from grpoflow.run.health import TaskHealth, health_markdown, run_tasks
from grpoflow.run.regrade import (
    StoredTrial,
    alternate,
    grader_noise,
    pick_trials,
    read_regrades,
    regrade_run,
    regrade_summary,
    regrade_trials,
    verdict_evaluations,
)
from grpoflow.scoring.evaluation import GraderNoise
from grpoflow.scoring.gate import run_gate
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
    for step, record in ((0, True), (1, False)):  # step 1 records no workdir: nothing there to regrade
        _oracle_trials(root, prompts, f"step_{step}", step, record)
    return root


def _oracle_trials(root, prompts, group: str, step: int, record: bool = True, n: int = 2) -> None:
    """`n` oracle trials of each prompt into the run dir's trial group `group` (`step_<k>` or `eval_<k>`)."""
    cfg = parse_run_config({"rollout": {"n_samples_per_prompt": n, "concurrency": 6}})
    asyncio.run(
        collect_step(
            "t",
            step,
            plan_group_trials(prompts, step, n, 0),
            cfg.rollout,
            PolicyAccess(lambda spec: AgentConfig(name="oracle")),
            sandbox_config(cfg.rollout),
            root / "trials" / group,
            root / "details" / group,
            record_workdir=record,
        )
    )


def test_regrade_flags_a_verifier_that_reads_unrecorded_state(run_root):
    recorded = run_root / "trials" / "step_0" / "hello-file__0__a0" / "artifacts"
    assert (recorded / "app" / "hello.txt").read_text().strip() == "hello"  # the workdir, kept by Harbor
    assert not (run_root / "trials" / "step_1" / "hello-file__0__a0" / "artifacts" / "app").exists()

    stored, unreadable = pick_trials(run_root, per_task=5)
    assert unreadable == []
    assert sorted((t.task, t.reward) for t in stored) == [
        ("hello-file", 1.0),
        ("hello-file", 1.0),
        ("reads-tmp", 1.0),
        ("reads-tmp", 1.0),
        ("unsolved", 0.0),
        ("unsolved", 0.0),
    ]
    assert {t.trial_dir.parent.name for t in stored} == {"step_0"}
    assert len(pick_trials(run_root, per_task=1)[0]) == 3

    regrades = asyncio.run(regrade_trials(run_root, stored, sandbox_config(parse_run_config({}).rollout), 4))
    by_task = {}
    for r in regrades:
        assert r.error is None, r
        by_task.setdefault(r.task, []).append((r.recorded, r.regraded, r.differs))
    assert by_task["hello-file"] == [(1.0, 1.0, False)] * 2  # the recorded /app is what the verifier reads again
    assert by_task["unsolved"] == [(0.0, 0.0, False)] * 2
    assert by_task["reads-tmp"] == [(1.0, 0.0, True)] * 2  # /tmp/solved was the agent's sandbox's, not recorded
    assert read_regrades(run_root) == regrades
    head, *rows = regrade_summary(regrades)  # what the flow's log and the CLI say
    assert head == "regraded 6 trials of 3 tasks: 2 gave another reward than the run recorded (reads-tmp), 0 gave none"
    assert sorted(rows) == [
        f"trials/step_0/reads-tmp__{k}__a0: recorded 1.0, regraded 0.0: reads-tmp's verifier is flaky or reads "
        "unrecorded state"
        for k in (0, 1)
    ]
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


def test_a_task_its_regrade_contradicted_is_left_out_by_the_next_gate_as_flaky(run_root, tmp_path):
    cfg, cache = parse_run_config({}), tmp_path / "cache"
    regrades = regrade_run(run_root, cfg, 2, cache_dir=cache)
    assert {r.task for r in regrades if r.differs} == {"reads-tmp"}
    report = run_gate(load_dataset(tmp_path / "tasks", local_sandbox=True), cfg.rollout, cache)
    verdicts = {t.name: t for t in report.tasks}
    assert (verdicts["reads-tmp"].verdict, verdicts["reads-tmp"].cached) == ("flaky", True)
    assert "scored 0.0 where the run recorded 1.0" in verdicts["reads-tmp"].reason
    assert verdicts["unsolved"].verdict == "oracle-fails" and not verdicts["unsolved"].cached
    assert report.trials_run == 3  # the unsolved task's alone: the flaky one came from the regrade


def test_trials_that_cannot_be_regraded_are_rows_with_why_never_verdicts(run_root, tmp_path):
    step0 = run_root / "trials" / "step_0"
    shutil.rmtree(step0 / "hello-file__0__a0" / "artifacts" / "app")  # the manifest still lists it
    (step0 / "hello-file__1__a0" / "result.json").write_text('{"task_name": "hel')  # cut off mid-write
    (step0 / "unsolved__0__a0" / "artifacts" / "manifest.json").write_text('{"not": "a list"}')
    changed = tmp_path / "tasks" / "reads-tmp" / "tests" / "test.sh"  # the task changed after the run
    changed.write_text(changed.read_text() + "# edited\n")
    stored, unreadable = pick_trials(run_root, per_task=2)
    assert [(r.task, r.trial, r.recorded, r.regraded) for r in unreadable] == [
        ("hello-file", "trials/step_0/hello-file__1__a0", None, None),
        ("unsolved", "trials/step_0/unsolved__0__a0", None, None),
    ]
    assert unreadable[0].error.startswith("ValidationError: ") and unreadable[1].error.startswith("AttributeError")
    regrades = asyncio.run(
        regrade_trials(run_root, stored, sandbox_config(parse_run_config({}).rollout), 4, unreadable)
    )
    rows = {r.trial.rsplit("/", 1)[1]: r for r in regrades}
    assert rows["hello-file__0__a0"].error.startswith("RegradeError: ") and "/app" in rows["hello-file__0__a0"].error
    for name in ("reads-tmp__0__a0", "reads-tmp__1__a0"):
        assert rows[name].error.startswith("TaskChangedError: ") and "changed since the trial" in rows[name].error
    assert rows["unsolved__1__a0"].regraded == 0.0 and rows["unsolved__1__a0"].error is None
    assert not any(r.differs for r in regrades) and read_regrades(run_root) == regrades
    _, counts = run_tasks(run_root, recount=True)
    assert {k: (c.regraded, c.regrade_differs, c.regrade_failed) for k, c in counts.items()} == {
        "hello-file": (0, 0, 2),
        "reads-tmp": (0, 0, 2),
        "unsolved": (1, 0, 1),
    }
    table = health_markdown(["run"], [TaskHealth(k, [c]) for k, c in counts.items()])
    assert "| hello-file | 1.00 (4) | always 1 | 0 of 0, 2 failed | - |" in table
    RunPaths(run_root).regrades.write_text('{"task": "x"}\n')
    with pytest.raises(ValueError, match=r"regrades.jsonl:1: not a regrade row"):
        read_regrades(run_root)


def test_a_task_dir_that_moved_gives_rows_with_why(run_root, tmp_path):
    shutil.move(tmp_path / "tasks" / "unsolved", tmp_path / "elsewhere")
    stored, unreadable = pick_trials(run_root, per_task=1)
    assert unreadable == [] and [t.task for t in stored] == ["hello-file", "reads-tmp", "unsolved"]
    regrades = asyncio.run(regrade_trials(run_root, stored, sandbox_config(parse_run_config({}).rollout), 4))
    assert [r.regraded for r in regrades] == [1.0, 0.0, None]
    assert regrades[2].error.startswith("FileNotFoundError: ") and "unsolved" in regrades[2].error


def test_the_verdicts_evaluations_are_regraded_whole_and_give_each_side_its_grader_noise(tmp_path):
    """The trained side's task has a verifier that gives its trials another verdict on regrade (it reads the
    agent's /tmp, never recorded): every regrade of its evaluation trials disagrees. The held-out side's verifier
    is deterministic: none does. Training trials count toward task health, not toward a row's noise."""
    trained = _variant(
        tmp_path,
        "reads-tmp",
        "echo hello > /app/hello.txt; touch /tmp/solved\n",
        "[ -f /app/hello.txt ] && [ -f /tmp/solved ] && r=1 || r=0; echo $r > /logs/verifier/reward.txt\n",
    ).model_copy(update={"split": "train"})
    heldout = builtin_prompts("hello-file")[0].model_copy(update={"split": "eval"})
    root = tmp_path / "run"
    root.mkdir()
    (root / "prompts.jsonl").write_text("".join(p.model_dump_json() + "\n" for p in (trained, heldout)))
    _oracle_trials(root, [trained, heldout], "step_0", 0)
    for version in (0, 1):
        _oracle_trials(root, [trained, heldout], f"eval_{version}", 10_000)
    assert verdict_evaluations(root) == {"eval_0", "eval_1"}

    stored, _ = pick_trials(root, per_task=1)
    groups = [t.trial_dir.parent.name for t in stored]
    assert sorted(groups) == ["eval_0"] * 4 + ["eval_1"] * 4 + ["step_0"] * 2  # the evaluations whole, 1 other a task
    regrades = regrade_run(root, parse_run_config({}), 1, cache_dir=tmp_path / "cache")
    assert all(r.error is None for r in regrades), regrades
    noise = grader_noise(regrades, [trained, heldout], verdict_evaluations(root))
    assert noise == {"trained": GraderNoise(4, 4), "heldout": GraderNoise(0, 4)}
    assert sum(r.differs for r in regrades) == 5  # the trained task's training trial too, for task health
    (root / "trials" / "eval_12").mkdir()  # a later evaluation: the verdict compares the first with it
    assert verdict_evaluations(root) == {"eval_0", "eval_12"}


def _stored(task: str, reward: float, n: int) -> StoredTrial:
    return StoredTrial(task, Path("/t"), Path(f"/run/trials/step_0/{task}__{n}__a0"), reward)


def test_picks_take_passes_and_failures_in_turn():
    trials = [_stored("t", r, n) for n, r in enumerate([1.0, 1.0, 1.0, 0.0, 0.5])]
    assert [(t.reward, t.trial_dir.name) for t in alternate(trials, 4)] == [
        (1.0, "t__0__a0"),
        (0.0, "t__3__a0"),
        (1.0, "t__1__a0"),
        (0.5, "t__4__a0"),
    ]
    assert [t.reward for t in alternate(trials, 1)] == [1.0]
    assert [t.reward for t in alternate(trials[:3], 3)] == [1.0, 1.0, 1.0]  # no failure: passes only
