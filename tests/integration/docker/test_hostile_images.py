"""Hostile task images, built by the real Docker engine and run by the real sandbox: an image owns nothing.

Privileges are judged from the host's side (`/proc/<pid>/status` of the host, not from inside a user namespace).
Every payload is harmless if the hardening regresses: it only writes a marker file the test made room for, and the
cgroup attempt uses a named hierarchy of the test's own, cleaned up in `finally`.
"""

from __future__ import annotations

import asyncio
import os
import platform
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from grpoflow.embedded.sandbox.images import image_key
from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.embedded.sandbox.processes import uid_pids
from grpoflow.embedded.sandbox.seccomp import ARCHES
from grpoflow.rollout.environments import ImageBuildError, SandboxDiedError
from tests.integration.docker.conftest import task_with_dockerfile
from tests.integration.sandbox.conftest import sandbox_factory

pytestmark = pytest.mark.timeout(600)
CGROUP_NAME = "grpoflow-hostile-test"

# setpriv and prlimit that skip their options and exec the rest unchanged: with the drop done inside the sandbox
# from the image's own /usr/bin, every command ran as root with every capability.
HOSTILE = r"""FROM debian:bookworm-slim
RUN for t in setpriv prlimit; do \
      printf '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done; shift; exec "$@"\n' > /usr/bin/$t; \
      chmod 755 /usr/bin/$t; done
RUN cp /bin/bash /usr/local/bin/rootbash && chmod 4755 /usr/local/bin/rootbash && \
    mknod /usr/local/null-node c 1 3 && mkfifo /usr/local/fifo-node && \
    ln /usr/local/null-node /usr/local/null-link && ln /usr/local/bin/rootbash /usr/local/bin/rootbash-link
COPY data/ /workspace/
WORKDIR /workspace
"""


@pytest.fixture
def hostile_sandbox(image_cache: Path, tmp_path: Path) -> Iterator[Callable[..., LocalSandbox]]:
    task = task_with_dockerfile(tmp_path, "hostile", HOSTILE)
    yield from sandbox_factory(lambda _: task, "hostile", tmp_path, image_cache_dir=str(image_cache))


def _host_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _pid_ns_members(pid: int) -> list[int]:
    """Host pids of every process in `pid`'s pid namespace."""
    target = os.readlink(f"/proc/{pid}/ns/pid")
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == target:
                    members.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue  # exited while we looked, or not ours to read
    return members


def _cleanup_named_cgroup() -> None:
    """Undo what the payload would have made on the host had the sandbox let it mount a cgroup v1 hierarchy."""
    where = tempfile.mkdtemp(prefix="grpoflow-cg-")
    try:
        mounted = subprocess.run(
            ["mount", "-t", "cgroup", "-o", f"none,name={CGROUP_NAME}", "cgroup", where], capture_output=True
        )
        if mounted.returncode != 0:
            return  # no such hierarchy (or no cgroup v1 at all): nothing was made
        try:
            Path(where, "release_agent").write_text("\n")
            for sub in sorted(Path(where).rglob("*"), reverse=True):
                if sub.is_dir():
                    sub.rmdir()
        finally:
            subprocess.run(["umount", where], check=False)
    finally:
        os.rmdir(where)


