"""Test-only: run a command as the child of a subreaper, so that whatever it leaves behind when it is killed is
reparented here (not to init) and can be listed.

    python tests/fakes/reaper.py LOG -- COMMAND [ARG...]

The command's stdout and stderr go to LOG. Prints the command's pid, then reaps whatever exits, until its stdin ends; then prints one JSON list of the
processes still alive below it ([pid, command line]) and exits.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.fakes.proc import descendants  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _alive() -> list[tuple[int, str]]:
    out = []
    for pid in descendants(os.getpid()):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state not in ("Z", "X"):
            out.append((pid, cmd.strip()))
    return out


if __name__ == "__main__":
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_CHILD_SUBREAPER) failed")
    sep = sys.argv.index("--")
    with open(sys.argv[1], "ab") as log:
        child = subprocess.Popen(sys.argv[sep + 1 :], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    print(child.pid, flush=True)
    while not select.select([sys.stdin], [], [], 0.2)[0]:
        _reap()
    _reap()
    print(json.dumps(_alive()), flush=True)
