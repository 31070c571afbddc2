"""Task health across runs (`grpoflow tasks`): two nights of training in one output dir, the second on flaky
sandboxes; each task's pass rate per night, flags for tasks that never pass, infrastructure errors by provider."""

import shutil

import pytest

from flows.cli import main
from flows.train import train_flow
from grpoflow.config import parse_run_config
from grpoflow.run.health import run_tasks, task_health
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
        cfg["rollout"] |= {"prompts_per_step": 3, "sandbox_kwargs": kwargs, "sandbox_retries": 0}
        train_flow(parse_run_config(cfg))
    (runs / "not-a-run").mkdir()  # a stray dir is no run
    assert (runs / "night-1" / "tasks.json").is_file()  # each run's own counts, written as it ended
    for night in ("night-1", "night-2"):  # the file says what counting the samples again says
        assert run_tasks(runs / night) == run_tasks(runs / night, recount=True)
    (runs / "night-2" / "tasks.json").unlink()  # a run without them is counted from its samples
    run_ids, tasks = task_health(runs)
    assert run_ids == ["night-1", "night-2"]
    health = {t.task: t for t in tasks}
    assert set(health) == {"make-ok-0", "make-ok-1", "never-ok"}
    assert [r.run_id for r in health["never-ok"].runs] == ["night-1", "night-2"]
    assert health["never-ok"].flag == "always 0"
    assert sum(r.passed for t in tasks for r in t.runs) > 0  # the fence policy solves the others at times
    infra = sum(n for t in tasks for n in t.infra_by_provider.values())
    assert infra > 0 and all(set(t.infra_by_provider) <= {"local"} for t in tasks)
    assert not any(r.infra_errors for t in tasks for r in t.runs if r.run_id == "night-1")
    capfd.readouterr()
    assert main(["tasks", "--output-dir", str(runs)]) == 0
    out = capfd.readouterr().out
    assert "| task | night-1 | night-2 | flag | infra errors |" in out
    row = next(line for line in out.splitlines() if line.startswith("| never-ok |"))
    assert row.split(" | ")[1].startswith("0.00 (") and "always 0" in row
    assert main(["tasks", "--output-dir", str(tmp_path / "nowhere")]) == 2
