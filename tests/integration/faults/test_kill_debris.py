"""`kill -9` of `grpoflow main` mid-run leaves nothing behind: no process (Prefect's temporary server, the engine,
a sandbox) and no sandbox dir, 10 s later. At three points: while the model is prepared, in a trial whose sandbox
runs a command, in the GRPO update. SIGTERM, which the command can answer, leaves nothing either, and its last line
says what stopped it (and, for a train run, how to continue it): of `grpoflow main` and of the dataset gate.

The run is the real command line with no Prefect server configured (a fresh PREFECT_HOME), so it starts Prefect's
temporary server itself, as a newcomer's run does. It runs under a subreaper (tests/fakes/reaper.py): whatever it
leaves is reparented there, not to init, and is listed. tests/integration/faults/pause_at.py holds it at the point;
only the main process is killed, as `kill -9 <pid>` does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpoflow.paths import RunPaths
from grpoflow.run.info import read_run_info
from tests.fakes.proc import alive, descendants
from tests.integration.faults.policy import fence_policy, reward_tasks, run_config

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")]

REPO = Path(__file__).resolve().parents[3]
LINGER_S = 10  # what the issue allows a dead run's leftovers


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    base = tmp_path_factory.mktemp("debris")
    home = base / "home"
    (home / ".prefect").mkdir(parents=True)  # one fresh PREFECT_HOME: its database is made by the first run
    return base, fence_policy(tiny_model_dir, base / "policy"), reward_tasks(base / "tasks"), home


def _cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


# What runs below `grpoflow main` at each point: the test is only as good as what there is to leave behind.
RUNNING = {
    "prepare": ["prefect.server.api.server:create_app"],
    "rollout": ["prefect.server.api.server:create_app", "grpoflow.embedded.engine.server", "bwrap", "sleep 3600"],
    "update": ["prefect.server.api.server:create_app", "grpoflow.embedded.engine.server"],
}


def _env(home: Path) -> dict[str, str]:
    """This environment with no Prefect setting, HOME and PREFECT_HOME in the setup's fresh home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return env | {"HOME": str(home), "PREFECT_HOME": str(home / ".prefect")}


