"""Host processes behind a `LocalSandbox`: the tools it runs, sandbox uids, rlimits, output capture, killing and
reaping (namespaces, process groups, uids), /proc scans, and the long-lived bwrap that holds a trial's namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

# The whole environment of the host-side processes (launcher, bwrap): nothing of ours or of a task's.
from grpoflow.embedded.sandbox.launch import ENV as HOST_ENV
from grpoflow.rollout.environments import SandboxStartError, SandboxUnavailableError

# Every sandbox process starts through it, run by this Python: see its module doc.
LAUNCHER = Path(__file__).with_name("launch.py")
# pid 1 of a trial-scope sandbox: never exits on its own, ignores signals, reaps orphans.
HOLDER_LOOP = "trap '' HUP INT QUIT TERM USR1 USR2; while :; do sleep 86400 & wait $!; done"

# Sandbox uids when running as root: unique per (our pid, slot) so two live sandboxes never share one, even
# across processes. pid < 2**22 (Linux PID_MAX_LIMIT) and 256 slots keep every uid below 2**31.
_UID_BASE = 1 << 24
_UID_SLOTS = 256
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


# What the sandbox runs on the host, and the Debian package each comes in: bwrap from PATH, bash at the path it
# execs (inside the sandbox: the host's on the host rootfs).
HOST_TOOLS: dict[str, str] = {"bwrap": "bubblewrap", "/bin/bash": "bash"}


def missing_tools(find: Callable[[str], str | None] | None = None, tools: dict[str, str] = HOST_TOOLS) -> list[str]:
    """One line per host tool of `tools` (tool -> Debian package) this machine lacks, naming its package."""
    find = find or shutil.which
    return [
        f"the local sandbox needs `{tool.rsplit('/', 1)[-1]}` ({tool}): apt-get install -y {package}"
        for tool, package in tools.items()
        if find(tool) is None
    ]


def require_tools() -> dict[str, str]:
    """Host tools the sandbox needs; a clear error naming the package when one is missing."""
    problems = missing_tools()
    if problems:
        raise SandboxUnavailableError("; ".join(problems))
    return {"bwrap": shutil.which("bwrap") or "bwrap"}


# ---- sandbox uids and limits ----------------------------------------------------------------------------------


def allocate_uid() -> int:
    with _uid_lock:
        base = _UID_BASE + (os.getpid() % (1 << 22)) * _UID_SLOTS
        for slot in range(_UID_SLOTS):
            if base + slot not in _uids_in_use:
                _uids_in_use.add(base + slot)
                return base + slot
    raise SandboxStartError(f"more than {_UID_SLOTS} live sandboxes in one process: no sandbox uid left")


def release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def rlimits(
    *,
    cpu_time_sec: int,
    max_file_size_mb: int,
    address_space_mb: int | None,
    max_processes: int | None,
    uid: int | None,
) -> dict:
    """The rlimits the launcher sets on the host before anything of the sandbox runs (resource names: values).
    `address_space_mb` and `max_processes` are None where the trial's cgroup limits memory and pids instead."""
    want = {"RLIMIT_CPU": cpu_time_sec, "RLIMIT_FSIZE": max_file_size_mb * 2**20, "RLIMIT_CORE": 0}
    if address_space_mb is not None:
        want["RLIMIT_AS"] = address_space_mb * 2**20
    if max_processes is not None:
        # Without a uid of our own, RLIMIT_NPROC counts every process of this user on the host.
        want["RLIMIT_NPROC"] = max_processes + (count_uid_processes(os.getuid()) if uid is None else 0)
    limits = {}
    for name, value in want.items():
        hard = resource.getrlimit(getattr(resource, name))[1]
        # Never above our own hard limit: a non-root launcher could not raise it.
        limits[name] = value if hard == resource.RLIM_INFINITY else min(value, hard)
    return limits


