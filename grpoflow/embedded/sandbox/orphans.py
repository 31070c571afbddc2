"""Per-trial host dirs that outlive their process: removed by a janitor when the process dies, or by the next
process that makes such dirs in the same place.

A killed run (SIGKILL, an OOM kill) cannot delete its sandboxes' dirs, `<work_dir>/grpoflow-sandbox-*` and
`/tmp/grpoflow-bridge-*` (bwrap's --die-with-parent ends their processes, not their files). Each such dir holds
an owner record (`OWNER_FILE`: pid, the process's start time, its pid namespace and the boot), written right after
the dir is made (a trial dir's is outside the sandbox's /; the bridge dir's shows, read-only, in /run/grpoflow:
nothing in it is secret). A dir is provably orphaned when its owner lived in our pid namespace and boot and that
process is gone (or a zombie, or a later process under the same pid). A dir without a readable record is never
touched.

`claim(dir)` writes the record; the first claim of a process in a base dir sweeps that base of orphaned dirs (any
owner) and names the base to the process's janitor: `python -m grpoflow.embedded.sandbox.orphans PID`, one small
process per grpoflow process, in a session of its own (no terminal signal ends it first), reading base dirs from
a pipe. When the pipe ends or PID is no longer its parent (PID exited or was killed), it removes the dirs PID left
in those bases and exits.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from grpoflow.embedded.sandbox.rootfs import rmtree, unmount_layer

OWNER_FILE = ".grpoflow-owner"
PREFIXES = ("grpoflow-sandbox-", "grpoflow-bridge-")
POLL_S = 0.5

_lock = threading.Lock()
_watched: set[Path] = set()  # base dirs this process swept and told its janitor about
_janitor: subprocess.Popen[bytes] | None = None


def claim(path: Path) -> None:
    """Record this process as `path`'s owner; sweep its base dir and have the janitor watch it (once per base)."""
    record = {"pid": os.getpid(), "start": start_time(os.getpid()), "pidns": _pid_namespace(), "boot": _boot_id()}
    (path / OWNER_FILE).write_text(json.dumps(record) + "\n")
    base = path.parent.resolve()
    with _lock:
        if base not in _watched:
            sweep(base)
            _watched.add(base)
            _tell_janitor(base)


def _tell_janitor(base: Path) -> None:
    global _janitor
    for _ in range(2):
        if _janitor is None or _janitor.poll() is not None:  # none yet, or someone killed it: a new one
            _janitor = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "grpoflow.embedded.sandbox.orphans",
                    str(os.getpid()),
                    str(start_time(os.getpid())),
                ],
                stdin=subprocess.PIPE,  # its end (EOF) tells the janitor at once that this process is gone
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,  # not the run's pipes: a reader waiting for their end would wait for it
                start_new_session=True,
            )
            bases = _watched
        else:
            bases = {base}
        try:
            assert _janitor.stdin is not None
            _janitor.stdin.write("".join(f"{b}\n" for b in bases).encode())
            _janitor.stdin.flush()
            return
        except BrokenPipeError:
            _janitor = None


def sweep(base: Path, dead: tuple[int, int | None] | None = None) -> list[Path]:
    """Remove the provably orphaned dirs in `base`, or only those of `dead` (pid, start time: a process known to
    be gone); the removed ones."""
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIXES) or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        record = _owner(path)
        if record is None:
            continue
        if dead is not None and not ((record.get("pid"), record.get("start")) == dead and _here(record)):
            continue
        if dead is None and not _gone(record):
            continue
        if _remove(path):
            removed.append(path)
    return removed


def _remove(path: Path, attempts: int = 5) -> bool:
    for _ in range(attempts):  # the dead run's sandbox processes may still be going down, writing as they go
        try:
            unmount_layer(path)  # a trial's overlay: the delete must not walk into it
            rmtree(path)
        except FileNotFoundError:  # a file vanished under us, or another sweep took the whole dir
            if not path.exists():
                return True
        except OSError:
            time.sleep(0.2)
        else:
            return True
    return False


def start_time(pid: int) -> int | None:
    """The start time of a live process (clock ticks since boot), or None if there is none or it is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _gone(record: dict) -> bool:
    """Whether the owner `record` names is provably no longer running."""
    if record.get("pidns") != _pid_namespace():
        return False  # another pid namespace's process (a container sharing the dir): we cannot look it up
    if record.get("boot") != _boot_id():
        return True  # made before the machine last booted
    pid = record.get("pid")
    return isinstance(pid, int) and start_time(pid) != record.get("start")


def _here(record: dict) -> bool:
    return record.get("pidns") == _pid_namespace() and record.get("boot") == _boot_id()


def _owner(path: Path) -> dict | None:
    try:
        record = json.loads((path / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def watch(parent: int, began: int) -> None:
    """The janitor: collects base dirs from stdin (one a line) until `parent` (which started at `began`) is no
    longer our parent (it exited or was killed; its end of the pipe closing says so at once), then removes what it
    left in each. What it wrote before it died is still read: it may die before we are even up."""
    bases: set[Path] = set()
    pending = b""
    fd = sys.stdin.fileno()
    while True:
        gone = os.getppid() != parent
        ready, _, _ = select.select([fd], [], [], 0 if gone else POLL_S)
        if ready:
            chunk = os.read(fd, 65536)
            if chunk:
                *lines, pending = (pending + chunk).split(b"\n")
                bases.update(Path(line.decode()) for line in lines if line)
                continue
            while os.getppid() == parent:  # the pipe's end: the parent is exiting, gone once we are another's child
                time.sleep(0.02)
            break
        if gone:  # nothing left to read (a process that inherited the pipe's end may hold it open for ever)
            break
    for base in bases:
        sweep(base, dead=(parent, began))


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