def _start(setup, point: str, name: str, grpoflow_args: list[str]):
    """`grpoflow ARGS` under the subreaper, held at `point` (pause_at.py): (reaper, the command's pid, its log,
    its TMPDIR) once the point is reached."""
    base, *_, home = setup
    work = base / name
    tmp = work / "tmp"  # the run's TMPDIR: where its sandbox, bridge and gate dirs go
    tmp.mkdir(parents=True)
    env = _env(home) | {"TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    marker, log = work / "reached", work / "run.log"
    pause = [sys.executable, str(REPO / "tests/integration/faults/pause_at.py"), point, str(marker)]
    reaper = subprocess.Popen(
        [sys.executable, str(REPO / "tests/fakes/reaper.py"), str(log), "--", *pause, "--", *grpoflow_args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    run = int(reaper.stdout.readline())
    deadline = time.monotonic() + 600
    while not marker.exists() and time.monotonic() < deadline:
        if reaper.poll() is not None or not Path(f"/proc/{run}").exists():
            break
        time.sleep(0.2)
    if not marker.exists():
        _stop(reaper)
        pytest.fail(f"the run never reached {point}:\n{log.read_text()[-3000:]}")
    time.sleep(1.0)  # the held command is running
    return reaper, run, log, tmp


def _leftovers(reaper) -> list:
    """What is still running below the reaper (its command has ended or been killed) once nothing is, or after
    LINGER_S; killed, then listed."""
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline and any(alive(pid) for pid in descendants(reaper.pid)):
        time.sleep(0.2)
    reaper.stdin.close()
    left = json.loads(reaper.stdout.readline())
    reaper.wait()
    for pid, _ in left:  # reparented to init once the reaper is gone: a failed test must not leave them running
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _signal(reaper, run: int, sig: int) -> list:
    """Send `sig` to the command alone, as `kill` does: what is left running below it once it has ended."""
    try:
        os.kill(run, sig)
        return _leftovers(reaper)
    finally:
        _stop(reaper)


def _stop(reaper) -> None:
    """A failed test: take down what is left, then the reaper."""
    if reaper.poll() is None:
        for pid in descendants(reaper.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reaper.kill()
    reaper.wait()


def _debris(tmp: Path) -> list[str]:
    prefixes = ("grpoflow-sandbox-", "grpoflow-bridge-", "grpoflow-gate-")
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(prefixes))


def _run_file(setup, name: str) -> Path:
    base, model, data, _ = setup
    cfg_file = base / f"{name}.json"
    cfg_file.write_text(json.dumps(run_config(base / name / "runs", model, data, name, steps=1)))
    return cfg_file


@pytest.mark.parametrize("point", list(RUNNING))
def test_kill_9_of_grpoflow_main_leaves_no_process_and_no_sandbox_dir(setup, point):
    name = f"kill-{point}"
    reaper, run, log, tmp = _start(setup, point, name, ["main", "--config", str(_run_file(setup, name))])
    running = " | ".join(_cmdlines(descendants(run)))
    missing = [name for name in RUNNING[point] if name not in running]
    if missing or (point == "rollout" and not list(tmp.glob("grpoflow-sandbox-*"))):
        _stop(reaper)
        pytest.fail(f"not running at the kill point: {missing} (or no sandbox dir): {running}")
    left = _signal(reaper, run, signal.SIGKILL)
    assert left == [], f"left running after kill -9: {left}"
    assert _debris(tmp) == [], "left on disk after kill -9"


def test_sigterm_of_grpoflow_main_cleans_up_and_ends_with_how_to_resume(setup):
    """A train run stopped by SIGTERM mid-trial (a preempted node, systemd, `timeout`) stops its sandboxes and
    engine, ends with the command that continues it, and that command finishes the run."""
    name = "term-rollout"
    reaper, run, log, tmp = _start(setup, "rollout", name, ["main", "--config", str(_run_file(setup, name))])
    left = _signal(reaper, run, signal.SIGTERM)
    assert left == [], f"left running after SIGTERM: {left}"
    assert _debris(tmp) == [], "left on disk after SIGTERM"
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    output_dir = setup[0] / name / "runs"
    assert lines[-1] == (
        f"grpoflow: run {name} stopped by SIGTERM; `grpoflow resume {name} --output-dir {output_dir}` continues it "
        "from its last complete step"
    ), lines[-10:]
    assert "Traceback" not in "\n".join(lines[-10:]), lines[-10:]

    env = _env(setup[3])
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "resume", name, "--output-dir", str(output_dir)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert [json.loads(row)["step"] for row in (output_dir / name / "metrics.jsonl").read_text().splitlines()] == [0]
    (resume,) = read_run_info(RunPaths(output_dir / name)).resumes  # after what: the state Prefect gave the stop
    assert resume.after.startswith("Crashed"), resume


def test_sigterm_of_the_dataset_gate_leaves_no_dir_and_says_so(setup):
    """`grpoflow tasks --validate` stopped by SIGTERM with a trial's sandbox running: its gate dir and sandboxes
    go, and its last line says what stopped it."""
    data = setup[2]
    reaper, run, log, tmp = _start(setup, "rollout", "term-gate", ["tasks", "--validate", "--dataset", str(data)])
    if not _debris(tmp):
        _stop(reaper)
        pytest.fail("no gate or sandbox dir at the signal")
    left = _signal(reaper, run, signal.SIGTERM)
    assert left == [], f"left running after SIGTERM: {left}"
    assert _debris(tmp) == [], "left on disk after SIGTERM"
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert lines[-1] == "grpoflow: tasks stopped by SIGTERM", lines[-10:]
