"""Test-side /proc reading: which processes a test (or a process it launched) left behind."""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc/*/stat parent links), children found first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
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
