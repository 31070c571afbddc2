"""Test-side /proc reading: which processes a test (or a process it launched) left behind."""

from __future__ import annotations

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
