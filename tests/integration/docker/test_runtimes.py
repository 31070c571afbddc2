"""Runtimes that reserve far more address space than they touch (a JVM, Node, torch) start in a 2 GiB task, as in
Docker: the trial's memory is its cgroup's limit, not an address-space cap per process. The image is built here
by the real Docker engine from Debian's packages (python3-torch, not PyPI's CUDA wheels)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from grpoflow.embedded.sandbox.local import LocalSandbox
from tests.integration.sandbox.conftest import sandbox_factory

DOCKERFILE = """\
FROM debian:bookworm-slim
RUN apt-get update && \\
    apt-get install -y --no-install-recommends nodejs default-jre-headless python3-torch && \\
    rm -rf /var/lib/apt/lists/*
WORKDIR /app
"""

TASK_TOML = """\
schema_version = "1.4"

[verifier]
timeout_sec = 120.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 900.0
network_mode = "no-network"
cpus = 1
memory_mb = 2048
"""


def _task(root: Path) -> Path:
    task = root / "runtimes"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (task / "task.toml").write_text(TASK_TOML)
    (task / "instruction.md").write_text("Start the runtimes.\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    return task


@pytest.fixture
def make_sandbox(image_cache: Path, tmp_path: Path) -> Iterator[Callable[..., LocalSandbox]]:
    task = _task(tmp_path / "tasks")
    work = tmp_path / "sandboxes"
    work.mkdir()
    yield from sandbox_factory(
        lambda name: task, "runtimes", tmp_path, work_dir=str(work), image_cache_dir=str(image_cache)
    )


def test_a_2_gib_task_starts_a_jvm_node_and_torch(make_sandbox: Callable[..., LocalSandbox]) -> None:
    commands = {
        "jvm": "java -version",
        "node": "node -e 'console.log(Buffer.alloc(64 << 20).length)'",
        "torch": "python3 -c 'import torch; print(torch.ones(1000, 1000).sum().item())'",
    }

    async def main() -> tuple[LocalSandbox, dict]:
        env = make_sandbox()
        await env.start(force_build=False)
        results = {name: await env.exec(cmd, timeout_sec=300) for name, cmd in commands.items()}
        await env.stop(delete=True)
        return env, results

    env, results = asyncio.run(main())
    for name, result in results.items():
        assert result.return_code == 0, (name, result.stderr[-2000:])
    assert "openjdk" in results["jvm"].stderr.lower()
    assert results["node"].stdout.strip() == str(64 << 20)
    assert results["torch"].stdout.strip() == "1000000.0"
    used = json.loads((Path(env.trial_paths.trial_dir) / "sandbox-resources.json").read_text())
    assert used["limited_by"].startswith("cgroup") and used["memory_mb"] == 2048
    assert 0 < used["peak_memory_mb"] <= 2048 and used["oom_kills"] == 0
