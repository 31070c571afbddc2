"""A trial's cgroup: memory, pids and cpu limited as Docker limits a container, for every process of the trial.

One cgroup per sandbox, made at start and removed at stop; the launcher moves itself into it before anything of
the sandbox runs (`procs_files`), so bwrap and everything below it are charged to it and cannot leave (the
sandbox has no cgroup filesystem and no host capability). Memory is resident memory plus page cache, not address
space: a JVM, Node or torch reserves far more than it touches and starts where an RLIMIT_AS would refuse it.

Where it goes: cgroup v2 where this process's cgroup can have children with the memory and pids controllers (a
child of ours, or else a sibling under our parent where that parent already hands them down); otherwise the v1
memory, pids (and cpu, where mounted) hierarchies, a child of ours in each. Where neither can be had (no write
access, e.g. a non-root user outside a delegated subtree), `create` raises `CgroupUnavailable` with the reason, the
sandbox falls back to RLIMIT_AS per process, and preflight says so.

Directories are named `grpoflow-<our pid>-<n>`; those of a process that died are removed by the next `create` in
the same parent once empty (an rmdir of a non-empty cgroup fails, so a live one is never touched).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PREFIX = "grpoflow-"
CPU_PERIOD_US = 100_000  # the quota's period, as Docker's --cpus uses
V1_CONTROLLERS = ("memory", "pids", "cpu")  # cpu is optional: without it there is no cpu quota
_names = itertools.count(1)
_names_lock = threading.Lock()


class CgroupUnavailable(OSError):
    """No cgroup can be made here; the message says why (one line)."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    pids: int
    cpus: float | None  # None: no cpu quota


@dataclass(frozen=True)
class Hierarchy:
    """Where a process's cgroup of one hierarchy lies on this host: v2 (`controller` "") or one v1 controller."""

    controller: str
    mount: Path  # the hierarchy's mount point
    own: Path  # this process's cgroup dir in it


def hierarchies(mountinfo: str, proc_cgroup: str) -> dict[str, Hierarchy]:
    """This process's cgroup dirs ("" for v2, else the v1 controller's name: memory, pids, cpu) from the text of
    /proc/self/mountinfo and /proc/self/cgroup. A hierarchy mounted at a root our cgroup is not under is left out
    (it shows another cgroup namespace's tree)."""
    mounts: dict[str, tuple[str, Path]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        root, point, fstype, superopts = fields[3], fields[4], fields[sep + 1], fields[sep + 3]
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)  # mountinfo octal escapes
        if fstype == "cgroup2":
            mounts.setdefault("", (root, Path(point)))
        elif fstype == "cgroup":
            for opt in superopts.split(","):
                if opt in V1_CONTROLLERS:
                    mounts.setdefault(opt, (root, Path(point)))
    found: dict[str, Hierarchy] = {}
    for line in proc_cgroup.splitlines():
        hier_id, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not hier_id:
            continue
        names = [""] if hier_id == "0" and controllers == "" else controllers.split(",")
        for name in names:
            if name not in mounts:
                continue
            root, point = mounts[name]
            rel = os.path.relpath(path, root)
            if rel == ".." or rel.startswith("../"):
                continue
            found[name] = Hierarchy(name, point, (point / rel).resolve() if rel != "." else point)
    return found


@cache
def _own_hierarchies() -> dict[str, Hierarchy]:
    return hierarchies(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())


def _read(path: Path) -> str:
    return path.read_text().strip()


def _write(path: Path, value: str) -> None:
    # One write() of the whole value: cgroup files act on each write, and reject partial ones.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


