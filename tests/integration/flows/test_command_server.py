"""The command line's own Prefect server (no server configured, a fresh PREFECT_HOME, as a newcomer runs it): the
one-line error of a failed flow, or the run's closing lines, are the last thing printed: the temporary server is
stopped before them, not after. A Prefect that cannot be had (a home that cannot be made, a configured API that does
not answer) is refused in one line before the flow starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.prepare.dataset import builtin_dataset_path
from grpoflow.sockets import free_port

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


def _prepare(env, tmp_path, model) -> tuple[int, list[str]]:
    args = ["--model", str(model), "--dataset", str(builtin_dataset_path()), "--output-dir", str(tmp_path / "r")]
    return _cli(env, "prepare", *args)


def test_a_home_that_does_not_exist_is_refused_in_one_line(env, tmp_path, tiny_model_dir):
    """HOME gone (a service account, a container): Prefect cannot make its home, and its temporary server would
    retry its database for minutes, a traceback per try. Refused before it starts."""
    home = tmp_path / "gone"
    rc, lines = _prepare(
        {k: v for k, v in env.items() if k != "PREFECT_HOME"} | {"HOME": str(home)}, tmp_path, tiny_model_dir
    )
    assert rc == 2, lines[-20:]
    assert lines[-1] == (
        f"grpoflow: error: PREFECT_HOME: Prefect's database dir {home}/.prefect cannot be written (No such file or "
        "directory); set PREFECT_HOME to a writable directory"
    ), lines[-5:]
    assert not any("Traceback" in line for line in lines), lines
    assert not home.exists() and not (tmp_path / "r").exists()


def test_a_prefect_api_that_does_not_answer_is_refused_in_one_line(env, tmp_path, tiny_model_dir):
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    rc, lines = _prepare(env | {"PREFECT_API_URL": url}, tmp_path, tiny_model_dir)
    assert rc == 2, lines[-20:]
    assert lines[-1].startswith(f"grpoflow: error: PREFECT_API_URL {url}: the Prefect API does not answer ("), lines
    assert lines[-1].endswith("or unset PREFECT_API_URL to let grpoflow start a temporary one"), lines[-1]
    assert not any("Traceback" in line for line in lines), lines