@pytest.mark.skipif(os.geteuid() != 0, reason="the privilege drop under test is the one made as root")
def test_a_hostile_setpriv_image_owns_nothing(hostile_sandbox: Callable[..., LocalSandbox], tmp_path: Path) -> None:
    numbers = ARCHES[platform.machine()][1]
    marker = tmp_path / "release-agent-ran"
    payload = tmp_path / "payload.sh"  # a host path: only what runs on the host could reach it
    payload.write_text(f"#!/bin/sh\ntouch {marker}\n")
    payload.chmod(0o755)
    probe = (
        "id -u; grep CapEff /proc/self/status; "
        "mount -t tmpfs none /tmp 2>/dev/null; echo mount=$?; "
        "unshare -U true 2>/dev/null; echo unshare=$?; "
        # init_module of an empty image and keyctl(KEYCTL_GET_KEYRING_ID, session): errno, never a module
        f'perl -e \'my ($m, $a) = ("", ""); syscall({numbers["init_module"]}, $m, 0, $a); print "init_module=", $!+0, "\\n"\'; '
        f'perl -e \'syscall({numbers["keyctl"]}, 0, -3, 0); print "keyctl=", $!+0, "\\n"\'; '
        # the cgroup v1 release_agent route, on a named hierarchy of this test's own
        f"mkdir -p /tmp/cg && mount -t cgroup -o none,name={CGROUP_NAME} cgroup /tmp/cg 2>/dev/null; echo cg=$?; "
        f"[ -w /tmp/cg/release_agent ] && echo {payload} > /tmp/cg/release_agent && "
        "echo 1 > /tmp/cg/notify_on_release && mkdir /tmp/cg/x && echo $$ > /tmp/cg/x/cgroup.procs; "
        "echo x > /usr/local/bin/poison 2>/dev/null; echo poison=$?; "
        "rootbash -p -c 'id -u'; sleep 30 &"
    )

    async def main() -> tuple:
        env = hostile_sandbox(process_scope="trial")
        await env.start(force_build=False)
        result = await env.exec(probe, timeout_sec=60)
        assert env._holder is not None and env._uid is not None
        inside = _pid_ns_members(env._holder_pids[1])
        statuses = {pid: _host_status(pid) for pid in {*inside, *uid_pids(env._uid), env._holder.pid}}
        second = hostile_sandbox()
        await second.start(force_build=False)
        after = await second.exec("ls /usr/local/bin")
        return env, result, statuses, after

    try:
        env, result, statuses, after = asyncio.run(main())
    finally:
        _cleanup_named_cgroup()
    assert result.return_code == 0, result.stderr
    lines = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    first = result.stdout.splitlines()
    assert first[0] == str(env._uid) and first[1].split() == ["CapEff:", "0000000000000000"]
    assert lines["mount"] != "0" and lines["unshare"] != "0" and lines["cg"] != "0" and lines["poison"] != "0"
    assert lines.get("init_module") == "1" and lines.get("keyctl") == "1", result  # EPERM from the filter
    assert first[-1] == str(env._uid)  # a setuid-root bash from the image is no root here
    assert not marker.exists()
    assert len(statuses) >= 3  # the holder's bwrap, pid 1 inside, and the background sleep at least
    for pid, status in statuses.items():
        assert set(status["Uid"].split()) == {str(env._uid)}, (pid, status["Name"])
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, (pid, status["Name"])
    assert "poison" not in after.stdout  # the shared image tree was never writable
    # The export was unpacked without setuid bits, device nodes or FIFOs.
    tree = env.image.rootfs
    assert not os.stat(tree / "usr/local/bin/rootbash").st_mode & (stat.S_ISUID | stat.S_ISGID)
    assert not os.path.lexists(tree / "usr/local/null-node") and not os.path.lexists(tree / "usr/local/fifo-node")
    # a hard link to a skipped node is skipped too (tarfile would unpack its target from the link); one to a
    # regular file stays
    assert not os.path.lexists(tree / "usr/local/null-link") and (tree / "usr/local/bin/rootbash-link").is_file()
    assert os.stat(tree / "usr/local/bin/rootbash").st_uid == 0


