"""`LocalSandbox`: a Harbor environment that runs every `exec()` in a fresh bubblewrap sandbox on this machine.

Select it with `EnvironmentConfig(import_path=LOCAL_SANDBOX_IMPORT_PATH, kwargs={...})`. One trial = one temp dir
on the host; each command is one short-lived `bwrap` process over it, with the network its task's policy names
(`network`: none, public, or an allowlist; switched between phases), the host's /usr and /etc read-only, its own
/app, /logs, /tests, /solution, /tmp, a cgroup of the trial's (memory, pids and cpus as Docker limits them;
`cgroups`), rlimits and (as root) a uid of its own. With
`process_scope="trial"` one bwrap per trial holds the namespaces, so a tmux server lives across execs
(terminus-2). With `session_bridge` the sandbox's loopback port reaches one host address (the session server)
through a unix socket (`bridge`); with `cli_dir` a host dir of npm-installed CLIs is shown read-only and put on
PATH (claude-code, opencode: installed once by prepare, since the sandbox cannot reach npm). Failing to start or
set up raises `SandboxStartError` / `SandboxDiedError` (retried); bwrap missing
raises `SandboxUnavailableError` (not retried). A task whose Dockerfile does more than the host rootfs reproduces
(`grpoflow.dockerfile`) runs on its image's exported tree instead of the host's /usr, with the image's
WORKDIR and ENV (`images`: built with Docker once per build context; a failed build is an `ImageBuildError`, a
sandbox failure). The filesystem, isolation, lifetimes and failures in detail: docs/embedded.md. `rootfs` builds
the per-trial tree, `processes` runs and reaps the host processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.models.task.config import NetworkPolicy
from harbor.models.trial.config import ResourceMode
from pydantic import ValidationError

from grpoflow.dockerfile import host_rootfs_problem
from grpoflow.embedded.sandbox.bridge import FORWARDER, Bridge
from grpoflow.embedded.sandbox.cgroups import CgroupUnavailable, Limits, TrialCgroup, unavailable_reason
from grpoflow.embedded.sandbox.cgroups import create as create_cgroup
from grpoflow.embedded.sandbox.images import TaskImage, hold, task_image
from grpoflow.embedded.sandbox.network import TrialNetwork, needs_network
from grpoflow.embedded.sandbox.orphans import claim
from grpoflow.embedded.sandbox.processes import (
    HOST_ENV,
    CappedOutput,
    allocate_uid,
    drain,
    kill_and_reap,
    kill_exec_and_reap,
    kill_group,
    kill_sandbox,
    kill_uid,
    launch_argv,
    missing_tools,
    process_exit,
    read_marker,
    reap_after_kill,
    release_uid,
    require_tools,
    rlimits,
    start_holder,
    stop_holder,
)
from grpoflow.embedded.sandbox.rootfs import (
    HOST_BASE,
    Base,
    BaseTreeError,
    Bind,
    Sources,
    build_rootfs,
    bwrap_argv,
    copy_dir_in,
    copy_dir_out,
    copy_file_in,
    copy_file_out,
    harbor_binds,
    host_path,
    image_base,
    make_trial_dir,
    network_mount_points,
    repair_mount_points,
    resolve_inside,
    rmtree,
    scrub_log_symlinks,
    tree_bytes,
    unmount_layer,
)
from grpoflow.embedded.sandbox.seccomp import filter_fd
from grpoflow.errors import one_line
from grpoflow.paths import default_cache_dir
from grpoflow.rollout.environments import (
    SANDBOX_PYTHON,
    ImageBuildError,
    SandboxDiedError,
    SandboxStartError,
)
from grpoflow.sandbox_settings import ALLOWLIST_FORMS, LocalSandboxSettings, sandbox_kwargs_problem

DEFAULT_STORAGE_MB = 10240  # a trial's own files, when neither the sandbox's settings nor the task set it
DEFAULT_MEMORY_MB = 2048  # a trial's memory, when neither the sandbox's settings nor the task set it
# Trial scope: after a command exits, how long to keep reading output a background process may still write.
BACKGROUND_OUTPUT_GRACE_SEC = 0.5
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TIMEOUT_EXIT_CODE = 124  # what GNU `timeout` returns; Harbor's singularity environment reports the same
DEFAULT_WORKDIR = "/app"
BRIDGE_DIR = PurePosixPath("/run/grpoflow")  # the bridge's socket and forwarder, read-only in the sandbox
CLI_DIR = PurePosixPath("/opt/grpoflow/cli")  # `cli_dir`, read-only; its node_modules/.bin goes on PATH
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class LocalSandbox(BaseEnvironment):
    """A Harbor environment: per-trial host dirs, each `exec()` in its own bubblewrap sandbox (see module doc)."""

    @classmethod
    def preflight(cls) -> None:
        """Harbor's check before any trial: the host tools the sandbox runs, each missing one on a line."""
        problems = missing_tools()
        if problems:
            raise SystemExit("\n".join(problems))

    @classmethod
    def limits_notice(cls) -> str | None:
        """Where no trial can have a cgroup here: what that changes, as one line (None where one can)."""
        reason = unavailable_reason()
        if reason is None:
            return None
        return (
            f"no cgroup for the trials ({reason}): memory is capped per process as address space (RLIMIT_AS, "
            "rollout.sandbox.kwargs.address_space_mb), which a JVM or Node may exceed at start, and cpus are not "
            "enforced"
        )

    Settings: ClassVar[type[LocalSandboxSettings]] = LocalSandboxSettings  # what `rollout.sandbox.kwargs` sets

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: Any,
        task_env_config: Any,
        logger: Any = None,
        *,
        session_bridge: str | None = None,
        cli_dir: str | None = None,
        base_images: dict[str, str],
        **kwargs: Any,
    ):
        """Kwargs (all via `EnvironmentConfig.kwargs`): the settings of `Settings` (`rollout.sandbox.kwargs`, which
        the run config checked with the same model; each is described there), validated here first; and three that
        grpoflow sets itself:

        session_bridge: "host:port" that the sandbox reaches at 127.0.0.1:<port> (needs process_scope "trial": the
            forwarder lives in the trial's network namespace), and nothing else.
        cli_dir: a host dir with node_modules/.bin (an `npm install --prefix`), read-only at /opt/grpoflow/cli.
        base_images: `dataset.base_images` (required, so a sandbox built without the run's config cannot quietly
            build from other images): the FROM references a Dockerfile-built task's image builds from another
            local image.
        The task's `memory_mb`, `cpus` and `storage_mb` apply where the settings give none (as Harbor's resource
        policy reads them; memory else DEFAULT_MEMORY_MB, storage else DEFAULT_STORAGE_MB, cpus else no quota). Any
        other kwarg goes to Harbor's `BaseEnvironment` (`auto_mounting` defaults to True here).
        """
        given = {name: kwargs.pop(name) for name in list(kwargs) if name in self.Settings.model_fields}
        try:
            self.settings = settings = self.Settings.model_validate(given)
        except ValidationError as err:  # as the run config words it, naming the setting
            raise ValueError(sandbox_kwargs_problem(given, type(self).__name__, self.Settings)) from err
        self._bridge_to: tuple[str, int] | None = None
        if session_bridge is not None:
            host, _, port = str(session_bridge).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"LocalSandbox: session_bridge must be host:port, got {session_bridge!r}")
            if settings.process_scope != "trial":
                raise ValueError("LocalSandbox: session_bridge needs process_scope='trial' (the forwarder must live)")
            self._bridge_to = (host.strip("[]"), int(port))
        if cli_dir is not None and not (Path(cli_dir) / "node_modules" / ".bin").is_dir():
            raise ValueError(f"LocalSandbox: cli_dir {cli_dir} has no node_modules/.bin (an npm install --prefix)")
        self.cli_dir = Path(cli_dir) if cli_dir is not None else None
        self.base_images = dict(base_images)
        self._bridge: Bridge | None = None
        self._bridge_dir: Path | None = None  # the bridge's socket and forwarder (a short path: see _own_binds)
        self._own: list[Bind] = []  # our read-only binds (bridge, CLIs), set when the trial dir is made
        self.image_cache_dir = Path(settings.image_cache_dir or default_cache_dir() / "images")
        self.base: Base = HOST_BASE  # the system dirs: an image's tree once start() built it (tasks that need one)
        self.image: TaskImage | None = None
        self._image_lock: int | None = None  # a shared lock on the image's cache entry while this sandbox lives
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
        self.storage_mb = settings.storage_mb or task_env_config.storage_mb or DEFAULT_STORAGE_MB
        # As Harbor's Docker environment applies them: the task's (after overrides), limits unless its policy says
        # to ignore them.
        task_memory = self._resource_limit_value("memory", auto_mode=ResourceMode.LIMIT)
        self.memory_mb = settings.memory_mb or task_memory or DEFAULT_MEMORY_MB
        self.cpus = self._resource_limit_value("cpu", auto_mode=ResourceMode.LIMIT)
        self._cgroup: TrialCgroup | None = None  # made at start(); None where no cgroup can be had (RLIMIT_AS)
        self._limited_by: str | None = None  # "cgroup v1"/"cgroup v2"/"RLIMIT_AS" from start() until recorded
        self._needs_image = host_rootfs_problem(self.environment_dir) is not None
        self._binds = harbor_binds(self._host_mounts)
        self._root: Path | None = None  # the per-trial temp dir; None until start()
        self._layer: Path | None = None  # as root on an image: the overlay's upper and work dirs, in the trial dir
        self._start_bytes = 0  # the trial's files as it began (with a layer: the inodes the chown copied up)
        self._making_root = threading.Lock()  # held while start() makes the trial dir; stop() waits for it
        self._uid: int | None = None  # the sandbox uid when we are root
        self._argv_prefix: list[str] = []  # bwrap's, up to its "--"
        self._sources = Sources(staged=False)  # what bwrap mounts, as the launcher stages it (see Sources)
        self._holder: subprocess.Popen[bytes] | None = None  # process_scope="trial": the namespaces' bwrap
        self._holder_pids: tuple[int, ...] = ()  # that bwrap and its child, pid 1 inside: uid U, never swept
        self._procs: set[asyncio.subprocess.Process] = set()
        self._dead_reason: str | None = None
        # A network namespace of the trial's own where any of its policies lets out more than loopback (made at
        # start); else bwrap's empty one.
        self._wants_network = needs_network([self._network_policy, *self._phase_network_policies])
        self._network: TrialNetwork | None = None

    # ---- Harbor's environment interface -------------------------------------------------------------------

    @staticmethod
    def type() -> str:
        return "grpoflow-local"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # Every network mode, switched between phases (network.py); of allowlist entries, the forms it enforces.
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            **dict.fromkeys(ALLOWLIST_FORMS.values(), True),
            dynamic_network_policy=True,
            mounted=True,
        )

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        # Harbor switches between its phases' policies (e.g. an agent without network, a verifier with it);
        # every policy the trial may need was known at start, when its network namespace was made or not.
        if self._network is not None:
            await asyncio.to_thread(self._network.apply, network_policy)
        elif needs_network([network_policy]):
            raise RuntimeError(
                f"sandbox {self.session_id}: asked for {network_policy.network_mode.value} network, which none of "
                "its policies at start named"
            )

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # The trial's cgroup makes the task's cpus and memory hard limits; without one, memory is an address-space
        # cap per process and cpus are not enforced.
        cgroup = unavailable_reason() is None
        return EnvironmentResourceCapabilities(cpu_limit=cgroup, memory_limit=cgroup, fractional_cpus=True)

    def _validate_definition(self) -> None:
        # A Dockerfile the host rootfs reproduces is not built (the host's /usr is the image, environment/app/ is
        # /app); any other is built at start(). Prepare has refused tasks whose image cannot be built here.
        return None

    async def start(self, force_build: bool) -> None:
        tools = require_tools()
        if self._needs_image:
            await asyncio.to_thread(self._use_image)
        try:
            await asyncio.to_thread(self._make_root, tools)
        except OSError as exc:
            raise SandboxStartError(f"could not create the sandbox dirs for {self.session_id}: {exc}") from exc
        if self._network is not None:
            await asyncio.to_thread(self._network.apply, self._network_policy)
        if self.settings.process_scope == "trial":
            # The bwrap that holds the trial's namespaces; every exec then joins them through the launcher.
            seccomp = filter_fd()
            try:
                self._holder, holder_pid = await start_holder(
                    lambda argv: self._launch(argv, stage=self._sources.stage()),
                    self._bwrap_prefix(seccomp),
                    (seccomp,),
                    self.session_id,
                )
            finally:
                os.close(seccomp)
            self._holder_pids = (self._holder.pid, int(holder_pid))
        if self._bridge_to is not None:
            await self._open_bridge()
        # One real command: proves bwrap can create its namespaces here before Harbor starts the agent.
        try:
            probe = await self._run("true", self._workdir, None, 60)
        except SandboxDiedError as exc:
            raise SandboxStartError(f"sandbox for {self.session_id} failed its start probe: {exc}") from exc
        if probe.return_code != 0:
            raise SandboxStartError(
                f"sandbox for {self.session_id} failed its start probe (exit {probe.return_code}): {probe.stderr}"
            )

    async def _open_bridge(self) -> None:
        assert self._bridge_dir is not None and self._bridge_to is not None
        host, port = self._bridge_to
        try:
            self._bridge = await asyncio.to_thread(Bridge, self._bridge_dir / "session.sock", host, port)
        except OSError as exc:
            raise SandboxStartError(f"sandbox {self.session_id}: could not open its session bridge: {exc}") from exc
        started = await self._run(
            f"{SANDBOX_PYTHON} {BRIDGE_DIR}/forward.py {port} {BRIDGE_DIR}/session.sock", "/", None, 30
        )
        if started.return_code != 0:
            raise SandboxStartError(
                f"sandbox {self.session_id}: its session bridge did not start (exit {started.return_code}): "
                f"{one_line(started.stderr, 500)}"
            )

    async def stop(self, delete: bool) -> None:
        self._dead_reason = self._dead_reason or "the sandbox was stopped"
        if self._bridge is not None:
            bridge, self._bridge = self._bridge, None
            await asyncio.to_thread(bridge.close)
        if self._bridge_dir is not None:  # only the socket and the forwarder: nothing of the trial's to keep
            await asyncio.to_thread(rmtree, self._bridge_dir)
            self._bridge_dir = None
        try:
            for proc in list(self._procs):
                await (kill_exec_and_reap(proc) if self._holder is not None else kill_and_reap(proc))
            if self._holder is not None:
                holder, self._holder = self._holder, None
                await asyncio.to_thread(stop_holder, holder)
            if self._uid is not None:
                # Belt and braces: the pid namespace already took everything down; anything left with our uid goes.
                await asyncio.to_thread(kill_uid, self._uid)
                release_uid(self._uid)
                self._uid = None
            try:
                if self._limited_by is not None:
                    await asyncio.to_thread(self._record_resources)
            finally:
                if self._cgroup is not None:
                    cgroup, self._cgroup = self._cgroup, None
                    await asyncio.to_thread(cgroup.remove)
        finally:
            try:
                await self._remove_root(delete)
            finally:
                await asyncio.to_thread(self._close_network)

    def _close_network(self) -> None:
        """End slirp4netns and let the namespace go (its processes are gone). After the trial dir's lock: a start
        still making the dir, its caller cancelled, may yet make the network."""
        with self._making_root:
            network, self._network = self._network, None
        if network is not None:
            network.close()

    async def _remove_root(self, delete: bool) -> None:
        """Detach the trial's layer (its changes stay in the upper dir), then let the image go and, with `delete`,
        the trial dir. A start still making the dir (its caller cancelled, the thread going on) finishes first:
        its mount must not be made after the unmount."""
        await asyncio.to_thread(self._making_root.acquire)
        try:
            if self._root is not None and self._layer is not None:
                await asyncio.to_thread(unmount_layer, self._root)
            if self._image_lock is not None:  # after the unmount: the image's tree may be collected from here on
                os.close(self._image_lock)
                self._image_lock = None
            if self._root is not None:
                scrub_log_symlinks(self._binds)
                if delete:
                    await asyncio.to_thread(rmtree, self._root)
                    self._root = None
        finally:
            self._making_root.release()

    async def prepare_logs_for_host(self) -> None:
        # Harbor calls this once the agent phase is over, before the verifier runs. In trial scope the agent's
        # processes (its tmux server, whatever the policy left running) end here, so none can touch the files the
        # verifier reads or writes: the verifier sees files, not processes, as with per-exec scope.
        if self._holder is not None and self._dead_reason is None and self._holder.poll() is None:
            await self._end_trial_processes()
        scrub_log_symlinks(self._binds)

    async def _end_trial_processes(self) -> None:
        """SIGKILL every process of a trial-scope sandbox but its init, from inside (twice: a process forking
        while the first sweep runs may leave a child), and as root every process of the sandbox uid."""
        await self._run("kill -9 -1 2>/dev/null; kill -9 -1 2>/dev/null; true", "/", None, 30)
        if self._uid is not None:  # the holder's bwrap and pid 1 run as the sandbox uid too: they stay
            await asyncio.to_thread(kill_uid, self._uid, spare=self._holder_pids)

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
        env_fd, seccomp = self._env_fd(self._exec_env(env)), filter_fd()
        argv = self._exec_argv(command, cwd, marker_w, env_fd, seccomp)
        oom_before = self._cgroup.oom_kills() if self._cgroup is not None else 0
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=HOST_ENV,
                    start_new_session=True,  # the launcher leads its own process group: one killpg ends it
                    pass_fds=(marker_w, env_fd, seccomp),
                )
            finally:
                for fd in (marker_w, env_fd, seccomp):
                    os.close(fd)  # the sandbox holds the only marker write end now: EOF once it closed it
            self._procs.add(proc)
            try:
                result = await self._collect(proc, marker_r, command, timeout_sec)
            finally:
                self._procs.discard(proc)
                scrub_log_symlinks(self._binds)
            if self._cgroup is not None and self._cgroup.oom_kills() > oom_before:
                note = (
                    f"\n[grpoflow sandbox] out of memory: the kernel killed a process of this trial at its memory "
                    f"limit of {self.memory_mb} MiB (the task's memory_mb, or rollout.sandbox.kwargs.memory_mb)\n"
                )
                result = ExecResult(
                    stdout=result.stdout, stderr=(result.stderr or "") + note, return_code=result.return_code
                )
            await asyncio.to_thread(self._check_storage, command)
            return result
        finally:
            os.close(marker_r)

    async def _collect(
        self, proc: asyncio.subprocess.Process, marker_r: int, command: str, timeout_sec: float | None
    ) -> ExecResult:
        out, err = CappedOutput(self.settings.max_output_bytes), CappedOutput(self.settings.max_output_bytes)
        assert proc.stdout is not None and proc.stderr is not None
        readers = [
            asyncio.ensure_future(drain(proc.stdout, out)),
            asyncio.ensure_future(drain(proc.stderr, err)),
        ]
        timed_out = False
        trial_scope = self._holder is not None
        try:
            try:
                async with asyncio.timeout(timeout_sec if timeout_sec else None):
                    # asyncio's wait() also waits for the pipes to close, which a background process (trial scope)
                    # may hold open for the rest of the trial: wait for the process itself.
                    await (process_exit(proc) if trial_scope else proc.wait())
                    if trial_scope:
                        # A background process the command left running may hold the pipes open for the rest of
                        # the trial: take what it wrote by now and stop reading.
                        await asyncio.wait(readers, timeout=BACKGROUND_OUTPUT_GRACE_SEC)
                    else:
                        await asyncio.gather(*readers)
            except TimeoutError:
                timed_out = True
                await (kill_exec_and_reap(proc) if trial_scope else kill_and_reap(proc))
                # The pipes close as the pid namespace dies; don't wait forever on a descendant that lingers.
                await asyncio.wait(readers, timeout=5)
        except BaseException:
            # Cancellation (Harbor's agent timeout) or any error: the sandbox must not outlive this call. The
            # kill comes first and is synchronous, so it happens even if the wait below is cut short.
            if trial_scope:
                kill_group(proc)
            else:
                kill_sandbox(proc)
            await reap_after_kill(proc, readers)
            raise
        for reader in readers:
            reader.cancel()  # no-op when they finished
        started = read_marker(marker_r)
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

    def _check_storage(self, command: str) -> None:
        """The trial's files against `storage_mb`, after a command: over it, the sandbox is dead (the files stay for
        stop() to delete) and the command's result is lost with it."""
        assert self._root is not None
        limit = self.storage_mb * 2**20
        # What the trial wrote since it began: not the files it started from (an image's, the task's /app).
        start = self._start_bytes
        used = tree_bytes([self._trial_files(), *(b.source for b in self._binds if not b.read_only)], limit + start)
        used -= start
        if used > limit:
            self._dead_reason = (
                f"the trial's files reached {used // 2**20} MB, over its storage cap of {self.storage_mb} MB "
                f"(storage_mb; checked after each command)"
            )
            raise SandboxDiedError(f"sandbox {self.session_id}: {self._dead_reason}, after {command[:80]!r}")

    def _trial_files(self) -> Path:
        """The host dir of the trial's own files: its layer's upper dir (only what it changed), else its rootfs."""
        assert self._root is not None
        return self._layer / "upper" if self._layer is not None else self._root / "rootfs"

    def _exec_argv(self, command: str, cwd: str, marker_fd: int, env_fd: int, seccomp_fd: int) -> list[str]:
        # The wrapper proves the sandbox came up (a byte on marker_fd, which it then closes so the command can't
        # touch it); a failure before that byte is the sandbox's, after it the command's. It then exports the
        # sandbox's environment (NUL-separated NAME=value on env_fd): no host-side process ever has it, so a
        # task's LD_PRELOAD acts only inside. `cd` is done here, not with bwrap's --chdir, so a missing cwd is
        # the command's failure, not the sandbox's.
        wrapper = (
            f"printf 1 >&{marker_fd}; exec {marker_fd}>&-; "
            f"while IFS= read -r -d '' kv; do export \"$kv\"; done <&{env_fd}; exec {env_fd}<&-; "
            'cd -- "$1" || exit 1; exec /bin/bash -c "$2"'
        )
        command_argv = ["/bin/bash", "-c", wrapper, "grpoflow-exec", cwd, command]
        if self._holder is not None:
            return self._launch(command_argv, enter=self._holder_pids[1], seccomp_fd=seccomp_fd)
        return self._launch([*self._bwrap_prefix(seccomp_fd), *command_argv], stage=self._sources.stage())

    def _bwrap_prefix(self, seccomp_fd: int) -> list[str]:
        """bwrap's argv up to "--", loading the seccomp filter from `seccomp_fd` (one fresh fd per bwrap)."""
        return [*self._argv_prefix[:-1], "--seccomp", str(seccomp_fd), "--"]

    def _launch(self, argv: list[str], **spec: object) -> list[str]:
        cgroup = self._cgroup
        limits = rlimits(
            cpu_time_sec=self.settings.cpu_time_sec,
            max_file_size_mb=self.settings.max_file_size_mb,
            # The cgroup caps memory and pids for the whole trial; only without one, per process.
            address_space_mb=None if cgroup else (self.settings.address_space_mb or self.memory_mb),
            max_processes=None if cgroup else self.settings.max_processes,
            uid=self._uid,
        )
        procs = cgroup.procs_files if cgroup is not None else []
        if self._wants_network and self._network is None:  # stopped meanwhile: never the host's network instead
            raise SandboxDiedError(f"sandbox {self.session_id} was stopped: its network namespace is gone")
        netns = self._network.path if self._network is not None else None
        return launch_argv(argv, limits=limits, uid=self._uid, cgroup=procs, netns=netns, **spec)

    @staticmethod
    def _env_fd(env: dict[str, str]) -> int:
        """A memfd with `env` as NUL-separated NAME=value, at offset 0, for the wrapper to export."""
        bad = [name for name in env if not ENV_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"the sandbox's environment has a name a shell cannot export: {bad[0]!r}")
        if any("\0" in value for value in env.values()):
            raise ValueError("the sandbox's environment has a value with a NUL byte")
        fd = os.memfd_create("grpoflow-env", os.MFD_CLOEXEC)
        os.write(fd, b"".join(f"{k}={v}\0".encode() for k, v in env.items()))
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _exec_env(self, env: dict[str, str] | None) -> dict[str, str]:
        # An image's ENV comes first (its PATH included); the task's [environment.env] and the exec's env win.
        image_env = self.image.env if self.image is not None else {}
        path = image_env.get("PATH", SANDBOX_PATH)
        path = f"{CLI_DIR}/node_modules/.bin:{path}" if self.cli_dir is not None else path
        account = self.base.account
        base = {**image_env, "PATH": path, "HOME": account.home, "LANG": "C.UTF-8"}
        if self._uid is not None:
            base["USER"] = base["LOGNAME"] = account.name  # the name our passwd entry gives the sandbox uid
        return {**base, **(self._merge_env(env) or {})}

    # ---- start: the per-trial tree ------------------------------------------------------------------------

    def _use_image(self) -> None:
        """Build (or find in the cache) the task's image and make its tree the sandbox's base. The trial dir gets
        environment-image.json (tag, tree, build log) and a copy of the build log when this trial built it or the
        build failed."""
        keep = Path(self.trial_paths.trial_dir) / "environment-build.log"
        try:
            image = self.image = task_image(
                self.environment_dir, self.image_cache_dir, self.settings.image_max_mb, self.base_images
            )
            self._image_lock = hold(image)
        except ImageBuildError as exc:
            if exc.log is not None and exc.log.is_file():
                shutil.copyfile(exc.log, keep)
            raise
        if image.built:
            shutil.copyfile(image.build_log, keep)
        # Every trial says which image it ran in and where its build log is (a copy only where it was built).
        record = {
            "tag": image.tag,
            "tree": str(image.rootfs),
            "build_log": str(image.build_log),
            "built": image.built,
            "bases": [asdict(b) for b in image.bases],
        }
        (keep.parent / "environment-image.json").write_text(json.dumps(record, indent=1) + "\n")
        # Every command runs as `/bin/bash -c` inside: without it no command can run at all.
        if not os.path.lexists(image.rootfs / "bin" / "bash"):
            raise ImageBuildError(
                f"sandbox for {self.session_id}: the image has no /bin/bash, which runs every command in the sandbox "
                "(install bash in the Dockerfile)"
            )
        if self.task_env_config.workdir is None:
            self._workdir = image.workdir or DEFAULT_WORKDIR
        try:
            self.base = image_base(image.rootfs, self._workdir, image.user)
        except ValueError as exc:
            raise ImageBuildError(f"sandbox for {self.session_id}: {exc}") from exc

    def _make_root(self, tools: dict[str, str]) -> None:
        with self._making_root:
            self._make_root_locked(tools)

    def _make_root_locked(self, tools: dict[str, str]) -> None:
        root = make_trial_dir(self.settings.work_dir, self.session_id)
        self._root = root  # mkdtemp's 0700 stays: bwrap binds it as root, the sandbox only sees the mount
        claim(root)  # removed by the janitor if this process dies before stop() (outside rootfs: unseen inside)
        if os.geteuid() == 0:
            self._uid = allocate_uid()
        self._cgroup = self._new_cgroup()
        self._limited_by = self._cgroup.mechanism if self._cgroup is not None else "RLIMIT_AS"
        app = self.environment_dir / "app"
        own = self._own = self._own_binds(root)
        binds = [*self._binds, *own]
        # As root, bwrap runs as the sandbox uid: its mount sources are staged (see Sources).
        self._sources = Sources(staged=self._uid is not None)
        uid = self._uid if self._uid is not None else os.getuid()
        # As root an image's dirs are an overlay over its shared tree (see rootfs); otherwise copies.
        self._layer = root / "layer" if self._uid is not None and self.base.is_image else None
        try:
            extra_ro = build_rootfs(
                root / "rootfs",
                app,
                binds,
                self._uid,
                self.auto_mounting,
                self.base,
                self.storage_mb * 2**20,
                self._layer,
            )
            if self._wants_network:
                network_mount_points(self.base)
                (root / "etc").mkdir()
                self._network = TrialNetwork(root / "etc", self.session_id)
            self._argv_prefix = bwrap_argv(
                tools["bwrap"], root, binds, uid, extra_ro, self._sources, self.base, self._network is not None
            )
        except BaseTreeError as exc:  # the task's own tree: every trial of it would fail the same way
            raise ImageBuildError(f"sandbox for {self.session_id}: {exc}") from exc
        self._start_bytes = tree_bytes([self._trial_files()], 2**62)

    def _new_cgroup(self) -> TrialCgroup | None:
        """The trial's cgroup, or None where this machine gives none (preflight said so: memory is then capped per
        process as address space). One that could be had and now cannot is a failed start (retried)."""
        if unavailable_reason() is not None:
            return None
        limits = Limits(memory_bytes=self.memory_mb * 2**20, pids=self.settings.max_processes, cpus=self.cpus)
        try:
            return create_cgroup(limits)
        except CgroupUnavailable as exc:
            raise SandboxStartError(f"sandbox for {self.session_id}: could not make its cgroup: {exc}") from exc

    def _record_resources(self) -> None:
        """The trial dir's sandbox-resources.json: the limits it ran under, how they were enforced, and (with a
        cgroup) the most memory it used at once and how many processes the kernel killed at the limit."""
        record: dict[str, Any] = {
            "limited_by": self._limited_by,
            "memory_mb": self.memory_mb,
            "cpus": self.cpus if self._cgroup is not None else None,
            "max_processes": self.settings.max_processes,
        }
        if self._cgroup is not None:
            peak = self._cgroup.peak_memory_bytes()
            record["peak_memory_mb"] = round(peak / 2**20, 1) if peak is not None else None
            record["oom_kills"] = self._cgroup.oom_kills()
        else:
            record["address_space_mb"] = self.settings.address_space_mb or self.memory_mb
        self._limited_by = None
        trial_dir = Path(self.trial_paths.trial_dir)
        if trial_dir.is_dir():
            (trial_dir / "sandbox-resources.json").write_text(json.dumps(record, indent=1) + "\n")

    def _own_binds(self, root: Path) -> list[Bind]:
        """Read-only dirs of ours (not Harbor's mounts, so never a target of uploads): the bridge and the CLIs."""
        own = []
        if self._bridge_to is not None:
            # Not in the trial dir: a unix socket's path must stay under 108 bytes, and trial dirs can be deep.
            bridge = self._bridge_dir = Path(tempfile.mkdtemp(prefix="grpoflow-bridge-"))
            claim(bridge)
            bridge.chmod(0o755)
            shutil.copy2(FORWARDER, bridge / "forward.py")
            own.append(Bind(BRIDGE_DIR, bridge, read_only=True))
        if self.cli_dir is not None:
            own.append(Bind(CLI_DIR, self.cli_dir.resolve(), read_only=True))
        return own

    def _repair_mount_points(self) -> None:
        assert self._root is not None
        repair_mount_points(self._root / "rootfs", [*self._binds, *self._own], self.base)

    # ---- files in and out ---------------------------------------------------------------------------------

    def _host_path(self, sandbox_path: str) -> tuple[Path, Path]:
        """(host path, host dir it must stay inside) for a path in the sandbox."""
        if self._root is None:
            raise SandboxDiedError(f"sandbox {self.session_id} is not started (or was deleted): no {sandbox_path}")
        return host_path(self._root / "rootfs", self._binds, self._workdir, sandbox_path, self.base)

    def _upload_file(self, source: Path, target_path: str) -> None:
        target, base = self._host_path(target_path)
        copy_file_in(source, target, base, self._uid)

    def _upload_dir(self, source: Path, target_dir: str) -> None:
        if not source.is_dir():
            raise FileNotFoundError(f"upload_dir: {source} is not a directory")
        target, base = self._host_path(target_dir)
        copy_dir_in(source, target, base, self._uid)

    def _download_source(self, sandbox_path: str) -> Path:
        """The host file behind a sandbox path, refusing links that lead out of the sandbox's own files."""
        source, base = self._host_path(sandbox_path)
        return resolve_inside(sandbox_path, source, base)

    def _download_file(self, source_path: str, target: Path) -> None:
        copy_file_out(source_path, self._download_source(source_path), target)

    def _download_dir(self, source_dir: str, target: Path) -> None:
        copy_dir_out(source_dir, self._download_source(source_dir), target)