class TrialCgroup:
    """One trial's cgroup: its dirs (one for v2; memory, pids and maybe cpu for v1) and what can be read back."""

    def __init__(self, version: int, dirs: dict[str, Path], limits: Limits):
        self.version = version
        self.dirs = dirs  # controller ("" for v2) -> dir
        self.limits = limits

    @property
    def mechanism(self) -> str:
        return f"cgroup v{self.version}"

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes "0" to, to join this cgroup (all of them, in order)."""
        return [str(d / "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    @property
    def _memory(self) -> Path | None:  # None: its creation failed before the dir was made
        return self.dirs.get("" if self.version == 2 else "memory")

    def peak_memory_bytes(self) -> int | None:
        """The most memory the trial used at once (None where the kernel keeps no such count)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        if self._memory is None:
            return None
        try:
            return int(_read(self._memory / name))
        except (FileNotFoundError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes the kernel killed at this cgroup's memory limit so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        if self._memory is None:
            return 0
        try:
            text = (self._memory / name).read_text()
        except FileNotFoundError:
            return 0
        match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
        return int(match.group(1)) if match else 0

    def pids(self) -> list[int]:
        if self._memory is None:
            return []
        with contextlib.suppress(FileNotFoundError):
            return [int(p) for p in _read(self._memory / "cgroup.procs").split()]
        return []

    def remove(self, wait_sec: float = 5.0) -> None:
        """SIGKILL whatever is still in it, then remove its dirs. A process that will not go (stuck in the kernel)
        leaves the dirs for a later `create` to sweep."""
        deadline = time.monotonic() + wait_sec
        if self.version == 2 and self._memory is not None:
            with contextlib.suppress(OSError):
                _write(self._memory / "cgroup.kill", "1")  # 5.14+; the loop below covers older kernels
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        for d in set(self.dirs.values()):
            _rmdir(d)


def _rmdir(d: Path) -> bool:
    try:
        d.rmdir()
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
            return False
        raise
    return True


def _sweep(parent: Path) -> None:
    """Remove the empty cgroups a dead grpoflow process left in `parent`."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            match = re.fullmatch(rf"{PREFIX}(\d+)-\d+[0-9a-f]{{8}}", entry.name)
            if match and entry.is_dir() and not Path(f"/proc/{match.group(1)}").exists():
                with contextlib.suppress(OSError):
                    _rmdir(Path(entry.path))


def _new_name() -> str:
    # The random part: a reused pid (or another pid namespace's) never meets a dir an earlier process left.
    with _names_lock:
        return f"{PREFIX}{os.getpid()}-{next(_names)}{secrets.token_hex(4)}"


def _v2_parent(h: Hierarchy) -> Path:
    """A dir whose children get the memory and pids controllers: ours (enabling them for our children, which the
    kernel refuses while our cgroup holds processes, unless it is the root), else our parent where it hands them
    to us already."""
    wanted = {"memory", "pids"}
    available = set(_read(h.own / "cgroup.controllers").split())
    if not wanted <= available:
        raise CgroupUnavailable(f"cgroup v2 at {h.own}: the memory and pids controllers are not available to it")
    enabled = set(_read(h.own / "cgroup.subtree_control").split())
    if wanted <= enabled:
        return h.own
    try:
        for controller in sorted(wanted) + sorted({"cpu"} & available):  # one at a time: cpu is optional
            with contextlib.suppress(OSError) if controller == "cpu" else contextlib.nullcontext():
                _write(h.own / "cgroup.subtree_control", f"+{controller}")
        return h.own
    except OSError:
        if h.own == h.mount:
            raise
    # Our cgroup holds processes (ours), so it can have no children with controllers. A sibling under our parent
    # (which hands them to us) would escape whatever our own cgroup limits: only where it limits nothing.
    limits = {
        name: _read(h.own / name)
        for name in ("memory.max", "memory.high", "pids.max", "cpu.max")
        if (h.own / name).exists()
    }
    bounded = [name for name, value in limits.items() if value.split()[0] != "max"]
    if bounded:
        raise CgroupUnavailable(
            f"cgroup v2 at {h.own}: it holds this process, so no child of it can have controllers, and a sibling "
            f"would escape its limits ({', '.join(bounded)})"
        )
    return h.own.parent  # its subtree_control holds what our cgroup.controllers lists


def _create_v2(h: Hierarchy, limits: Limits) -> TrialCgroup:
    parent = _v2_parent(h)
    _sweep(parent)
    d = parent / _new_name()
    d.mkdir()
    group = TrialCgroup(2, {"": d}, limits)
    try:
        _write(d / "memory.max", str(limits.memory_bytes))
        with contextlib.suppress(FileNotFoundError):  # no swap accounting: nothing to cap
            _write(d / "memory.swap.max", "0")
        _write(d / "pids.max", str(limits.pids))
        if limits.cpus is not None and (d / "cpu.max").exists():
            _write(d / "cpu.max", f"{round(limits.cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
    except OSError:
        group.remove()
        raise
    return group


def _create_v1(found: dict[str, Hierarchy], limits: Limits) -> TrialCgroup:
    missing = [c for c in ("memory", "pids") if c not in found]
    if missing:
        raise CgroupUnavailable(f"no cgroup v1 {' or '.join(missing)} hierarchy of this process is mounted")
    name = _new_name()
    dirs: dict[str, Path] = {}
    group = TrialCgroup(1, dirs, limits)
    try:
        for controller in V1_CONTROLLERS:
            if controller in found:
                d = found[controller].own / name
                if d not in dirs.values():  # controllers mounted together (cpu,memory) share one hierarchy
                    _sweep(found[controller].own)
                    d.mkdir()
                dirs[controller] = d
        _write(dirs["memory"] / "memory.limit_in_bytes", str(limits.memory_bytes))
        with contextlib.suppress(FileNotFoundError, OSError):  # memsw exists only with swap accounting
            _write(dirs["memory"] / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        _write(dirs["pids"] / "pids.max", str(limits.pids))
        if limits.cpus is not None and "cpu" in dirs:
            _write(dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(dirs["cpu"] / "cpu.cfs_quota_us", str(round(limits.cpus * CPU_PERIOD_US)))
    except OSError:
        group.remove()
        raise
    return group


def create(limits: Limits, found: dict[str, Hierarchy] | None = None) -> TrialCgroup:
    """A new cgroup with `limits`, v2 first (see the module doc); `found`: this process's hierarchies (default: read
    from /proc). Raises `CgroupUnavailable` saying why none can be made."""
    found = _own_hierarchies() if found is None else found
    reasons = []
    if "" in found:
        try:
            return _create_v2(found[""], limits)
        except OSError as exc:
            reasons.append(f"v2: {exc}")
    try:
        return _create_v1(found, limits)
    except OSError as exc:
        reasons.append(f"v1: {exc}")
    raise CgroupUnavailable("; ".join(reasons))


@cache
def unavailable_reason() -> str | None:
    """Why this process cannot give a sandbox a cgroup (one line), or None when it can: found by making one."""
    try:
        create(Limits(memory_bytes=64 * 2**20, pids=8, cpus=None)).remove()
    except OSError as exc:
        return str(exc)
    return None
