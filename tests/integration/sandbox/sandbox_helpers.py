"""Host-side checks for the sandbox tests: find processes by a marker in their command line (by uid, the
sandbox's own `grpoflow.embedded.sandbox.processes.uid_pids` serves)."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

_markers = itertools.count(1)


def new_marker() -> str:
    """A number no other process on the host has in its command line: `sleep <marker>` is findable by it."""
    return f"{90000 + os.getpid() % 10000}.{next(_markers):04d}{int(time.time() * 1000) % 100000:05d}"


def live_pids(marker: str, *, exact: str | None = None) -> list[int]:
    """Host pids (zombies excluded) whose command line contains `marker` (or is exactly `exact`).

    The substring match also finds the bwrap and shell processes that carry the command as an argument.
    """
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
        found = cmdline.strip() == exact if exact is not None else marker in cmdline
        if found and state not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


def wait_gone(marker: str, timeout_sec: float = 3.0) -> list[int]:
    """Poll until no live process carries `marker`; return what is left at the deadline (empty = all gone)."""
    deadline = time.monotonic() + timeout_sec
    while (pids := live_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pids
