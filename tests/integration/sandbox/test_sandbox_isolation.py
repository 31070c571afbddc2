"""What a command in a LocalSandbox cannot do: reach the network, touch or read the host, keep processes alive,
exhaust the host's processes or memory, or outlive its timeout or a cancellation."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from harbor.environments.base import ExecResult

from grpoflow.embedded.sandbox.local import TIMEOUT_EXIT_CODE, LocalSandbox
from grpoflow.embedded.sandbox.processes import uid_pids
from grpoflow.embedded.sandbox.rootfs import HOST_LIB_NAMES, OWNED_DIRS
from grpoflow.prepare.dataset import load_dataset
from grpoflow.rollout.environments import SandboxDiedError
from tests.integration.sandbox.conftest import sandbox_factory
from tests.integration.sandbox.sandbox_helpers import live_pids, new_marker, wait_gone

REPO = Path(__file__).resolve().parents[3]


async def _started(env: LocalSandbox) -> LocalSandbox:
    await env.start(force_build=False)
    return env


def test_no_network_not_even_the_hosts_loopback(make_sandbox: Callable[..., LocalSandbox]) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]

        async def main() -> tuple:
            env = await _started(make_sandbox())
            tcp = await env.exec(f"echo hello > /dev/tcp/127.0.0.1/{port}", timeout_sec=10)
            ifaces = await env.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '", timeout_sec=10)
            return tcp, ifaces

        tcp, ifaces = asyncio.run(main())
        assert tcp.return_code != 0
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing ever connected
    assert ifaces.stdout.split() == ["lo"]


def test_cannot_write_outside_its_dirs(make_sandbox: Callable[..., LocalSandbox], tmp_path: Path) -> None:
    host_file = tmp_path / "host.txt"
    host_file.write_text("original\n")

    async def main() -> dict[str, int]:
        env = await _started(make_sandbox())
        codes = {}
        for path in (str(host_file), str(tmp_path / "new.txt"), "/usr/pwned", "/etc/pwned", "/pwned"):
            codes[path] = (await env.exec(f"echo pwned > {path}", timeout_sec=10)).return_code
        return codes

    codes = asyncio.run(main())
    if os.geteuid() == 0:  # as a normal user the sandbox's / is that user's per-trial dir, so /pwned is allowed
        assert all(code != 0 for code in codes.values()), codes
    assert host_file.read_text() == "original\n"
    assert not (tmp_path / "new.txt").exists() and not Path("/usr/pwned").exists()
    assert not Path("/etc/pwned").exists() and not Path("/pwned").exists()


def test_cannot_read_planted_host_secrets(make_sandbox: Callable[..., LocalSandbox], tmp_path: Path) -> None:
    secret = f"grpoflow-test-secret-{new_marker()}"
    planted = [tmp_path / "secret.txt", REPO / f".sandbox-test-secret-{os.getpid()}"]
    if os.access(Path.home(), os.W_OK):
        planted.append(Path.home() / f".sandbox-test-secret-{os.getpid()}")  # /root when we are root
    for path in planted:
        path.write_text(secret)
    try:

        async def main() -> list:
            env = await _started(make_sandbox())
            await env.upload_file(planted[0], "/app/given.txt")  # positive control: what we hand over is seen
            reads = [await env.exec(f"cat {path}", timeout_sec=10) for path in planted]
            # Every file the sandbox can see but the host's /usr (and links into it) and /proc, /sys, /dev.
            top = await env.exec("ls -A /", timeout_sec=10)
            skip = {"usr", "proc", "sys", "dev", *HOST_LIB_NAMES}
            dirs = " ".join(f"/{name}" for name in top.stdout.split() if name not in skip)
            search = await env.exec(f"grep -rsl -D skip -- {secret} {dirs}", timeout_sec=30)
            return [*reads, top, search, env.base]

        results = asyncio.run(main())
    finally:
        for path in planted:
            path.unlink()
    *reads, top, search, base = results
    for result in reads:
        assert result.return_code != 0 and secret not in result.stdout + result.stderr
    # The root holds the per-trial dirs, the base's system dirs (the host's /usr and /etc, or an image's whole
    # top level) and its lib links, /proc and /dev: no more.
    system = {d.lstrip("/") for d in base.ro_dirs} | ({p.name for p in base.root.iterdir()} if base.is_image else set())
    assert set(top.stdout.split()) <= {*OWNED_DIRS, "logs", *system, "proc", "dev", *HOST_LIB_NAMES}
    assert search.stdout.split() == ["/app/given.txt"]


def test_host_environment_never_reaches_the_sandbox(
    make_sandbox: Callable[..., LocalSandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"sk-grpoflow-test-{new_marker()}"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    monkeypatch.setenv("GRPOFLOW_HOST_ONLY", key)

    async def main() -> tuple:
        env = await _started(make_sandbox())
        listed = await env.exec("env; cat /proc/*/environ | tr '\\0' '\\n'", env={"EXEC_VAR": "given"}, timeout_sec=10)
        return listed, env

    listed, env = asyncio.run(main())
    assert key not in listed.stdout
    assert "EXEC_VAR=given" in listed.stdout  # what the caller passes does arrive
    assert "HOME=/root" in listed.stdout and "PATH=/usr/local/sbin" in listed.stdout


def test_background_processes_do_not_outlive_the_exec(make_sandbox: Callable[..., LocalSandbox]) -> None:
    marker = new_marker()
    command = (
        f"sleep {marker} & setsid sleep {marker} & nohup sleep {marker} >/dev/null 2>&1 & "
        f"(setsid sleep {marker} </dev/null >/dev/null 2>&1 &); echo started"
    )

    async def main() -> tuple:
        env = await _started(make_sandbox())
        t0 = time.monotonic()
        result = await env.exec(command, timeout_sec=30)
        elapsed = time.monotonic() - t0
        left_after_exec = wait_gone(marker)
        await env.stop(delete=True)
        return result, elapsed, left_after_exec

    result, elapsed, left_after_exec = asyncio.run(main())
    assert result.return_code == 0 and result.stdout.strip() == "started"
    assert elapsed < 5  # the exec did not wait on its background children
    assert left_after_exec == []
    assert live_pids(marker) == []


def test_timeout_returns_promptly_and_kills_everything(make_sandbox: Callable[..., LocalSandbox]) -> None:
    marker = new_marker()

    async def main() -> tuple:
        env = await _started(make_sandbox())
        t0 = time.monotonic()
        result = await env.exec(f"echo before; (setsid sleep {marker} &); sleep {marker}", timeout_sec=1)
        return result, time.monotonic() - t0

    result, elapsed = asyncio.run(main())
    assert result.return_code == TIMEOUT_EXIT_CODE
    assert result.stdout == "before\n"  # output so far is kept
    assert "timed out" in result.stderr
    assert elapsed < 4
    assert wait_gone(marker) == []


def test_cancelling_an_exec_kills_its_processes(make_sandbox: Callable[..., LocalSandbox]) -> None:
    marker = new_marker()

    async def main() -> None:
        env = await _started(make_sandbox())
        task = asyncio.create_task(env.exec(f"(setsid sleep {marker} &); sleep {marker}"))
        deadline = time.monotonic() + 5
        sleeping = f"sleep {marker}"
        while len(live_pids(marker, exact=sleeping)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(live_pids(marker, exact=sleeping)) == 2  # both sleeps run before we cancel
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert wait_gone(marker) == []


def test_stop_kills_a_running_exec_and_deletes_the_dirs(
    make_sandbox: Callable[..., LocalSandbox], sandbox_dirs: Path
) -> None:
    marker = new_marker()

    async def main() -> None:
        env = await _started(make_sandbox())
        task = asyncio.create_task(env.exec(f"sleep {marker}"))
        deadline = time.monotonic() + 5
        while not live_pids(marker, exact=f"sleep {marker}") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await env.stop(delete=True)
        with pytest.raises(SandboxDiedError):
            await task
        with pytest.raises(SandboxDiedError):
            await env.exec("true")  # a stopped sandbox stays dead

    asyncio.run(main())
    assert live_pids(marker) == []
    assert list(sandbox_dirs.iterdir()) == []


def test_fork_bomb_is_contained(make_sandbox: Callable[..., LocalSandbox]) -> None:
    async def main() -> tuple:
        env = await _started(make_sandbox(max_processes=64))
        # In trial scope the holder (its bwrap, the namespace's init, its sleep) runs as the sandbox uid too.
        holder = set(uid_pids(env._uid)) if env._uid is not None else set()
        t0 = time.monotonic()
        # The shell stays in the foreground (sleep) while the bomb forks in the background.
        bomb = asyncio.create_task(env.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout_sec=3))
        await asyncio.sleep(1.5)
        running = len(uid_pids(env._uid)) if env._uid is not None else None
        host_ok = await asyncio.to_thread(subprocess.run, ["true"], timeout=10)  # the host can still fork
        result = await bomb
        elapsed = time.monotonic() - t0
        left = sorted(set(uid_pids(env._uid)) - holder) if env._uid is not None else []
        after = await env.exec("echo alive", timeout_sec=10)
        return running, host_ok, result, elapsed, left, after

    running, host_ok, result, elapsed, left, after = asyncio.run(main())
    assert host_ok.returncode == 0
    if running is not None:  # as root the sandbox has a uid of its own, so its process count is exact
        assert 10 < running <= 64  # the bomb ran, and hit the limit
    assert result.return_code == TIMEOUT_EXIT_CODE and elapsed < 8
    assert left == []
    assert after.stdout == "alive\n"  # nothing of the bomb is left in the way


def test_memory_hog_is_contained(make_sandbox: Callable[..., LocalSandbox]) -> None:
    async def main() -> tuple:
        env = await _started(make_sandbox(memory_mb=256))
        hog = await env.exec("x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x}", timeout_sec=30)
        after = await env.exec("echo alive", timeout_sec=10)
        return hog, after

    hog, after = asyncio.run(main())
    assert hog.return_code != 0
    assert "400000000" not in hog.stdout
    assert after.stdout == "alive\n"


def test_cpu_time_limit_stops_a_busy_loop(make_sandbox: Callable[..., LocalSandbox]) -> None:
    async def main() -> tuple:
        env = await _started(make_sandbox(cpu_time_sec=1))
        t0 = time.monotonic()
        result = await env.exec("while :; do :; done", timeout_sec=30)
        return result, time.monotonic() - t0

    result, elapsed = asyncio.run(main())
    assert result.return_code != 0 and result.return_code != TIMEOUT_EXIT_CODE  # the rlimit, not the timeout
    assert elapsed < 10


def test_output_is_capped(make_sandbox: Callable[..., LocalSandbox]) -> None:
    async def main():
        env = await _started(make_sandbox(max_output_bytes=1000))
        return await env.exec("head -c 100000 /dev/zero | tr '\\0' a; echo; echo END", timeout_sec=30)

    result = asyncio.run(main())
    assert result.return_code == 0
    assert len(result.stdout) < 1100
    assert "bytes of output dropped" in result.stdout
    assert result.stdout.endswith("END\n")  # the tail is kept: that is where errors usually are


def test_cannot_see_or_kill_the_parent(make_sandbox: Callable[..., LocalSandbox]) -> None:
    """A model command that tries to kill the trainer (its parent chain, every python, every process it can
    signal) reaches nothing outside its own pid namespace; the host process and the next exec are fine."""
    host_pid = os.getpid()

    async def main() -> tuple:
        env = await _started(make_sandbox())
        attack = await env.exec(
            f"kill -9 {host_pid}; kill -9 $PPID; pkill -9 -f python; kill -9 -1; ls /proc | grep -c '^[0-9]'",
            timeout_sec=10,
        )
        seen = await env.exec("ls /proc | grep '^[0-9]' | tr '\\n' ' '", timeout_sec=10)
        after = await env.exec("echo alive", timeout_sec=10)
        return attack, seen, after

    attack, seen, after = asyncio.run(main())
    assert os.getpid() == host_pid  # this (host) process survived the attack
    assert str(host_pid) not in seen.stdout.split() or host_pid < 10  # host pids are not visible inside
    assert len(seen.stdout.split()) < 10  # only the sandbox's own few processes
    assert after.stdout == "alive\n"


def test_a_tasks_ld_preload_reaches_no_host_process(bwrap: str, tmp_path: Path) -> None:
    """`[environment.env]` of a task.toml is the sandbox's environment only: the host-side launcher and bwrap (root,
    or the sandbox uid outside any namespace) start with an environment of ours, so a preloaded library never
    loads before the namespaces exist."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the preload library")
    marker = tmp_path / "preload-loaded"
    source = tmp_path / "mark.c"
    source.write_text(
        "#include <fcntl.h>\n#include <unistd.h>\n"
        f'__attribute__((constructor)) static void mark(void) {{ close(open("{marker}", O_CREAT | O_WRONLY, 0644)); }}\n'
    )
    lib = tmp_path / "libmark.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    task = shutil.copytree(load_dataset("builtin-fixed").by_name("copy-file").path, tmp_path / "preload-task")
    toml = task / "task.toml"
    toml.write_text(toml.read_text() + f'\n[environment.env]\nLD_PRELOAD = "{lib}"\nTASK_VALUE = "a b\\nc"\n')
    factory = sandbox_factory(lambda _: task, "preload-task", tmp_path, work_dir=str(tmp_path / "work"))
    make = next(factory)

    async def main() -> ExecResult:
        env = make(process_scope="trial")
        await env.start(force_build=False)
        return await env.exec('printf %s "$TASK_VALUE"; echo; printf %s "$LD_PRELOAD"')

    try:
        result = asyncio.run(main())
    finally:
        next(factory, None)
    assert result.return_code == 0, result.stderr
    assert result.stdout == f"a b\nc\n{lib}"  # the sandbox has the task's environment, newlines and all
    assert not marker.exists()  # the library's path is a host path: only a host process could have loaded it


def test_a_trial_over_its_storage_cap_dies_in_one_line(make_sandbox: Callable[..., LocalSandbox]) -> None:
    async def main() -> tuple:
        env = await _started(make_sandbox(storage_mb=64))
        small = await env.exec("head -c 1000000 /dev/zero > /app/small; echo ok")
        with pytest.raises(SandboxDiedError) as died:
            await env.exec("for i in 1 2 3 4; do head -c 64000000 /dev/zero > /tmp/big$i; done")
        with pytest.raises(SandboxDiedError, match="storage cap"):
            await env.exec("true")  # the sandbox stays dead
        return small, died.value

    small, died = asyncio.run(main())
    assert small.stdout == "ok\n"
    message = str(died)
    assert "over its storage cap of 64 MB" in message and "\n" not in message
    reached = int(message.split("reached ")[1].split(" MB")[0])
    assert 64 < reached <= 4 * 62  # the overshoot is at most what the one command wrote
