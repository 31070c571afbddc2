"""Run a command whose whole process group dies with the process that started it, even when that process is
SIGKILLed.

`die_with_parent(argv)` prefixes `argv` with `python -I .../grpoflow/lifeline.py <our pid> <grace> --`. That small
process leads a process group of its own (it starts a session when the caller did not) and runs the command in it;
an engine's server, its scheduler and detokenizer, a router's workers all land there. Stop the command by signalling
the group (`os.killpg(proc.pid, ...)`, or `Lifeline`'s `terminate()`): the lifeline lets the signal pass, waits
for the command and exits with its status. While it waits it watches its parent: once the parent is gone
(a `kill -9` of the flow, an out-of-memory kill), it sends the group SIGTERM, and SIGKILL `grace` seconds later.

It watches the parent *process* (`getppid()` changes when it is gone), so any thread may start it, and it is a
separate process rather than a `preexec_fn`: code run between fork and exec in a process with threads (Prefect's,
torch's) can deadlock.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.25  # how often the parent is checked: the delay before a dead flow's command is told to stop
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def die_with_parent(argv: list[str], grace_s: float = 10.0) -> list[str]:
    """`argv` run in a process group that is stopped when this process dies: SIGTERM, then SIGKILL after
    `grace_s` seconds."""
    # By path, isolated (-I): the lifeline needs only the standard library, and starts whatever the environment
    # (a launched engine's drops PYTHONPATH) and the working directory
    return [sys.executable, "-I", __file__, str(os.getpid()), f"{grace_s:g}", "--", *argv]


class Lifeline(subprocess.Popen):
    """`argv` started behind the lifeline (`die_with_parent`), as a Popen leading the command's process group,
    whose signals (`terminate()`, `kill()`, `send_signal()`) go to that group: how code that only knows Popen
    stops the command and what it started. `kwargs`: Popen's (stdout, env, ...)."""

    def __init__(self, argv: list[str], *, grace_s: float = 10.0, **kwargs):
        # a session from the fork on: the group exists before a signal can be sent to it
        super().__init__(die_with_parent(argv, grace_s), start_new_session=True, **kwargs)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass


def exit_status(code: int) -> str:
    """How a process ended, from its return code: a signal's name for a command killed behind the lifeline
    (128 + N) or directly (-N)."""
    sig = exit_signal(code)
    return f"was killed by {sig.name}" if sig is not None else f"exited with status {code}"


def exit_signal(code: int) -> signal.Signals | None:
    """The signal that ended a process with return code `code`: -N directly, 128 + N behind the lifeline (or a
    shell); None for an exit of its own."""
    sig = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        return signal.Signals(sig) if sig else None
    except ValueError:
        return None


def _group_members() -> list[int]:
    """The other processes of this process group (from /proc/*/stat)."""
    group, me, out = os.getpgrp(), os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state ppid pgrp ...
        except OSError:  # it ended while we looked
            continue
        if int(fields[2]) == group and int(stat.parent.name) != me:
            out.append(int(stat.parent.name))
    return out


def _kill_group_but_me(sig: int) -> None:
    for pid in _group_members():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _ask_kernel_to_kill_on_our_death() -> None:
    """In the command's process, before exec: SIGKILL when the lifeline dies, should it be killed alone (an
    out-of-memory kill picks one process). Safe here: the lifeline has one thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def main(args: list[str]) -> None:
    parent, grace, sep, *argv = args
    if sep != "--" or not argv:
        raise SystemExit("usage: python -I grpoflow/lifeline.py PARENT_PID GRACE_S -- COMMAND [ARG...]")
    parent_pid, grace_s = int(parent), float(grace)
    if os.getppid() != parent_pid:  # the parent died before we looked: nothing would ever stop the command
        raise SystemExit(f"grpoflow.lifeline: process {parent_pid} is gone; not starting {argv[0]}")
    if os.getpgrp() != os.getpid():
        os.setsid()
    for sig in STOP_SIGNALS:  # the group got it too: the command decides; we wait for it (handlers end at exec)
        signal.signal(sig, lambda *_: None)
    command = subprocess.Popen(argv, preexec_fn=_ask_kernel_to_kill_on_our_death)  # noqa: PLW1509
    ended = os.pidfd_open(command.pid)  # readable once the command has exited
    kill_at: float | None = None
    while not select.select([ended], [], [], POLL_S)[0]:
        if kill_at is None and os.getppid() != parent_pid:
            print(
                f"grpoflow.lifeline: process {parent_pid}, which started {argv[0]}, is gone: stopping it",
                file=sys.stderr,
                flush=True,
            )
            _kill_group_but_me(signal.SIGTERM)
            kill_at = time.monotonic() + grace_s
        elif kill_at is not None and time.monotonic() >= kill_at:
            _kill_group_but_me(signal.SIGKILL)
    code = command.wait()
    _kill_group_but_me(signal.SIGKILL)  # what the command left behind: its own children outliving it
    sys.exit(code if code >= 0 else 128 - code)  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    main(sys.argv[1:])