def _link_targets(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (host path an image's /etc/passwd links to, a marker that must appear nowhere)."""
    fifo = tmp_path / "kmsg-standin"
    os.mkfifo(fifo)  # stands in for /proc/kmsg: a read blocks forever
    shadow = tmp_path / "shadow-standin"
    shadow.write_text("root:SHADOW-MARKER-7c1:19000:0:99999:7:::\n")
    shadow.chmod(0o600)
    plain = tmp_path / "plain-host-file"
    plain.write_text("PLAIN-MARKER-3f9\n")
    return {
        "environ": (Path("/proc/self/environ"), "FLOW-SECRET-MARKER-9d2"),
        "fifo": (fifo, "never-read"),
        "shadow": (shadow, "SHADOW-MARKER-7c1"),
        "plain": (plain, "PLAIN-MARKER-3f9"),
    }


@pytest.mark.parametrize("kind", ["environ", "fifo", "shadow", "plain"])
def test_passwd_links_out_of_the_image_are_refused_without_a_read(
    kind: str, image_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, marker = _link_targets(tmp_path)[kind]
    monkeypatch.setenv("GRPOFLOW_TEST_API_KEY", "FLOW-SECRET-MARKER-9d2")  # the flow's planted secret
    task = task_with_dockerfile(
        tmp_path,
        f"passwd-{kind}",
        f"FROM debian:bookworm-slim\nRUN ln -sf {target} /etc/passwd && ln -sf {target} /etc/group\n"
        "COPY data/ /workspace/\nWORKDIR /workspace\n",
    )
    factory = sandbox_factory(lambda _: task, task.name, tmp_path, image_cache_dir=str(image_cache))
    make = next(factory)
    env = make()
    try:
        with pytest.raises(ImageBuildError, match=r"/etc/passwd of the sandbox's base is a link") as info:
            asyncio.run(asyncio.wait_for(env.start(force_build=False), timeout=300))
        assert "\n" not in str(info.value) and marker not in str(info.value)
        trial_dir = Path(env.trial_paths.trial_dir)
        for path in [p for p in trial_dir.rglob("*") if p.is_file()]:
            assert marker not in path.read_text(errors="replace"), path
    finally:
        next(factory, None)


def test_an_image_over_its_cap_is_refused_before_export_and_removed(tmp_path: Path, docker_ready: None) -> None:
    task = task_with_dockerfile(
        tmp_path, "big-image", "FROM debian:bookworm-slim\nCOPY data/ /workspace/\nWORKDIR /workspace\n"
    )
    images = tmp_path / "images"  # cold: the cap is checked when the image is unpacked
    factory = sandbox_factory(lambda _: task, task.name, tmp_path, image_cache_dir=str(images), image_max_mb=16)
    make = next(factory)
    env = make()
    try:
        with pytest.raises(ImageBuildError, match=r"over the local sandbox's image_max_mb=16") as info:
            asyncio.run(env.start(force_build=False))
        assert "\n" not in str(info.value)
    finally:
        next(factory, None)
    assert not [p for p in images.iterdir() if p.is_dir()]  # nothing unpacked
    tag = "grpoflow-env:" + image_key(task / "environment")
    assert subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode != 0


@pytest.mark.skipif(os.geteuid() != 0, reason="without root the image's dirs are copies, checked against the cap")
def test_an_image_s_own_files_are_not_the_trial_s_storage_but_its_writes_are(image_cache: Path, tmp_path: Path) -> None:
    """The storage cap counts what the trial wrote (its layer's upper dir), never the image's files below it."""
    task = task_with_dockerfile(
        tmp_path,
        "big-workdir",
        "FROM debian:bookworm-slim\nRUN mkdir /workspace && head -c 20000000 /dev/urandom > /workspace/blob\n"
        "WORKDIR /workspace\n",
    )
    factory = sandbox_factory(lambda _: task, task.name, tmp_path, image_cache_dir=str(image_cache), storage_mb=8)
    make = next(factory)
    env = make()

    async def main() -> tuple:
        await env.start(force_build=False)
        size = await env.exec("wc -c < blob; echo small > note")
        with pytest.raises(SandboxDiedError, match=r"over its storage cap of 8 MB") as died:
            await env.exec("head -c 10000000 /dev/zero > more")
        return size, died.value

    try:
        size, died = asyncio.run(main())
        assert size.return_code == 0 and size.stdout.split() == ["20000000"], size.stderr
        assert "\n" not in str(died)
    finally:
        next(factory, None)