def launch_argv(
    argv: list[str],
    *,
    limits: dict[str, int],
    uid: int | None,
    cgroup: tuple[str, ...] | list[str] = (),
    stage: tuple[tuple[str, str], ...] | list[tuple[str, str]] = (),
    enter: int | None = None,
    seccomp_fd: int | None = None,
    netns: str | None = None,
) -> list[str]:
    """The host command that starts `argv` (bwrap, or with `enter=<pid>` a command in that sandbox): launch.py.
    `cgroup`: the cgroup.procs files it joins first; `netns`: the network namespace it joins then."""
    opts = [arg for procs in cgroup for arg in ("--cgroup", procs)]
    opts += ["--netns", netns] if netns is not None else []
    opts += [arg for name, value in limits.items() for arg in ("--rlimit", f"{name}={value}")]
    opts += [arg for path, name in stage for arg in ("--stage", path, name)]
    for flag, value in (("--uid", uid), ("--enter", enter), ("--seccomp-fd", seccomp_fd)):
        if value is not None:
            opts += [flag, str(value)]
    return [sys.executable, "-I", "-S", str(LAUNCHER), *opts, "--", *argv]


# ---- output and fds -------------------------------------------------------------------------------------------


class CappedOutput:
    """Keeps the first and last `cap // 2` bytes of a stream and counts what falls in between."""

    def __init__(self, cap: int):
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        if len(self.tail) > self.half:
            self.dropped += len(self.tail) - self.half
            del self.tail[: len(self.tail) - self.half]

    def text(self) -> str:
        middle = f"\n[... {self.dropped} bytes of output dropped ...]\n".encode() if self.dropped else b""
        return bytes(self.head + middle + self.tail).decode("utf-8", errors="replace")


async def drain(stream: asyncio.StreamReader, sink: CappedOutput) -> None:
    while chunk := await stream.read(65536):
        sink.add(chunk)


def read_marker(fd: int) -> bool:
    os.set_blocking(fd, False)
    try:
        return bool(os.read(fd, 16))
    except BlockingIOError:
        return False  # nothing written and a write end still open somewhere: the wrapper never ran


def read_info(fd: int) -> bytes:
    """bwrap's --info-fd JSON: read up to its closing brace (the fd may stay open in the sandbox) or EOF."""
    data = b""
    while b"}" not in data and (chunk := os.read(fd, 4096)):
        data += chunk
    return data


# ---- killing and reaping --------------------------------------------------------------------------------------


def kill_sandbox(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the pid namespace of one exec, synchronously.

    The target is bwrap's child, pid 1 of the namespace: when it dies the kernel kills (and reaps) every process
    in the namespace, whatever session or process group they moved to, and bwrap, still alive, reaps pid 1 and
    exits. Killing bwrap instead would also work (--die-with-parent) but would leave pid 1's zombie to the
    host's init, which in a container may never reap it. Before bwrap has a child, its process group goes.
    """
    if proc.returncode is not None:
        return
    children = child_pids(proc.pid)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(pid, signal.SIGKILL)
    if not children:
        kill_group(proc)


async def kill_exec_and_reap(proc: asyncio.subprocess.Process) -> None:
    """Trial scope: SIGKILL one exec's process group (nsenter and the command it forked), not the namespace."""
    kill_group(proc)
    await process_exit(proc)  # not proc.wait(): a process that left the group may hold the pipes open


async def process_exit(proc: asyncio.subprocess.Process) -> None:
    """Until `proc` has exited and been reaped (its returncode set), whatever still holds its pipes."""
    if proc.returncode is None:
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(proc.pid)
        except ProcessLookupError:
            pidfd = None  # already reaped: the returncode is about to be set
        if pidfd is not None:
            exited = loop.create_future()
            loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
            try:
                await exited
            finally:
                loop.remove_reader(pidfd)
                os.close(pidfd)
    while proc.returncode is None:  # the child watcher reaps it right after the pidfd fires
        await asyncio.sleep(0.005)


async def kill_and_reap(proc: asyncio.subprocess.Process) -> None:
    kill_sandbox(proc)
    try:
        await asyncio.wait_for(proc.wait(), timeout=2)
    except TimeoutError:
        kill_group(proc)  # bwrap did not exit after its child died: take it down too
        await proc.wait()


async def reap_after_kill(proc: asyncio.subprocess.Process, readers: list[asyncio.Future[None]]) -> None:
    """Let bwrap exit and its pipes close after `kill_sandbox`, so no half-closed transport is left behind.

    Best effort: runs while a CancelledError is being handled; a second cancellation just ends the wait (the
    processes are already dead or dying), and the caller re-raises the original exception either way.
    """
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=2)
        await asyncio.wait_for(asyncio.gather(*readers, return_exceptions=True), timeout=2)
    except (TimeoutError, asyncio.CancelledError):
        for reader in readers:
            reader.cancel()


