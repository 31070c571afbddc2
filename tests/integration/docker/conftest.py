"""Fixtures for tasks whose environment is built from their Dockerfile: a Docker engine and the Debian base image
(scripts/docker-env.sh starts and builds what is missing), and LocalSandboxes over such a task."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from grpoflow.embedded.sandbox.local import LocalSandbox
from tests.integration.sandbox.conftest import sandbox_factory

REPO = Path(__file__).resolve().parents[3]
TASKS = Path(__file__).resolve().parent / "tasks"  # tasks in Harbor's format, written here
DOCKER_TASK = "csv-total"
# The tasks' own pytest verifiers run inside their sandboxes, never in this suite.
collect_ignore_glob = ["tasks/*"]


def task_with_dockerfile(tmp_path: Path, name: str, dockerfile: str) -> Path:
    """A copy of the written task named `name` under `tmp_path`, its environment built from `dockerfile`."""
    task = shutil.copytree(TASKS / DOCKER_TASK, tmp_path / name)
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    return task


def _ensure_docker() -> None:
    """Fail (not skip) with the reason when no engine can be had: CI's `./run.sh test` installs and starts it."""
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap (bwrap) is not installed: ./run.sh test installs it")
    proc = subprocess.run([str(REPO / "scripts" / "docker-env.sh")], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"Docker is not ready for the Dockerfile-task tests: {proc.stderr.strip()[-2000:]}")


@pytest.fixture(scope="session")
def docker_ready() -> None:
    _ensure_docker()


@pytest.fixture(scope="session")
def image_cache(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One image cache for the session: the task's image is built and unpacked once."""
    return tmp_path_factory.mktemp("images")


@pytest.fixture
def docker_tasks(tmp_path: Path) -> Path:
    """A copy of the tasks written here (tests may add broken ones next to them)."""
    root = tmp_path / "tasks"
    shutil.copytree(TASKS, root)
    return root


@pytest.fixture
def make_sandbox(image_cache: Path, tmp_path: Path) -> Iterator[Callable[..., LocalSandbox]]:
    """As tests/integration/sandbox's `make_sandbox`, over the Dockerfile-built task: the sandbox probes written
    for the host rootfs run unchanged on an image's tree."""
    work = tmp_path / "sandboxes"
    work.mkdir()
    yield from sandbox_factory(
        lambda name: TASKS / name, DOCKER_TASK, tmp_path, work_dir=str(work), image_cache_dir=str(image_cache)
    )
