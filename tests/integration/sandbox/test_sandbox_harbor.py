"""LocalSandbox through real Harbor trials: oracle 1.0 and nop 0.0 on every built-in task, faults, agent timeout."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from harbor.models.trial.config import (
    AgentConfig,
    EnvironmentConfig,
    TaskConfig,
    TrialConfig,
)
from harbor.models.trial.result import TrialResult
from harbor.trial.trial import Trial

from grpoflow.prepare.dataset import load_dataset
from grpoflow.rollout.environments import LOCAL_SANDBOX_IMPORT_PATH, is_sandbox_failure_type
from tests.fakes.faulty_sandbox import FAULTY_SANDBOX_IMPORT_PATH
from tests.integration.sandbox.sandbox_helpers import new_marker, wait_gone

TASKS = load_dataset("builtin-fixed").tasks
CONCURRENCY = 8  # 2 cores here; each trial is mostly waiting on short bwrap processes


def _config(
    task_path: Path,
    agent: AgentConfig,
    trials_dir: Path,
    import_path: str = LOCAL_SANDBOX_IMPORT_PATH,
    **env_kwargs: Any,
) -> TrialConfig:
    return TrialConfig(
        task=TaskConfig(path=task_path),
        agent=agent,
        trials_dir=trials_dir,
        environment=EnvironmentConfig(import_path=import_path, kwargs={"base_images": {}, **env_kwargs}),
    )


async def _run(config: TrialConfig, gate: asyncio.Semaphore | None = None) -> TrialResult:
    async with gate or asyncio.Semaphore(1):
        trial = await Trial.create(config)
        return await trial.run()


def _reward(result: TrialResult) -> float | None:
    return result.verifier_result.rewards.get("reward") if result.verifier_result else None


def test_oracle_scores_one_and_nop_zero_on_every_builtin_task(bwrap: str, tmp_path: Path, sandbox_dirs: Path) -> None:
    trials = tmp_path / "trials"
    runs = [(task, agent) for task in TASKS for agent in ("oracle", "nop")]

    async def main() -> list[TrialResult]:
        gate = asyncio.Semaphore(CONCURRENCY)
        return await asyncio.gather(
            *[
                _run(_config(task.path, AgentConfig(name=agent), trials, work_dir=str(sandbox_dirs)), gate)
                for task, agent in runs
            ]
        )

    results = asyncio.run(main())
    got = {(task.name, agent): (_reward(r), r.exception_info) for (task, agent), r in zip(runs, results, strict=True)}
    want = {(task.name, agent): (1.0 if agent == "oracle" else 0.0, None) for task, agent in runs}
    assert got == want
    # Harbor found the agent's log and the reward where it expects them: in the trial dir, bound at /logs/*.
    oracle = next(r for (_, agent), r in zip(runs, results, strict=True) if agent == "oracle")
    trial_dir = trials / oracle.trial_name
    assert (trial_dir / "agent" / "oracle.txt").is_file()
    assert (trial_dir / "verifier" / "reward.txt").read_text().strip() == "1"
    assert list(sandbox_dirs.iterdir()) == []  # every per-trial sandbox dir was deleted at stop()


def test_injected_start_fault_is_a_sandbox_failure_in_the_trial_result(bwrap: str, tmp_path: Path) -> None:
    task = TASKS[0]
    result = asyncio.run(
        _run(
            _config(
                task.path, AgentConfig(name="oracle"), tmp_path, FAULTY_SANDBOX_IMPORT_PATH, fail_start_probability=1.0
            )
        )
    )
    assert result.exception_info is not None
    assert result.exception_info.exception_type == "SandboxStartError"
    assert is_sandbox_failure_type(result.exception_info.exception_type)
    assert result.verifier_result is None  # never scored: the rollout layer retries it instead


def test_sandbox_dying_mid_episode_is_a_sandbox_failure(bwrap: str, tmp_path: Path) -> None:
    task = TASKS[0]
    result = asyncio.run(
        _run(_config(task.path, AgentConfig(name="oracle"), tmp_path, FAULTY_SANDBOX_IMPORT_PATH, die_after_execs=0))
    )
    assert result.exception_info is not None
    assert result.exception_info.exception_type == "SandboxDiedError"
    assert is_sandbox_failure_type(result.exception_info.exception_type)
    assert result.verifier_result is None


def test_harbor_agent_timeout_cancels_the_exec_and_kills_its_processes(bwrap: str, tmp_path: Path) -> None:
    marker = new_marker()
    agent = AgentConfig(
        import_path="tests.integration.sandbox.sandbox_test_agents:SleepAgent",
        override_timeout_sec=1.0,
        kwargs={"marker": marker},
    )
    task = TASKS[0]
    result = asyncio.run(_run(_config(task.path, agent, tmp_path)))
    assert result.exception_info is not None and result.exception_info.exception_type == "AgentTimeoutError"
    assert not is_sandbox_failure_type(
        result.exception_info.exception_type
    )  # the agent's budget, not the sandbox: never retried
    assert _reward(result) == 0.0  # Harbor still verifies after its own agent timeout
    assert wait_gone(marker) == []  # the cancelled exec's processes, foreground and setsid'd, are gone
    assert os.path.isdir(tmp_path / result.trial_name)
