"""The local sandbox's isolation probes, run unchanged on a Dockerfile-built task: the trial runs on the image's
exported tree, under the same bubblewrap sandbox (no network, no host loopback, no host secrets or environment, no
writes outside the trial, no process outliving its exec). `make_sandbox` here makes sandboxes over that task."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.rollout.environments import ImageBuildError
from tests.integration.docker.conftest import DOCKER_TASK, TASKS
from tests.integration.sandbox.conftest import sandbox_factory
from tests.integration.sandbox.test_sandbox_isolation import (  # noqa: F401  (collected here, on the image)
    test_background_processes_do_not_outlive_the_exec,
    test_cannot_read_planted_host_secrets,
    test_cannot_write_outside_its_dirs,
    test_host_environment_never_reaches_the_sandbox,
    test_no_network_not_even_the_hosts_loopback,
)


def test_the_trial_runs_in_the_image_and_its_writes_stay_in_the_trial(
    make_sandbox: Callable[..., LocalSandbox],
) -> None:
    async def main() -> tuple:
        first, second = make_sandbox(), make_sandbox()
        await first.start(force_build=False)
        await second.start(force_build=False)
        seen = await first.exec("pwd; echo $TOTAL_FILE; python3 -m pytest --version; cat sales.csv | wc -l")
        wrote = await first.exec("echo changed > sales.csv && echo x > /workspace/new.txt; echo x > /usr/bin/x")
        other = await second.exec("cat sales.csv | head -n1; ls /workspace")
        return first, seen, wrote, other

    first, seen, wrote, other = asyncio.run(main())
    assert seen.return_code == 0, seen.stderr
    lines = seen.stdout.split("\n")
    assert lines[:2] == ["/workspace", "/workspace/total.txt"]  # the image's WORKDIR and ENV
    assert "pytest 8.3.4" in seen.stdout + seen.stderr and lines[-2] == "4"  # pip's package, COPY's data
    assert wrote.return_code != 0 and "Read-only file system" in wrote.stderr  # the image's /usr
    assert other.stdout.split() == ["item,amount", "sales.csv"]  # the first trial's writes are its own
    tree = first.image.rootfs
    assert (tree / "workspace" / "sales.csv").read_text().startswith("item,amount")
    assert not (tree / "workspace" / "new.txt").exists() and not (tree / "usr" / "bin" / "x").exists()
    record = json.loads((Path(first.trial_paths.trial_dir) / "environment-image.json").read_text())
    assert record["tag"] == first.image.tag and Path(record["build_log"]).is_file()


def test_an_image_without_bash_fails_at_start_in_one_line(image_cache: Path, tmp_path: Path) -> None:
    """Every command runs as the image's `/bin/bash -c`: without it no command may run at all."""
    task = shutil.copytree(TASKS / DOCKER_TASK, tmp_path / "bare")
    (task / "environment" / "Dockerfile").write_text("FROM scratch\nCOPY data/ /workspace/\n")
    factory = sandbox_factory(lambda _: task, "bare", tmp_path, image_cache_dir=str(image_cache))
    make = next(factory)
    with pytest.raises(ImageBuildError, match="the image has no /bin/bash") as info:
        asyncio.run(make().start(force_build=False))
    assert "\n" not in str(info.value)
    next(factory, None)  # stops what it made
