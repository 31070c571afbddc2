"""Run a command that dies with the process that started it, even when that process is SIGKILLed.

`die_with_parent(argv)` prefixes `argv` with `python -m grpoflow.lifeline <our pid> --`. That small process asks
the kernel for SIGKILL on its parent's death (Linux `prctl(PR_SET_PDEATHSIG)`), checks the parent is still the
one that started it (it may have died before the request), then execs the command, which keeps the request.
The kernel sends the signal when the *thread* that started the child ends: start it from a thread that lives as
long as the process (the main thread). A wrapper, not `preexec_fn`: code run between fork and exec in a process
with threads (Prefect's, torch's) can deadlock.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(argv: list[str]) -> list[str]:
    """`argv` run so that it is SIGKILLed when this process dies."""
    return [sys.executable, "-m", "grpoflow.lifeline", str(os.getpid()), "--", *argv]


def main(args: list[str]) -> None:
    parent, sep, *argv = args
    if sep != "--" or not argv:
        raise SystemExit("usage: python -m grpoflow.lifeline PARENT_PID -- COMMAND [ARG...]")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(parent):  # the parent died before the request: nothing would ever end the command
        raise SystemExit(f"grpoflow.lifeline: process {parent} is gone; not starting {argv[0]}")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
