"""Test-side /proc reading: which processes a test (or a process it launched) left behind."""

from __future__ import annotations

import os
from pathlib import Path


def _stat(path: Path) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command's name: state, ppid, pgrp, ...; None once the process is gone."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except OSError:  # the process ended while we looked
        return None


def _every_stat() -> dict[int, list[str]]:
    return {int(p.parent.name): f for p in Path("/proc").glob("[0-9]*/stat") if (f := _stat(p)) is not None}


def alive(pid: int) -> bool:
    """`pid` runs: it exists and is not a zombie waiting for its reaper."""
    fields = _stat(Path(f"/proc/{pid}/stat"))
    return fields is not None and fields[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    return [pid for pid, f in _every_stat().items() if int(f[2]) == pgid and f[0] != "Z"]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc/*/stat parent links), children found first."""
    children: dict[int, list[int]] = {}
    for child, fields in _every_stat().items():
        children.setdefault(int(fields[1]), []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def descendants_running(text: str, pid: int | None = None) -> list[int]:
    """The processes below `pid` (this one by default) whose command line holds `text`, children found first."""
    out = []
    for child in descendants(os.getpid() if pid is None else pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended while we looked
            continue
        if text in cmdline:
            out.append(child)
    return out
