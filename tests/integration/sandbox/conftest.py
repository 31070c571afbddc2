"""Fixtures for the sandbox tests: a LocalSandbox over a built-in task, constructed the way Harbor does."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths

from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.prepare.dataset import load_dataset

NO_BWRAP = "bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap (./run.sh test installs it)"


@pytest.fixture
def bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        pytest.skip(NO_BWRAP)
    return path


@pytest.fixture
def sandbox_dirs(tmp_path: Path) -> Path:
    """Where the tests' sandboxes keep their per-trial dirs (checked empty after stop(delete=True))."""
    path = tmp_path / "sandboxes"
    path.mkdir()
    return path


@pytest.fixture
def make_sandbox(bwrap: str, tmp_path: Path, sandbox_dirs: Path) -> Iterator[Callable[..., LocalSandbox]]:
    """make_sandbox(task_name="copy-file", cls=LocalSandbox, **kwargs) -> a sandbox constructed as Harbor would (not
    started).

    Every sandbox made here is stopped (deleted) at teardown, even when the test failed half-way.
    """
    tasks = load_dataset("builtin-fixed")
    yield from sandbox_factory(lambda name: tasks.by_name(name).path, "copy-file", tmp_path, work_dir=str(sandbox_dirs))


def sandbox_factory(
    task_dir: Callable[[str], Path], default_task: str, tmp_path: Path, **defaults: Any
) -> Iterator[Callable[..., LocalSandbox]]:
    """Yields make(task_name=default_task, cls=LocalSandbox, **kwargs): a sandbox over `task_dir(task_name)`,
    constructed as Harbor would (not started), with `defaults` under `kwargs` and the task's own network policy (a
    `network_policy` / `phase_network_policies` kwarg overrides it); all are stopped (deleted) after."""
    made: list[LocalSandbox] = []

    def make(task_name: str = default_task, cls: type[LocalSandbox] = LocalSandbox, **kwargs: Any) -> LocalSandbox:
        task = Task(task_dir(task_name))
        trial_paths = TrialPaths(tmp_path / f"trial-{len(made)}")
        trial_paths.mkdir()
        env = cls(
            environment_dir=task.paths.environment_dir,
            environment_name=task_name,
            session_id=f"{task_name}__test{len(made)}__env",
            trial_paths=trial_paths,
            task_env_config=task.config.environment,
            **{"base_images": {}, "network_policy": task.config.environment.resolve_baseline(), **defaults, **kwargs},
        )
        made.append(env)
        return env

    yield make
    for env in made:
        asyncio.run(env.stop(delete=True))
