"""A command started through `grpoflow.lifeline` dies with the process that started it, SIGKILL included; one
started plainly (the control) outlives it, reparented to init."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpoflow.embedded.sandbox.orphans import start_time

REPO = Path(__file__).resolve().parents[2]
PARENT = """
import subprocess, sys, time
from grpoflow.lifeline import die_with_parent
held = subprocess.Popen(die_with_parent(["sleep", "600"]))
plain = subprocess.Popen(["sleep", "600"])
print(held.pid, plain.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int, name: bytes) -> bool:
    try:
        return start_time(pid) is not None and Path(f"/proc/{pid}/cmdline").read_bytes().startswith(name)
    except OSError:
        return False


def _within(seconds: float, check) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def test_a_command_on_a_lifeline_dies_with_its_sigkilled_parent():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    held, plain = map(int, parent.stdout.readline().split())
    try:
        assert _within(10, lambda: _running(held, b"sleep"))  # the lifeline exec'd the command itself
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _within(2, lambda: not _running(held, b"sleep"))
        assert _running(plain, b"sleep")  # the control: nothing else ends a child its parent leaves behind
    finally:
        for pid in (held, plain):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_lifeline_refuses_to_start_for_a_parent_that_is_gone():
    res = subprocess.run(
        [sys.executable, "-m", "grpoflow.lifeline", "1", "--", "true"], cwd=REPO, capture_output=True, text=True
    )
    assert res.returncode != 0 and "process 1 is gone" in res.stderr
