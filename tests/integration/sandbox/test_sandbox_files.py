"""Files in and out of a LocalSandbox: Harbor's paths map to per-trial host dirs, and links planted by the
sandbox never make the host read or write outside them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from grpoflow.embedded.sandbox.local import LocalSandbox


async def _started(env: LocalSandbox) -> LocalSandbox:
    await env.start(force_build=False)
    return env


def test_task_app_files_are_in_the_workdir(make_sandbox: Callable[..., LocalSandbox]) -> None:
    async def main():
        env = await _started(make_sandbox("copy-file"))
        return await env.exec("pwd; cat source.txt > copy.txt && ls", timeout_sec=10)

    result = asyncio.run(main())
    assert result.return_code == 0
    assert result.stdout.split() == ["/app", "copy.txt", "source.txt"]  # in /app, and the sandbox may write there


def test_upload_and_download_round_trip(make_sandbox: Callable[..., LocalSandbox], tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("a\n")
    (src / "sub" / "b.txt").write_text("b\n")
    (tmp_path / "one.txt").write_text("one\n")
    out = tmp_path / "out"

    async def main():
        env = await _started(make_sandbox())
        await env.upload_dir(src, "/tests")
        await env.upload_file(tmp_path / "one.txt", "/solution/deep/one.txt")
        # The sandbox user owns what was uploaded: it can change it (as root would in a container).
        edit = await env.exec("echo more >> /tests/sub/b.txt && cat /solution/deep/one.txt > /app/made.txt")
        await env.download_dir("/tests", out / "tests")
        await env.download_file("/app/made.txt", out / "made.txt")
        return edit

    edit = asyncio.run(main())
    assert edit.return_code == 0, edit.stderr
    assert (out / "tests" / "a.txt").read_text() == "a\n"
    assert (out / "tests" / "sub" / "b.txt").read_text() == "b\nmore\n"
    assert (out / "made.txt").read_text() == "one\n"


def test_harbor_log_dirs_are_the_trial_dirs(make_sandbox: Callable[..., LocalSandbox]) -> None:
    env = make_sandbox()

    async def main():
        await env.start(force_build=False)
        return await env.exec("echo 0.5 > /logs/verifier/reward.txt && echo log > /logs/agent/agent.log")

    assert asyncio.run(main()).return_code == 0
    paths = env.trial_paths
    assert paths.reward_text_path.read_text() == "0.5\n"
    assert (paths.agent_dir / "agent.log").read_text() == "log\n"
    assert env.is_path_mounted("/logs/verifier", paths.verifier_dir)  # so Harbor downloads nothing
    assert env.is_path_mounted("/logs/agent", paths.agent_dir)


def test_without_auto_mounting_harbor_downloads_the_logs(make_sandbox: Callable[..., LocalSandbox]) -> None:
    env = make_sandbox(auto_mounting=False)

    async def main():
        await env.start(force_build=False)
        await env.exec("echo 1 > /logs/verifier/reward.txt")
        assert not env.is_path_mounted("/logs/verifier", env.trial_paths.verifier_dir)
        await env.download_dir("/logs/verifier", env.trial_paths.verifier_dir)  # what Harbor's verifier does

    asyncio.run(main())
    assert env.trial_paths.reward_text_path.read_text() == "1\n"


def test_planted_links_cannot_make_the_host_read_or_write_outside(
    make_sandbox: Callable[..., LocalSandbox], tmp_path: Path
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("host file\n")
    payload = tmp_path / "payload.txt"
    payload.write_text("uploaded\n")
    out = tmp_path / "out"

    async def main():
        env = await _started(make_sandbox())
        # Absolute host paths, as the host would resolve them when following the links.
        await env.exec(f"ln -s {victim} /app/to-victim && mkdir -p /app/d && ln -s {tmp_path} /app/d/to-host-dir")
        with pytest.raises(PermissionError):
            await env.download_file("/app/to-victim", out / "stolen.txt")
        await env.download_dir("/app/d", out / "d")  # the link is copied as a link, never followed
        await env.upload_file(payload, "/app/to-victim")  # replaces the link instead of writing through it
        return await env.exec("cat /app/to-victim")

    result = asyncio.run(main())
    assert victim.read_text() == "host file\n"
    assert not (out / "stolen.txt").exists()
    assert (out / "d" / "to-host-dir").is_symlink()
    assert result.stdout == "uploaded\n"


def test_links_out_of_the_log_dirs_are_removed(make_sandbox: Callable[..., LocalSandbox]) -> None:
    env = make_sandbox()

    async def main():
        await env.start(force_build=False)
        return await env.exec("ln -s /etc/passwd /logs/agent/pw && echo x > /logs/agent/f && ln -s f /logs/agent/ok")

    assert asyncio.run(main()).return_code == 0
    agent_dir = env.trial_paths.agent_dir
    assert not (agent_dir / "pw").is_symlink() and not (agent_dir / "pw").exists()  # Harbor would read the host's
    assert (agent_dir / "ok").read_text() == "x\n"  # a link within the dir stays


def test_download_skips_fifos(make_sandbox: Callable[..., LocalSandbox], tmp_path: Path) -> None:
    async def main():
        env = await _started(make_sandbox())
        await env.exec("mkdir /app/d && mkfifo /app/d/pipe && echo a > /app/d/a")
        await asyncio.wait_for(env.download_dir("/app/d", tmp_path / "d"), timeout=10)  # reading a FIFO would hang

    asyncio.run(main())
    assert sorted(os.listdir(tmp_path / "d")) == ["a"]


def test_host_paths_are_refused(make_sandbox: Callable[..., LocalSandbox], tmp_path: Path) -> None:
    (tmp_path / "x").write_text("x")

    async def main():
        env = await _started(make_sandbox())
        for target in ("/usr/x", "/etc/passwd", "/proc/x", "/bin/x"):
            with pytest.raises(ValueError):
                await env.upload_file(tmp_path / "x", target)

    asyncio.run(main())
