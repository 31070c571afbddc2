"""What a task dir may hold before grpoflow reads any of it: a dataset is third-party input, so nothing in it may
make grpoflow (often root) read a file outside the task dir, block on a FIFO, or run without a time limit.

`check_task_tree` walks the dir without following links: every symlink must resolve inside the task dir, and every
entry must be a regular file, a dir or such a link (no FIFO, socket or device: reading one blocks or never ends).
`check_task_times` bounds every `*_sec` value of task.toml (time limits, intervals): finite, and within
`MAX_TASK_SECONDS`; a time limit above 0. Both return the problem as one line, or None.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The longest time limit a task may set (24 h, as rollout.episode.command_timeout_sec): a trial that may run longer never
# ends a step in practice, and `inf` or 1e300 mean "no limit", which a task must not be able to choose.
MAX_TASK_SECONDS = 86400.0

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}


def check_task_tree(task_dir: Path) -> str | None:
    """The first entry of `task_dir` (an absolute, resolved path) that leads outside it or is no plain file."""
    for path in _entries(task_dir):
        rel = path.relative_to(task_dir).as_posix()
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            real = Path(os.path.realpath(path))
            if not (real == task_dir or real.is_relative_to(task_dir)):
                return f"{rel} is a symlink to {real}, outside the task directory (not read)"
        elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return f"{rel} is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a regular file"
    return None


def _entries(root: Path) -> Iterator[Path]:
    # os.walk does not descend into linked dirs (followlinks=False): a link is checked as an entry of its own.
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            yield Path(dirpath, name)


def check_task_times(config: dict[str, Any], where: str = "") -> str | None:
    """The first `*_sec` value in task.toml's parsed `config` (nested dicts and lists) that is not a usable time."""
    for key, value in _items(config, where):
        if not key.endswith("_sec") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or not 0 <= value <= MAX_TASK_SECONDS:
            return (
                f"task.toml `{key}` = {value!r}: a time must be a finite number of seconds between 0 and "
                f"{MAX_TASK_SECONDS:g} (24 h)"
            )
        if key.endswith("timeout_sec") and value == 0:
            return f"task.toml `{key}` = 0: a time limit must be above 0 seconds"
    return None


def _items(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _items(value, f"{where}.{key}" if where else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _items(value, f"{where}[{i}]")
    else:
        yield where, node
