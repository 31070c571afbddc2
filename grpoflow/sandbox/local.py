"""`LocalSandbox`: a Harbor environment that runs every `exec()` in a fresh bubblewrap sandbox on this machine.

Select it with `EnvironmentConfig(import_path="grpoflow.sandbox.local:LocalSandbox", kwargs={...})`. No docker,
no daemon: one trial = one temp dir on the host, and each command is one short-lived `bwrap` process over it.

Filesystem (host dirs are per trial, under `<work_dir>/grpoflow-sandbox-<session>-XXXX/`):

    /            <- rootfs/            (a per-trial dir; root-owned, so the sandbox cannot add top-level entries)
    /usr, /etc   <- the host's, read-only; /bin, /lib, ... are the same symlinks (or read-only binds) as on the host
    /proc, /dev  <- fresh procfs (the sandbox's own pid namespace) and a minimal /dev
    /app         <- rootfs/app          workdir, pre-filled from the task's environment/app/
    /tmp, /root  <- rootfs/tmp, rootfs/root (HOME)
    /tests, /solution <- rootfs/tests, rootfs/solution (Harbor uploads them)
    /logs/agent, /logs/verifier, /logs/artifacts <- Harbor's trial dirs (trial_dir/agent, trial_dir/verifier,
                 trial_dir/artifacts/logs/artifacts), bind-mounted; Harbor therefore reads the agent logs and
                 reward.txt in place and downloads nothing. With `auto_mounting=False` they are plain dirs under
                 rootfs/logs/ and Harbor downloads them through `download_dir`.

Nothing else of the host is visible: not /root, /home, /tmp, /work, /opt, the repo. The host's environment
variables never reach the sandbox: bwrap is started with an explicit environment (PATH, HOME, LANG, the task's
`[environment.env]`, the trial's env and the exec's env) instead of inheriting `os.environ`.

Isolation per exec: new network (nothing but its own loopback), pid, ipc, uts and cgroup namespaces;
`--die-with-parent`; `--new-session` (no TIOCSTI into our terminal). Limits per process via `prlimit`
(RLIMIT_AS, RLIMIT_CPU, RLIMIT_NPROC, RLIMIT_FSIZE, no core files). Run as root (CI), the sandbox's processes
run under a uid of their own (unique per live sandbox, with all capabilities and the bounding set dropped), so
RLIMIT_NPROC caps this sandbox alone, root-only host files under /etc stay unreadable, and `stop()` can sweep any
straggler by uid (a passwd entry `sandbox` is bound over /etc/passwd for it). Run as a normal user, bwrap makes
a user namespace and the sandbox runs as that user; RLIMIT_NPROC is then the user's current process count plus
`max_processes` (kernels before 5.14 count all of the user's processes against it).

Lifetime (`process_scope`): with "exec" (the default) each exec gets its own pid namespace, so whatever a command
starts (`&`, `setsid`, `nohup`, a tmux server) dies when the command returns — nothing carries over between execs
except files. With "trial" (what harnesses driving a terminal need: terminus-2 keeps a tmux server across execs, as
in Docker or e2b) one long-lived bwrap per sandbox holds the namespaces (same binds, same unshared net, pid, ipc,
uts, cgroup), started by `start()`: its pid 1 is a root-owned bash loop that reaps orphans and, being the
namespace's init, ignores every signal sent from inside (`kill -9 -1` cannot end the sandbox). Each exec enters
those namespaces with `nsenter` and runs under the same prlimit/setpriv as in "exec" mode; background processes
then live until the agent phase ends (Harbor's `prepare_logs_for_host()`, before the verifier: they are killed
there) or `stop()` (which SIGKILLs pid 1, and the kernel the rest). A timeout or cancellation kills the exec's
process group (the command and whatever it did not move to a session of its own). In "exec" scope, on timeout,
on any exception and on `asyncio.CancelledError` (Harbor cancels the exec when the agent times out) pid 1 of that
namespace is SIGKILLed, and the kernel kills everything else in it; `stop()` kills whatever is still running and
deletes the temp dir. If our process dies, `--die-with-parent` takes the sandboxes down (their dirs stay).

Failures: bwrap missing -> `SandboxUnavailableError` (permanent). The sandbox failing to set itself up before
the command starts -> `SandboxDiedError`; `start()` failing -> `SandboxStartError` (both transient, retried by
the rollout layer). A command that runs and fails is a normal `ExecResult`; a command past its timeout returns
exit code 124 (the GNU `timeout` convention Harbor's singularity environment also reports).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import random
import re
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities

from grpoflow.sandbox.errors import SandboxDiedError, SandboxStartError, SandboxUnavailableError

PROCESS_SCOPES = ("exec", "trial")
# pid 1 of a trial-scope sandbox: never exits on its own, ignores signals, reaps orphans.
HOLDER_LOOP = "trap '' HUP INT QUIT TERM USR1 USR2; while :; do sleep 86400 & wait $!; done"
# Trial scope: after a command exits, how long to keep reading output a background process may still write.
BACKGROUND_OUTPUT_GRACE_SEC = 0.5
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SANDBOX_HOME = "/root"
TIMEOUT_EXIT_CODE = 124  # what GNU `timeout` returns; Harbor's singularity environment reports the same
DEFAULT_WORKDIR = "/app"
# Host dirs shown read-only. Everything else of the host stays invisible.
HOST_RO_DIRS = ("/usr", "/etc")
# Top-level names that are symlinks into /usr on a merged-/usr host (or real dirs to bind read-only otherwise).
HOST_LIB_NAMES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Sandbox paths that are host or kernel filesystems, never per-trial files: uploads/downloads there are refused.
NOT_TRIAL_PATHS = (*HOST_RO_DIRS, "/proc", "/dev", *(f"/{n}" for n in HOST_LIB_NAMES))
# Per-trial dirs the sandbox user owns (relative to rootfs).
OWNED_DIRS = ("app", "tmp", "root", "tests", "solution")

# Sandbox uids when running as root: unique per (our pid, slot) so two live sandboxes never share one, even
# across processes. pid < 2**22 (Linux PID_MAX_LIMIT) and 256 slots keep every uid below 2**31.
_UID_BASE = 1 << 24
_UID_SLOTS = 256
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _allocate_uid() -> int:
    with _uid_lock:
        base = _UID_BASE + (os.getpid() % (1 << 22)) * _UID_SLOTS
        for slot in range(_UID_SLOTS):
            if base + slot not in _uids_in_use:
                _uids_in_use.add(base + slot)
                return base + slot
    raise SandboxStartError(f"more than {_UID_SLOTS} live sandboxes in one process: no sandbox uid left")


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


@dataclass(frozen=True)
class _Bind:
    target: PurePosixPath  # path in the sandbox
    source: Path  # host dir
    read_only: bool


class _CappedOutput:
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


class LocalSandbox(BaseEnvironment):
    """A Harbor environment: per-trial host dirs, each `exec()` in its own bubblewrap sandbox (see module doc)."""

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: Any,
        task_env_config: Any,
        logger: Any = None,
        *,
        cpu_time_sec: int = 300,
        memory_mb: int = 2048,
        max_processes: int = 256,
        max_file_size_mb: int = 1024,
        max_output_bytes: int = 1_000_000,
        work_dir: str | None = None,
        fail_start_probability: float = 0.0,
        fail_start_seed: int | None = None,
        die_after_execs: int | None = None,
        process_scope: str = "exec",
        **kwargs: Any,
    ):
        """Kwargs (all via `EnvironmentConfig.kwargs`):

        cpu_time_sec: RLIMIT_CPU of every process (CPU seconds; the process gets SIGXCPU/SIGKILL past it).
        memory_mb: RLIMIT_AS of every process (address space, so set it above what programs merely reserve).
            The task's `memory_mb` is not used: it means resident memory, which an rlimit cannot cap.
        max_processes: processes (threads count too) the sandbox may have at once (RLIMIT_NPROC).
        max_file_size_mb: largest file a process may write (RLIMIT_FSIZE). Disk use as a whole is not capped.
        max_output_bytes: stdout and stderr of one exec are each cut to this many bytes (head and tail kept).
        work_dir: where the per-trial temp dirs go (default: the system temp dir).
        fail_start_probability, fail_start_seed: fault injection for tests: `start()` raises
            `SandboxStartError` with this probability. With a seed the draw is a function of (seed, session_id),
            so a retry (a new trial name) draws again while a rerun of the same trial repeats its fate.
        die_after_execs: fault injection: after this many execs the sandbox "dies": every later exec raises
            `SandboxDiedError` (Harbor's own execs, e.g. the verifier's, count too).
        process_scope: "exec" (processes die with their exec) or "trial" (they live until stop(); see module doc).
        Any other kwarg goes to Harbor's `BaseEnvironment` (`auto_mounting` defaults to True here).
        """
        for name, value in (
            ("cpu_time_sec", cpu_time_sec),
            ("memory_mb", memory_mb),
            ("max_processes", max_processes),
            ("max_file_size_mb", max_file_size_mb),
            ("max_output_bytes", max_output_bytes),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LocalSandbox: {name} must be a positive integer, got {value!r}")
        if not 0.0 <= fail_start_probability <= 1.0:
            raise ValueError(f"LocalSandbox: fail_start_probability must be in [0, 1], got {fail_start_probability}")
        if process_scope not in PROCESS_SCOPES:
            raise ValueError(f"LocalSandbox: process_scope must be one of {PROCESS_SCOPES}, got {process_scope!r}")
        if die_after_execs is not None and die_after_execs < 0:
            raise ValueError(f"LocalSandbox: die_after_execs must be >= 0, got {die_after_execs}")
        self.cpu_time_sec = cpu_time_sec
        self.memory_mb = memory_mb
        self.max_processes = max_processes
        self.max_file_size_mb = max_file_size_mb
        self.max_output_bytes = max_output_bytes
        self.work_dir = work_dir
        self.fail_start_probability = fail_start_probability
        self.fail_start_seed = fail_start_seed
        self.die_after_execs = die_after_execs
        self.process_scope = process_scope
        # Log dirs bound from the trial dir, so Harbor reads them in place (as with Docker's bind mounts).
        kwargs.setdefault("auto_mounting", True)
        super().__init__(
            environment_dir=environment_dir,
            environment_name=environment_name,
            session_id=session_id,
            trial_paths=trial_paths,
            task_env_config=task_env_config,
            logger=logger,
            **kwargs,
        )
        self._maybe_resolve_task_env()  # the task's [environment.env] joins every exec's environment
        self._workdir = task_env_config.workdir or DEFAULT_WORKDIR
        self._binds = self._harbor_binds()
        self._root: Path | None = None  # the per-trial temp dir; None until start()
        self._uid: int | None = None  # the sandbox uid when we are root
        self._argv_prefix: list[str] = []
        self._holder: subprocess.Popen[bytes] | None = None  # process_scope="trial": the namespaces' bwrap
        self._enter_prefix: list[str] = []  # process_scope="trial": nsenter into the holder's namespaces
        self._procs: set[asyncio.subprocess.Process] = set()
        self._exec_count = 0
        self._dead_reason: str | None = None

    # ---- Harbor's environment interface -------------------------------------------------------------------

    @staticmethod
    def type() -> str:
        return "grpoflow-local"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # disable_internet: tasks with network_mode="no-network" are accepted. The sandbox never has a network,
        # whatever the task asks: a task that needs one fails in it rather than reaching out.
        return EnvironmentCapabilities(disable_internet=True, mounted=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # No cgroups: the task's cpus/memory are neither limits nor requests here (see the kwargs for rlimits).
        return EnvironmentResourceCapabilities(fractional_cpus=True)

    @classmethod
    def preflight(cls) -> None:
        _require_tools()

    def _validate_definition(self) -> None:
        # The Dockerfile is not used: the image is the host's /usr. Only environment/app/ matters, and it is
        # optional.
        return None

    async def start(self, force_build: bool) -> None:
        self._maybe_inject_start_fault()
        tools = _require_tools()
        try:
            await asyncio.to_thread(self._make_root, tools)
        except OSError as exc:
            raise SandboxStartError(f"could not create the sandbox dirs for {self.session_id}: {exc}") from exc
        if self.process_scope == "trial":
            await self._start_holder(tools)
        # One real command: proves bwrap can create its namespaces here before Harbor starts the agent. Not
        # counted as an exec (die_after_execs counts the trial's own commands).
        try:
            probe = await self._run("true", self._workdir, None, 60)
        except SandboxDiedError as exc:
            raise SandboxStartError(f"sandbox for {self.session_id} failed its start probe: {exc}") from exc
        if probe.return_code != 0:
            raise SandboxStartError(
                f"sandbox for {self.session_id} failed its start probe (exit {probe.return_code}): {probe.stderr}"
            )

    async def stop(self, delete: bool) -> None:
        self._dead_reason = self._dead_reason or "the sandbox was stopped"
        for proc in list(self._procs):
            await (_kill_exec_and_reap(proc) if self._holder is not None else _kill_and_reap(proc))
        if self._holder is not None:
            holder, self._holder = self._holder, None
            await asyncio.to_thread(_stop_holder, holder)
        if self._uid is not None:
            # Belt and braces: the pid namespace already took everything down; anything left with our uid goes.
            await asyncio.to_thread(_kill_uid, self._uid)
            _release_uid(self._uid)
            self._uid = None
        if self._root is not None:
            self._scrub_log_symlinks()
            if delete:
                await asyncio.to_thread(_rmtree, self._root)
                self._root = None

    async def prepare_logs_for_host(self) -> None:
        # Harbor calls this once the agent phase is over, before the verifier runs. In trial scope the agent's
        # processes (its tmux server, whatever the policy left running) end here, so none can touch the files the
        # verifier reads or writes: the verifier sees files, not processes, as with per-exec scope.
        if self._holder is not None and self._dead_reason is None and self._holder.poll() is None:
            await self._end_trial_processes()
        self._scrub_log_symlinks()

    async def _end_trial_processes(self) -> None:
        """SIGKILL every process of a trial-scope sandbox but its init, from inside (twice: a process forking
        while the first sweep runs may leave a child), and as root every process of the sandbox uid."""
        await self._run("kill -9 -1 2>/dev/null; kill -9 -1 2>/dev/null; true", "/", None, 30)
        if self._uid is not None:
            await asyncio.to_thread(_kill_uid, self._uid)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: float | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run `command` with bash in a fresh sandbox. `user` is ignored: every command runs as the sandbox user."""
        if self._root is None or self._dead_reason is not None:
            raise SandboxDiedError(
                f"sandbox {self.session_id}: {self._dead_reason or 'not started'}; cannot run {command[:80]!r}"
            )
        self._exec_count += 1
        if self.die_after_execs is not None and self._exec_count > self.die_after_execs:
            self._dead_reason = f"injected fault: died after {self.die_after_execs} execs"
            raise SandboxDiedError(f"sandbox {self.session_id}: {self._dead_reason}")
        return await self._run(command, cwd or self._workdir, env, timeout_sec)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await asyncio.to_thread(self._upload_file, Path(source_path), target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await asyncio.to_thread(self._upload_dir, Path(source_dir), target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await asyncio.to_thread(self._download_file, source_path, Path(target_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await asyncio.to_thread(self._download_dir, source_dir, Path(target_dir))

    # ---- one exec -----------------------------------------------------------------------------------------

    async def _run(self, command: str, cwd: str, env: dict[str, str] | None, timeout_sec: float | None) -> ExecResult:
        if self._holder is None:  # "trial": the holder's mounts are in place for its whole life
            await asyncio.to_thread(self._repair_mount_points)
        marker_r, marker_w = os.pipe()
        argv = self._exec_argv(command, cwd, marker_w)
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=self._exec_env(env),
                    start_new_session=True,  # bwrap/nsenter leads its own process group: one killpg ends it
                    pass_fds=(marker_w,),
                )
            finally:
                os.close(marker_w)  # the sandbox holds the only write end now: EOF once it closed it
            self._procs.add(proc)
            try:
                return await self._collect(proc, marker_r, command, timeout_sec)
            finally:
                self._procs.discard(proc)
                self._scrub_log_symlinks()
        finally:
            os.close(marker_r)

    async def _collect(
        self, proc: asyncio.subprocess.Process, marker_r: int, command: str, timeout_sec: float | None
    ) -> ExecResult:
        out, err = _CappedOutput(self.max_output_bytes), _CappedOutput(self.max_output_bytes)
        assert proc.stdout is not None and proc.stderr is not None
        readers = [
            asyncio.ensure_future(_drain(proc.stdout, out)),
            asyncio.ensure_future(_drain(proc.stderr, err)),
        ]
        timed_out = False
        trial_scope = self._holder is not None
        try:
            try:
                async with asyncio.timeout(timeout_sec if timeout_sec else None):
                    # asyncio's wait() also waits for the pipes to close, which a background process (trial scope)
                    # may hold open for the rest of the trial: wait for the process itself.
                    await (_process_exit(proc) if trial_scope else proc.wait())
                    if trial_scope:
                        # A background process the command left running may hold the pipes open for the rest of
                        # the trial: take what it wrote by now and stop reading.
                        await asyncio.wait(readers, timeout=BACKGROUND_OUTPUT_GRACE_SEC)
                    else:
                        await asyncio.gather(*readers)
            except TimeoutError:
                timed_out = True
                await (_kill_exec_and_reap(proc) if trial_scope else _kill_and_reap(proc))
                # The pipes close as the pid namespace dies; don't wait forever on a descendant that lingers.
                await asyncio.wait(readers, timeout=5)
        except BaseException:
            # Cancellation (Harbor's agent timeout) or any error: the sandbox must not outlive this call. The
            # kill comes first and is synchronous, so it happens even if the wait below is cut short.
            if trial_scope:
                _kill_group(proc)
            else:
                _kill_sandbox(proc)
            await _reap_after_kill(proc, readers)
            raise
        for reader in readers:
            reader.cancel()  # no-op when they finished
        started = _read_marker(marker_r)
        if self._dead_reason is not None:  # stop() ran meanwhile and killed the command
            raise SandboxDiedError(f"sandbox {self.session_id}: {self._dead_reason} during {command[:80]!r}")
        if timed_out:
            note = f"\n[grpoflow sandbox] command timed out after {timeout_sec} s and was killed\n"
            return ExecResult(stdout=out.text(), stderr=err.text() + note, return_code=TIMEOUT_EXIT_CODE)
        if not started:
            raise SandboxDiedError(
                f"sandbox {self.session_id} failed before running the command "
                f"(bwrap exit {proc.returncode}): {err.text().strip()[:2000]}"
            )
        if self._holder is not None and self._holder.poll() is not None:
            raise SandboxDiedError(
                f"sandbox {self.session_id}: its namespaces ended (bwrap exit {self._holder.returncode}) during "
                f"{command[:80]!r}"
            )
        if trial_scope and proc.returncode is not None and proc.returncode < 0:
            # nsenter re-raises the signal that killed the command on itself: report it as a shell would.
            return ExecResult(stdout=out.text(), stderr=err.text(), return_code=128 - proc.returncode)
        if proc.returncode is not None and proc.returncode < 0:
            # bwrap itself was killed by a signal (nothing in the sandbox can see it): the host killed it.
            raise SandboxDiedError(
                f"sandbox {self.session_id}: bwrap was killed by signal {-proc.returncode} during {command[:80]!r}"
            )
        return ExecResult(stdout=out.text(), stderr=err.text(), return_code=proc.returncode or 0)

    def _exec_argv(self, command: str, cwd: str, marker_fd: int) -> list[str]:
        # The wrapper proves the sandbox came up (a byte on marker_fd, which it then closes so the command can't
        # touch it); a failure before that byte is the sandbox's, after it the command's. `cd` is done here, not
        # with bwrap's --chdir, so a missing cwd is the command's failure, not the sandbox's.
        wrapper = f'printf 1 >&{marker_fd}; exec {marker_fd}>&-; cd -- "$1" || exit 1; exec /bin/bash -c "$2"'
        prefix = self._enter_prefix if self._holder is not None else self._argv_prefix
        return [*prefix, *self._limits_argv(), "/bin/bash", "-c", wrapper, "grpoflow-exec", cwd, command]

    async def _start_holder(self, tools: dict[str, str]) -> None:
        """process_scope="trial": start the bwrap that holds the trial's namespaces and learn its pid 1."""
        info_r, info_w = os.pipe()
        ready_r, ready_w = os.pipe()
        # --as-pid-1: the bash loop is the namespace's init, so signals from inside never reach it, and it reaps
        # the orphans a command leaves (bash reaps any child on SIGCHLD). bwrap reports the child's pid on the
        # info fd before the child has built its mounts; the loop's byte on ready_w says it has.
        loop = f"printf 1 >&{ready_w}; exec {ready_w}>&-; {HOLDER_LOOP}"
        argv = [*self._argv_prefix[:-1], "--as-pid-1", "--info-fd", str(info_w), "--", "/bin/bash", "-c", loop]
        try:
            try:
                # A plain Popen, not an asyncio process: stop() may run in another event loop than start().
                holder = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                    env=self._exec_env(None), start_new_session=True, pass_fds=(info_w, ready_w),
                )  # fmt: skip
            finally:
                os.close(info_w)
                os.close(ready_w)
            info = await asyncio.to_thread(_read_info, info_r)
            ready = await asyncio.to_thread(os.read, ready_r, 1)  # b"" (EOF): the holder died setting up
        finally:
            os.close(info_r)
            os.close(ready_r)
        match = re.search(rb'"child-pid"\s*:\s*(\d+)', info)
        if match is None or not ready:
            await asyncio.to_thread(_stop_holder, holder)
            err = holder.stderr.read().decode(errors="replace").strip() if holder.stderr else ""
            raise SandboxStartError(f"sandbox for {self.session_id}: bwrap did not start its namespaces: {err[:2000]}")
        self._holder = holder
        argv = [tools["nsenter"], f"--target={match.group(1).decode()}", "--mount", "--pid", "--net", "--ipc", "--uts",
                "--cgroup"]
        if os.geteuid() != 0:
            argv += ["--user", "--preserve-credentials"]  # bwrap made a user namespace for a normal user
        self._enter_prefix = [*argv, "--root", "--wd", "--"]

    def _limits_argv(self) -> list[str]:
        nproc = self.max_processes
        if self._uid is None:
            # Without a uid of our own, RLIMIT_NPROC counts every process of this user on the host.
            nproc += _count_uid_processes(os.getuid())
        limits = {
            "as": (resource.RLIMIT_AS, self.memory_mb * 2**20),
            "cpu": (resource.RLIMIT_CPU, self.cpu_time_sec),
            "nproc": (resource.RLIMIT_NPROC, nproc),
            "fsize": (resource.RLIMIT_FSIZE, self.max_file_size_mb * 2**20),
            "core": (resource.RLIMIT_CORE, 0),
        }
        argv = [_PRLIMIT]
        for name, (res, want) in limits.items():
            hard = resource.getrlimit(res)[1]
            # Never above our own hard limit: a non-root prlimit could not raise it and would fail.
            value = want if hard == resource.RLIM_INFINITY else min(want, hard)
            argv.append(f"--{name}={value}")
        argv.append("--")
        if self._uid is not None:
            argv += [
                _SETPRIV,
                f"--reuid={self._uid}",
                f"--regid={self._uid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--",
            ]
        return argv

    def _exec_env(self, env: dict[str, str] | None) -> dict[str, str]:
        base = {"PATH": SANDBOX_PATH, "HOME": SANDBOX_HOME, "LANG": "C.UTF-8"}
        if self._uid is not None:
            base["USER"] = base["LOGNAME"] = "sandbox"  # the name our passwd entry gives the sandbox uid
        return {**base, **(self._merge_env(env) or {})}

    # ---- start: the per-trial tree ------------------------------------------------------------------------

    def _maybe_inject_start_fault(self) -> None:
        if self.fail_start_probability <= 0.0:
            return
        rng = random.Random(f"{self.fail_start_seed}/{self.session_id}") if self.fail_start_seed is not None else random
        if rng.random() < self.fail_start_probability:
            raise SandboxStartError(
                f"injected fault: sandbox {self.session_id} failed to start "
                f"(fail_start_probability={self.fail_start_probability})"
            )

    def _make_root(self, tools: dict[str, str]) -> None:
        base = Path(self.work_dir) if self.work_dir else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", self.session_id)[:60]
        root = Path(tempfile.mkdtemp(prefix=f"grpoflow-sandbox-{name}-", dir=base))
        self._root = root  # mkdtemp's 0700 stays: bwrap binds it as root, the sandbox only sees the mount
        if os.geteuid() == 0:
            self._uid = _allocate_uid()
        rootfs = root / "rootfs"
        rootfs.mkdir(mode=0o755)
        extra_ro: list[str] = []
        for lib in HOST_LIB_NAMES:
            host = Path("/", lib)
            if host.is_symlink():
                (rootfs / lib).symlink_to(os.readlink(host))
            elif host.is_dir():
                extra_ro.append(f"/{lib}")  # a host without merged /usr: show the real dir read-only
        for owned in OWNED_DIRS:
            (rootfs / owned).mkdir()
        (rootfs / "tmp").chmod(0o1777)
        app = self.environment_dir / "app"
        if app.is_dir():
            shutil.copytree(app, rootfs / "app", symlinks=True, dirs_exist_ok=True)
        for owned in OWNED_DIRS:
            self._give(rootfs / owned)
        for bind in self._binds:
            bind.source.mkdir(parents=True, exist_ok=True)
            if self._uid is not None and bind in self._log_binds():
                bind.source.chmod(0o777)  # as Harbor does for Docker: the sandbox user writes its logs there
        self._repair_mount_points()
        if not self.auto_mounting:
            # Harbor's log dirs are then plain sandbox dirs that Harbor downloads; the sandbox writes them.
            for rel in ("logs/agent", "logs/verifier", "logs/artifacts"):
                (rootfs / rel).mkdir(parents=True, exist_ok=True)
                self._give(rootfs / rel)
        argv = [tools["bwrap"], "--bind", str(rootfs), "/"]
        for ro in (*HOST_RO_DIRS, *extra_ro):
            argv += ["--ro-bind", ro, ro]
        if self._uid is not None:
            # The host's passwd/group plus a `sandbox` entry for our uid: tools that look the user up (git,
            # whoami, ssh) fail when the uid has no name.
            for name, line in (
                ("passwd", f"sandbox:x:{self._uid}:{self._uid}:sandbox:{SANDBOX_HOME}:/bin/bash\n"),
                ("group", f"sandbox:x:{self._uid}:\n"),
            ):
                host = Path("/etc", name)
                text = host.read_text() if host.is_file() else ""
                (root / name).write_text(text + ("" if text.endswith("\n") or not text else "\n") + line)
                argv += ["--ro-bind", str(root / name), str(host)]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        for bind in self._binds:
            argv += ["--ro-bind" if bind.read_only else "--bind", str(bind.source), str(bind.target)]
        argv += [
            "--unshare-net",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--hostname",
            "sandbox",
            "--die-with-parent",
            "--new-session",
            "--chdir",
            "/",
            "--",
        ]
        self._argv_prefix = argv

    def _harbor_binds(self) -> list[_Bind]:
        """Harbor's host mounts (log dirs, user mounts) as bwrap binds, parents before children."""
        binds = []
        for mount in self._host_mounts:
            if mount["type"] != "bind":
                raise ValueError(f"LocalSandbox supports bind mounts only, got {mount['type']!r} for {mount['target']}")
            target = PurePosixPath(posixpath.normpath(mount["target"]))
            if not target.is_absolute() or target == PurePosixPath("/") or _under(target, NOT_TRIAL_PATHS):
                raise ValueError(f"LocalSandbox cannot mount over {target}")
            binds.append(_Bind(target, Path(mount["source"]).resolve(), bool(mount.get("read_only"))))
        return sorted(binds, key=lambda b: len(b.target.parts))

    def _log_binds(self) -> list[_Bind]:
        """Harbor's log dirs (/logs/agent, /logs/verifier, /logs/artifacts), bound from the trial dir."""
        return [b for b in self._binds if not b.read_only and _under(b.target, ("/logs",))]

    def _repair_mount_points(self) -> None:
        """Make every bind target under rootfs a real dir again before bwrap mounts over it.

        bwrap runs with privilege and follows symlinks in mount targets; a sandbox that replaced e.g. /logs with
        a link to a host path must not make the next bwrap create dirs there. (Root-owned rootfs prevents that
        when we run as root; this also covers running as a normal user.)
        """
        assert self._root is not None
        rootfs = self._root / "rootfs"
        targets = [PurePosixPath(p) for p in (*HOST_RO_DIRS, "/proc", "/dev")] + [b.target for b in self._binds]
        for target in targets:
            path = rootfs
            for part in target.parts[1:]:
                path = path / part
                if path.is_symlink() or (path.exists() and not path.is_dir()):
                    _remove(path)
                if not path.exists():
                    path.mkdir(mode=0o755)

    def _give(self, path: Path) -> None:
        """Hand a per-trial path (recursively) to the sandbox uid, so the sandbox can change what we put there."""
        if self._uid is None:
            return
        os.lchown(path, self._uid, self._uid)
        if path.is_dir() and not path.is_symlink():
            for dirpath, dirnames, filenames in os.walk(path):
                for name in dirnames + filenames:
                    os.lchown(os.path.join(dirpath, name), self._uid, self._uid)

    # ---- files in and out ---------------------------------------------------------------------------------

    def _host_path(self, sandbox_path: str) -> tuple[Path, Path]:
        """(host path, host dir it must stay inside) for a path in the sandbox."""
        if self._root is None:
            raise SandboxDiedError(f"sandbox {self.session_id} is not started (or was deleted): no {sandbox_path}")
        path = PurePosixPath(posixpath.normpath(posixpath.join(self._workdir, sandbox_path)))
        for bind in reversed(self._binds):  # deepest first
            if path == bind.target or path.is_relative_to(bind.target):
                return bind.source.joinpath(*path.relative_to(bind.target).parts), bind.source
        if _under(path, NOT_TRIAL_PATHS):
            raise ValueError(f"{sandbox_path} is a host or kernel path in the sandbox, not a per-trial file")
        rootfs = self._root / "rootfs"
        return rootfs.joinpath(*path.parts[1:]), rootfs

    def _real_dir_chain(self, base: Path, host_dir: Path) -> None:
        """Create host_dir under base as real dirs, replacing any symlink the sandbox planted on the way."""
        path = base
        for part in host_dir.relative_to(base).parts:
            path = path / part
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                _remove(path)
            if not path.exists():
                path.mkdir()
                self._give(path)

    def _upload_file(self, source: Path, target_path: str) -> None:
        target, base = self._host_path(target_path)
        self._real_dir_chain(base, target.parent)
        if target.is_symlink() or target.is_dir():
            _remove(target)  # never write through a link the sandbox planted
        shutil.copy2(source, target)
        self._give(target)

    def _upload_dir(self, source: Path, target_dir: str) -> None:
        if not source.is_dir():
            raise FileNotFoundError(f"upload_dir: {source} is not a directory")
        target, base = self._host_path(target_dir)
        self._real_dir_chain(base, target)
        for dirpath, dirnames, filenames in os.walk(source):
            rel = Path(dirpath).relative_to(source)
            here = target / rel
            for name in dirnames:
                self._real_dir_chain(base, here / name)
            for name in filenames:
                dest = here / name
                if dest.is_symlink() or dest.is_dir():
                    _remove(dest)
                shutil.copy2(Path(dirpath, name), dest, follow_symlinks=True)
                self._give(dest)

    def _download_source(self, sandbox_path: str) -> Path:
        """The host file behind a sandbox path, refusing links that lead out of the sandbox's own files."""
        source, base = self._host_path(sandbox_path)
        real = Path(os.path.realpath(source))
        if not _inside(real, base):
            raise PermissionError(f"{sandbox_path} resolves outside the sandbox's files; not copied to the host")
        return real

    def _download_file(self, source_path: str, target: Path) -> None:
        real = self._download_source(source_path)
        if not real.is_file():
            raise FileNotFoundError(f"{source_path} is not a regular file in the sandbox")
        if target.exists() and os.path.samefile(real, target):
            return  # a mounted path: already on the host
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(real, target)

    def _download_dir(self, source_dir: str, target: Path) -> None:
        real = self._download_source(source_dir)
        if not real.is_dir():
            raise FileNotFoundError(f"{source_dir} is not a directory in the sandbox")
        target.mkdir(parents=True, exist_ok=True)
        if os.path.samefile(real, target):
            return  # a mounted path: already on the host
        # symlinks=True copies links as links (never reads a host file through one); FIFOs and devices are
        # skipped (reading a FIFO would block forever).
        shutil.copytree(real, target, symlinks=True, dirs_exist_ok=True, ignore=_special_files)

    def _scrub_log_symlinks(self) -> None:
        """Delete symlinks in the mounted Harbor log dirs that point outside them.

        Harbor reads those dirs on the host (as root, maybe): a link to a host file must not turn into a copy
        of it in the trial's results.
        """
        for bind in self._log_binds():
            if not bind.source.is_dir():
                continue
            for dirpath, dirnames, filenames in os.walk(bind.source):
                for name in dirnames + filenames:
                    path = os.path.join(dirpath, name)
                    if os.path.islink(path) and not _inside(Path(os.path.realpath(path)), bind.source):
                        with contextlib.suppress(FileNotFoundError):  # removed meanwhile: what we wanted
                            os.unlink(path)


# ---- helpers ------------------------------------------------------------------------------------------------

_PRLIMIT = "/usr/bin/prlimit"
_SETPRIV = "/usr/bin/setpriv"
_NSENTER = "/usr/bin/nsenter"


def _require_tools() -> dict[str, str]:
    """Host tools the sandbox needs; a clear error naming the package when one is missing."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailableError(
            "bubblewrap (`bwrap`) is not installed or not on PATH; LocalSandbox needs it: "
            "apt-get install -y bubblewrap (or your distribution's bubblewrap package)"
        )
    for tool in (_PRLIMIT, _SETPRIV, _NSENTER, "/bin/bash"):
        if not os.access(tool, os.X_OK):
            raise SandboxUnavailableError(
                f"{tool} is missing; LocalSandbox runs it inside the sandbox: apt-get install -y util-linux bash"
            )
    return {"bwrap": bwrap, "nsenter": _NSENTER}


async def _drain(stream: asyncio.StreamReader, sink: _CappedOutput) -> None:
    while chunk := await stream.read(65536):
        sink.add(chunk)


def _read_marker(fd: int) -> bool:
    os.set_blocking(fd, False)
    try:
        return bool(os.read(fd, 16))
    except BlockingIOError:
        return False  # nothing written and a write end still open somewhere: the wrapper never ran


def _kill_sandbox(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the pid namespace of one exec, synchronously.

    The target is bwrap's child, pid 1 of the namespace: when it dies the kernel kills (and reaps) every process
    in the namespace, whatever session or process group they moved to, and bwrap, still alive, reaps pid 1 and
    exits. Killing bwrap instead would also work (--die-with-parent) but would leave pid 1's zombie to the
    host's init, which in a container may never reap it. Before bwrap has a child, its process group goes.
    """
    if proc.returncode is not None:
        return
    children = _children(proc.pid)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(pid, signal.SIGKILL)
    if not children:
        _kill_group(proc)


async def _kill_exec_and_reap(proc: asyncio.subprocess.Process) -> None:
    """Trial scope: SIGKILL one exec's process group (nsenter and the command it forked), not the namespace."""
    _kill_group(proc)
    await _process_exit(proc)  # not proc.wait(): a process that left the group may hold the pipes open


async def _process_exit(proc: asyncio.subprocess.Process) -> None:
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


def _stop_holder(holder: subprocess.Popen[bytes]) -> None:
    """SIGKILL pid 1 of a trial's namespaces (the kernel then kills every process in them) and reap bwrap."""
    if holder.poll() is None:
        for pid in _children(holder.pid):
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


def _read_info(fd: int) -> bytes:
    """bwrap's --info-fd JSON: read up to its closing brace (the fd may stay open in the sandbox) or EOF."""
    data = b""
    while b"}" not in data and (chunk := os.read(fd, 4096)):
        data += chunk
    return data


async def _kill_and_reap(proc: asyncio.subprocess.Process) -> None:
    _kill_sandbox(proc)
    try:
        await asyncio.wait_for(proc.wait(), timeout=2)
    except TimeoutError:
        _kill_group(proc)  # bwrap did not exit after its child died: take it down too
        await proc.wait()


async def _reap_after_kill(proc: asyncio.subprocess.Process, readers: list[asyncio.Future[None]]) -> None:
    """Let bwrap exit and its pipes close after `_kill_sandbox`, so no half-closed transport is left behind.

    Best effort: runs while a CancelledError is being handled; a second cancellation just ends the wait (the
    processes are already dead or dying), and the caller re-raises the original exception either way.
    """
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=2)
        await asyncio.wait_for(asyncio.gather(*readers, return_exceptions=True), timeout=2)
    except (TimeoutError, asyncio.CancelledError):
        for reader in readers:
            reader.cancel()


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap leads its own group (start_new_session)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []  # bwrap already exited, or a kernel without CONFIG_PROC_CHILDREN: fall back to the group


def _uid_pids(uid: int) -> list[int]:
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


def _count_uid_processes(uid: int) -> int:
    return len(_uid_pids(uid))


def _kill_uid(uid: int, wait_sec: float = 5.0) -> None:
    """SIGKILL every process running as `uid` (a sandbox uid of ours) and wait until they are gone."""
    deadline = time.monotonic() + wait_sec
    while pids := _uid_pids(uid):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)


def _under(path: PurePosixPath, prefixes: tuple[str, ...]) -> bool:
    return any(path == PurePosixPath(p) or path.is_relative_to(p) for p in prefixes)


def _inside(path: Path, base: Path) -> bool:
    real_base = Path(os.path.realpath(base))
    return path == real_base or path.is_relative_to(real_base)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        _rmtree(path)
    else:
        path.unlink()


def _rmtree(path: Path) -> None:
    def retry_writable(func: Any, failed: str, exc: BaseException) -> None:
        # The sandbox may leave dirs without write permission (chmod 000); as a normal user we must restore
        # it before deleting their contents. Root never gets here.
        if not isinstance(exc, PermissionError):
            raise exc
        parent = os.path.dirname(failed)
        os.chmod(parent, stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, stat.S_IRWXU)
            shutil.rmtree(failed, onexc=retry_writable)
        else:
            func(failed)

    shutil.rmtree(path, onexc=retry_writable)


def _special_files(directory: str, names: list[str]) -> set[str]:
    skipped = set()
    for name in names:
        mode = os.lstat(os.path.join(directory, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            skipped.add(name)
    return skipped
