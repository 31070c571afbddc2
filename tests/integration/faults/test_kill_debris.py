"""`kill -9` of `grpoflow main` mid-run leaves nothing behind: no process (Prefect's temporary server, the engine,
a sandbox) and no sandbox dir, 10 s later. At three points: while the model is prepared, in a trial whose sandbox
runs a command, in the GRPO update.

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

from tests.fakes.proc import descendants
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


@pytest.mark.parametrize("point", list(RUNNING))
def test_kill_9_of_grpoflow_main_leaves_no_process_and_no_sandbox_dir(setup, point):
    base, model, data, home = setup
    work = base / point
    tmp = work / "tmp"  # the run's TMPDIR: where its sandbox and bridge dirs go
    tmp.mkdir(parents=True)
    cfg_file = work / "run.json"
    cfg_file.write_text(json.dumps(run_config(work / "runs", model, data, f"kill-{point}", steps=1)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"HOME": str(home), "PREFECT_HOME": str(home / ".prefect"), "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    marker, log = work / "reached", work / "run.log"
    pause = [sys.executable, str(REPO / "tests/integration/faults/pause_at.py"), point, str(marker)]
    reaper = subprocess.Popen(
        [sys.executable, str(REPO / "tests/fakes/reaper.py"), str(log), "--", *pause, "--", "main", "--config"]
        + [str(cfg_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        run = int(reaper.stdout.readline())
        deadline = time.monotonic() + 600
        while not marker.exists() and time.monotonic() < deadline:
            assert reaper.poll() is None and Path(f"/proc/{run}").exists(), log.read_text()[-3000:]
            time.sleep(0.2)
        assert marker.exists(), f"the run never reached {point}:\n{log.read_text()[-3000:]}"
        time.sleep(1.0)  # the held command is running
        running = " | ".join(_cmdlines(descendants(run)))
        assert all(name in running for name in RUNNING[point]), running
        if point == "rollout":
            assert list(tmp.glob("grpoflow-sandbox-*")), "no sandbox dir at the kill point"

        os.kill(run, signal.SIGKILL)
        time.sleep(LINGER_S)
        reaper.stdin.close()
        left = json.loads(reaper.stdout.readline())
    finally:
        if reaper.poll() is None:  # a failed test: take down what is left, then the reaper
            for pid in descendants(reaper.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            reaper.kill()
        reaper.wait()
    for pid, _ in left:  # reparented to init once the reaper is gone: a failed test must not leave them running
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert left == [], f"left running after kill -9: {left}"
    dirs = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("grpoflow-sandbox-", "grpoflow-bridge-")))
    assert dirs == [], f"left on disk after kill -9: {dirs}"
