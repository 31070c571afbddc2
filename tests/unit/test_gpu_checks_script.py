"""bench/gpu_checks.sh, the one command a session with a GPU runs, on the CPU (`--cpu`): each check runs its CPU
path, leaves its report and its RESULT as JSON, and a failing check is counted in the exit status."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, python):
    env = {**os.environ, "PYTHON": python}
    return subprocess.run(
        [str(REPO / "bench/gpu_checks.sh"), "--cpu", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_check_leaves_its_report_and_result(tmp_path):
    proc = _run(tmp_path, sys.executable)
    assert proc.returncode == 0, proc.stdout[-2000:]
    update = json.loads((tmp_path / "fsdp_update.json").read_text())
    assert update["precision"] == "bf16" and update["grad_norm"] > 0
    step = json.loads((tmp_path / "train_step.json").read_text())
    assert step["dry_run"] is True and step["optimizer_steps"] == 1
    assert json.loads((tmp_path / "gpu_plan.json").read_text()) == {"gpus": 0, "trainer": [], "engine": []}
    assert "== 0 check(s) failed" in proc.stdout


def test_every_failing_check_is_counted_and_leaves_its_log(tmp_path):
    # a python that does not exist: each check fails in turn, and none stops the ones after it
    proc = _run(tmp_path, str(tmp_path / "no-such-python"))
    assert proc.returncode == 3, proc.stdout[-2000:]
    assert "== 3 check(s) failed" in proc.stdout and {p.name for p in tmp_path.glob("*.log")} == {
        "fsdp_update.log",
        "train_step.log",
        "gpu_plan.log",
    }


def test_a_check_that_exits_0_without_its_result_is_a_failure(tmp_path):
    proc = _run(tmp_path, "/bin/true")
    assert proc.returncode == 3, proc.stdout[-2000:]
    assert proc.stdout.count("exited 0 without a RESULT line") == 3 and not list(tmp_path.glob("*.json"))
