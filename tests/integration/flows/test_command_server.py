"""The command line's own Prefect server (no server configured, a fresh PREFECT_HOME, as a newcomer runs it): the
one-line error of a failed flow, or the run's closing lines, are the last thing printed: the temporary server is
stopped before them, not after."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.prepare.dataset import builtin_dataset_path

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """No Prefect setting, a fresh HOME and PREFECT_HOME; unbuffered, so the combined output is in the order a
    terminal shows it."""
    home = tmp_path_factory.mktemp("home")
    (home / ".prefect").mkdir()
    plain = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return plain | {"HOME": str(home), "PREFECT_HOME": str(home / ".prefect"), "PYTHONUNBUFFERED": "1"}


def _cli(env, *args) -> tuple[int, list[str]]:
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    return out.returncode, [line for line in out.stdout.splitlines() if line.strip()]


def test_an_error_inside_a_flow_is_the_last_line(env, tmp_path, tiny_model_dir):
    data = tmp_path / "tasks"
    (data / "hello-file").mkdir(parents=True)
    (data / "hello-file" / "task.toml").write_text("[agent]\ntimeout_sec = inf\n")  # refused inside the flow
    rc, lines = _cli(
        env, "prepare", "--model", str(tiny_model_dir), "--dataset", str(data), "--output-dir", str(tmp_path / "r")
    )
    assert rc == 2, lines[-20:]
    assert lines[-1].startswith("grpoflow: error: ") and "`agent.timeout_sec` = inf" in lines[-1], lines[-5:]
    stopped = [i for i, line in enumerate(lines) if "Stopping temporary server" in line]
    assert stopped and stopped[-1] < len(lines) - 1, lines[-5:]  # it was started for the run, and stopped first


def test_a_finished_run_ends_with_its_artifacts(env, tmp_path, tiny_model_dir):
    rc, lines = _cli(
        env,
        "prepare",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(builtin_dataset_path()),
        "--run-id",
        "ok",
        "--output-dir",
        str(tmp_path / "r"),
    )
    assert rc == 0, lines[-20:]
    finished = next(i for i, line in enumerate(lines) if line.startswith("grpoflow: run ok finished"))
    assert all(line.startswith("  ") for line in lines[finished + 1 :]), lines[finished:]  # then only the listing
    assert not any("Stopping temporary server" in line for line in lines[finished:])
