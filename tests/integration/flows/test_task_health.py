"""Task health across runs (`grpoflow tasks`): two nights of training in one output dir, the second on flaky
sandboxes; each task's pass rate per night, flags for tasks that never pass, infrastructure errors by provider,
and Harbor's regrade of stored trials at each run's end (`report.regrade_per_task`)."""

import shutil

import pytest

from flows.cli import main
from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.run.health import run_tasks, task_health
from grpoflow.run.regrade import read_regrades
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = [pytest.mark.flow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]


def test_two_nights_per_task_with_flags_and_infra_errors(tmp_path, tiny_model_dir, faulty_sandbox, capfd):
    model = fence_policy(tiny_model_dir, tmp_path / "policy")
    data = reward_tasks(tmp_path / "tasks")
    shutil.copytree(tmp_path / "tasks" / "make-ok-0", tmp_path / "tasks" / "never-ok")
    (tmp_path / "tasks" / "never-ok" / "instruction.md").write_text("Create the file /app/nothing.\n")
    (tmp_path / "tasks" / "never-ok" / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\necho 0 > /logs/verifier/reward.txt\n"
    )
    runs = tmp_path / "runs"
    for night, kwargs in (("night-1", {}), ("night-2", {"fail_start_probability": 0.2, "fail_start_seed": 5})):
        cfg = run_config(runs, model, data, night, steps=1)
        cfg["rollout"]["prompts_per_step"] = 3
        cfg["rollout"]["sandbox"] |= {"kwargs": kwargs, "retries": 0}
        cfg["report"] = {"regrade_per_task": 2}
        # never-ok is the task the dataset gate leaves out (its oracle scores 0): off here, as task health is
        # what flags such a task in runs made without the gate
        cfg["dataset"]["validate"] = False
        train_flow(parse_run_config(cfg))  # night 2's regrades meet failing sandbox starts too: the run still ends
    (runs / "not-a-run").mkdir()  # a stray dir is no run
    assert (runs / "night-1" / "tasks.json").is_file()  # each run's own counts, written as it ended
    for night in ("night-1", "night-2"):  # the file says what counting the samples again says
        assert run_tasks(runs / night) == run_tasks(runs / night, recount=True)
    # Every task's verifier reads only the workdir the trials recorded: each regrade gives the recorded verdict.
    night1 = read_regrades(runs / "night-1")
    assert {r.task for r in night1} == {"make-ok-0", "make-ok-1", "never-ok"} and len(night1) == 6
    assert all(r.regraded == r.recorded and r.error is None for r in night1)
    night2 = read_regrades(runs / "night-2")  # on failing sandbox starts: a row each, a reward or why there is none
    assert night2 and all((r.regraded is None) == (r.error is not None) for r in night2)
    assert not any(r.differs for r in night2)
    counted = run_tasks(runs / "night-2")[1].values()
    assert sum(c.regraded + c.regrade_failed for c in counted) == len(night2)
    (runs / "night-2" / "tasks.json").unlink()  # a run without them is counted from its samples
    run_ids, tasks = task_health(runs)
    assert run_ids == ["night-1", "night-2"]
    health = {t.task: t for t in tasks}
    assert set(health) == {"make-ok-0", "make-ok-1", "never-ok"}
    assert [r.run_id for r in health["never-ok"].runs] == ["night-1", "night-2"]
    assert health["never-ok"].flag == "always 0"
    assert all(t.regrades[0] == 0 and t.regrades[1] >= 2 for t in tasks)  # night 1's at least; none differed
    assert sum(r.passed for t in tasks for r in t.runs) > 0  # the fence policy solves the others at times
    infra = sum(n for t in tasks for n in t.infra_by_provider.values())
    assert infra > 0 and all(set(t.infra_by_provider) <= {"local"} for t in tasks)
    assert not any(r.infra_errors for t in tasks for r in t.runs if r.run_id == "night-1")
    capfd.readouterr()
    assert main(["tasks", "--output-dir", str(runs)]) == 0
    out = capfd.readouterr().out
    assert "| task | night-1 | night-2 | flag | regrades differing | infra errors |" in out
    assert "flaky verifier" not in out
    row = next(line for line in out.splitlines() if line.startswith("| never-ok |"))
    assert row.split(" | ")[1].startswith("0.00 (") and "always 0" in row
    assert main(["tasks", "--output-dir", str(tmp_path / "nowhere")]) == 2
    # By hand: regrade one stored trial per task of night 1 again; its tasks.json counts the new verdicts.
    assert main(["tasks", "--output-dir", str(runs), "--regrade", "night-1", "--per-task", "1"]) == 0
    out = capfd.readouterr().out
    assert (
        "grpoflow: run night-1: regraded 3 trials of 3 tasks: 0 gave another reward than the run recorded (no task), 0 gave none"
        in out
    )
    assert len(read_regrades(runs / "night-1")) == 3 and run_tasks(runs / "night-1")[1]["never-ok"].regraded == 1
    assert main(["tasks", "--output-dir", str(runs), "--regrade", "night-3"]) == 2
    assert "run dir" in capfd.readouterr().err
    assert main(["tasks", "--output-dir", str(runs), "--regrade", "../night-1"]) == 2
    assert "a run id is" in capfd.readouterr().err
    assert main(["tasks", "--output-dir", str(runs), "--per-task", "1"]) == 2
    assert "--per-task goes with --regrade" in capfd.readouterr().err
