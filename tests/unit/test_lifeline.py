"""A command started through `grpoflow.lifeline` dies with the process that started it, SIGKILL included, and so
does everything it started; one started plainly (the control) outlives it, reparented to init. Stopped through its
group, the lifeline waits for the command and reports the command's status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpoflow.lifeline import Lifeline, die_with_parent
from tests.fakes.proc import alive, descendants

REPO = Path(__file__).resolve().parents[2]
# A command with a child of its own (the `sleep 600 &`): as an engine's server with its scheduler. Both ignore
# SIGTERM, as a server busy freeing memory: only the lifeline's SIGKILL ends them.
COMMAND = ["sh", "-c", "trap '' TERM; sleep 600 & echo $!; exec sleep 601"]
PARENT = """
import subprocess, sys, time
from grpoflow.lifeline import die_with_parent
held = subprocess.Popen(die_with_parent(%r, grace_s=1), stdout=subprocess.PIPE, text=True)
plain = subprocess.Popen(["sleep", "602"])
print(held.pid, held.stdout.readline().strip(), plain.pid, flush=True)
time.sleep(600)
"""


def _within(seconds: float, check) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def test_a_command_and_its_children_die_with_their_sigkilled_parent():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT % (COMMAND,)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    lifeline, grandchild, plain = map(int, parent.stdout.readline().split())
    [command, *_] = descendants(lifeline)  # its child (children come first): the command
    try:
        assert os.getpgid(command) == os.getpgid(grandchild) == lifeline  # one group, which the lifeline leads
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # SIGTERM, ignored; SIGKILL a second (grace_s) later; each check of the parent a quarter second apart
        assert _within(5, lambda: not any(map(alive, (lifeline, command, grandchild))))
        assert alive(plain)  # the control: nothing else ends a child its parent leaves behind
    finally:
        for pid in (lifeline, command, grandchild, plain):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_group_stopped_by_its_starter_reports_the_command_s_status_and_leaves_nothing():
    proc = Lifeline(["sh", "-c", "sleep 600 & echo $!; sleep 601"], stdout=subprocess.PIPE, cwd=REPO)
    grandchild = int(proc.stdout.readline())
    proc.terminate()  # SIGTERM to the group: the shell ends with it; the lifeline, waiting for it, passes it on
    assert proc.wait(10) == 128 + signal.SIGTERM
    assert _within(5, lambda: not alive(grandchild))
    proc.stdout.close()
    done = subprocess.run(die_with_parent(["sh", "-c", "exit 3"]), cwd=REPO)
    assert done.returncode == 3


def test_the_lifeline_refuses_to_start_for_a_parent_that_is_gone():
    res = subprocess.run([*die_with_parent([])[:3], "1", "10", "--", "true"], capture_output=True, text=True)
    assert res.returncode != 0 and "process 1 is gone" in res.stderr
