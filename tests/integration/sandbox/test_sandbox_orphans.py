"""Per-trial dirs a dead process left: its janitor removes them at once, the next claim in the same place removes
any it can prove orphaned, and nothing else is touched (a live owner's, another pid namespace's, no record)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpoflow.embedded.sandbox.orphans import OWNER_FILE, claim, start_time, sweep

REPO = Path(__file__).resolve().parents[3]

# A child that claims a dir in BASE (as a sandbox's start does), says so, then lives until killed or told to exit.
CHILD = """
import sys, tempfile, time
from pathlib import Path
from grpoflow.embedded.sandbox.orphans import claim
d = Path(tempfile.mkdtemp(prefix="grpoflow-sandbox-child-", dir=sys.argv[1]))
claim(d)
print(d, flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _child(base: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(base), mode], stdout=subprocess.PIPE, env=env, text=True)
    return proc, Path(proc.stdout.readline().strip())


def _gone_within(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


def test_the_janitor_removes_a_sigkilled_process_s_dirs(tmp_path):
    proc, d = _child(tmp_path, "wait")
    (d / "rootfs" / "app").mkdir(parents=True)
    (d / "rootfs" / "app" / "out.txt").write_text("x")
    assert d.is_dir() and json.loads((d / OWNER_FILE).read_text())["pid"] == proc.pid
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _gone_within(d, 5)


def test_the_janitor_removes_what_an_exited_process_left(tmp_path):
    proc, d = _child(tmp_path, "exit")
    proc.wait()
    assert _gone_within(d, 5)


def _record(d: Path, **changes) -> None:
    me = {"pid": os.getpid(), "start": start_time(os.getpid())}
    record = json.loads((d / OWNER_FILE).read_text())
    (d / OWNER_FILE).write_text(json.dumps({**record, **me, **changes}))


def test_a_sweep_removes_only_what_it_can_prove_orphaned(tmp_path):
    dirs = {}
    for name in ("live", "dead", "reused-pid", "other-namespace", "other-boot", "no-record", "not-ours"):
        prefix = "unrelated-" if name == "not-ours" else "grpoflow-sandbox-"
        d = dirs[name] = tmp_path / f"{prefix}{name}"
        d.mkdir()
        if name != "no-record":
            claim(d)  # this process: alive
    dead = _dead_pid()
    _record(dirs["dead"], pid=dead)  # exited, reaped: no such process
    _record(dirs["reused-pid"], start=start_time(os.getpid()) - 1)  # our pid, but an earlier process's
    _record(dirs["other-namespace"], pid=dead, pidns="pid:[1]")  # cannot be looked up from here
    _record(dirs["other-boot"], boot="an-earlier-boot")
    _record(dirs["not-ours"], pid=dead)  # not a sandbox dir by its name
    removed = sweep(tmp_path)
    assert sorted(p.name for p in removed) == [
        "grpoflow-sandbox-dead",
        "grpoflow-sandbox-other-boot",
        "grpoflow-sandbox-reused-pid",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "grpoflow-sandbox-live",
        "grpoflow-sandbox-no-record",
        "grpoflow-sandbox-other-namespace",
        "unrelated-not-ours",
    ]


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)


def test_the_first_claim_of_a_process_in_a_dir_sweeps_it(tmp_path):
    # What a dead run's janitor did not get to (it was killed too): the next run's first sandbox removes it.
    orphan = tmp_path / "grpoflow-sandbox-orphan"
    orphan.mkdir()
    claim(orphan)
    _record(orphan, pid=_dead_pid())
    proc, d = _child(tmp_path, "wait")
    try:
        assert not orphan.exists() and d.is_dir()
    finally:
        proc.kill()
        proc.wait()