def kill_group(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap leads its own group (start_new_session)


def kill_uid(uid: int, wait_sec: float = 5.0, spare: Collection[int] = ()) -> None:
    """SIGKILL every process running as `uid` (a sandbox uid of ours) but `spare`, and wait until they are gone."""
    deadline = time.monotonic() + wait_sec
    while pids := [pid for pid in uid_pids(uid) if pid not in spare]:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)


# ---- /proc ----------------------------------------------------------------------------------------------------


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []  # bwrap already exited, or a kernel without CONFIG_PROC_CHILDREN: fall back to the group


def uid_pids(uid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            # Zombies hold no resources and cannot be killed; only their parent can make them go.
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith(("Z", "X")):
                pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # the process ended while we looked, or is not ours to read
    return pids


def count_uid_processes(uid: int) -> int:
    return len(uid_pids(uid))


# ---- process_scope="trial": the namespace holder --------------------------------------------------------------


async def start_holder(
    launch: Callable[[list[str]], list[str]], bwrap_prefix: list[str], pass_fds: tuple[int, ...], session_id: str
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the bwrap that holds a trial's namespaces: (that bwrap, the pid of its child, pid 1 inside).

    `bwrap_prefix` is the per-exec bwrap argv, ending in "--"; `launch` puts the launcher in front of an argv.
    """
    info_r, info_w = os.pipe()
    ready_r, ready_w = os.pipe()
    # --as-pid-1: the bash loop is the namespace's init, so signals from inside never reach it, and it reaps
    # the orphans a command leaves (bash reaps any child on SIGCHLD). bwrap reports the child's pid on the
    # info fd before the child has built its mounts; the loop's byte on ready_w says it has.
    loop = f"printf 1 >&{ready_w}; exec {ready_w}>&-; {HOLDER_LOOP}"
    argv = launch([*bwrap_prefix[:-1], "--as-pid-1", "--info-fd", str(info_w), "--", "/bin/bash", "-c", loop])
    try:
        try:
            # A plain Popen, not an asyncio process: stop() may run in another event loop than start().
            holder = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=HOST_ENV,
                start_new_session=True,
                pass_fds=(info_w, ready_w, *pass_fds),
            )
        finally:
            os.close(info_w)
            os.close(ready_w)
        info = await asyncio.to_thread(read_info, info_r)
        ready = await asyncio.to_thread(os.read, ready_r, 1)  # b"" (EOF): the holder died setting up
    finally:
        os.close(info_r)
        os.close(ready_r)
    match = re.search(rb'"child-pid"\s*:\s*(\d+)', info)
    if match is None or not ready:
        await asyncio.to_thread(stop_holder, holder)
        err = holder.stderr.read().decode(errors="replace").strip() if holder.stderr else ""
        raise SandboxStartError(f"sandbox for {session_id}: bwrap did not start its namespaces: {err[:2000]}")
    return holder, match.group(1).decode()


def stop_holder(holder: subprocess.Popen[bytes]) -> None:
    """SIGKILL pid 1 of a trial's namespaces (the kernel then kills every process in them) and reap bwrap."""
    if holder.poll() is None:
        for pid in child_pids(holder.pid):
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.kill(pid, signal.SIGKILL)
        try:
            holder.wait(timeout=2)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
    if holder.stderr is not None:
        holder.stderr.close()
