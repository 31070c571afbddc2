"""Fault injection in LocalSandbox, the missing-bwrap error, and the retry predicate `is_sandbox_failure_type`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from harbor.environments.base import HealthcheckError, SandboxBuildFailedError
from harbor.trial.errors import (
    AgentTimeoutError,
    EnvironmentStartTimeoutError,
    VerifierTimeoutError,
)
from harbor.verifier.verifier import AddTestsDirError, RewardFileNotFoundError

from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.errors import EngineError
from grpoflow.rollout.environments import (
    SandboxDiedError,
    SandboxError,
    SandboxStartError,
    SandboxUnavailableError,
    is_sandbox_failure_type,
)
from tests.fakes.faulty_sandbox import FaultySandbox


def test_fail_start_probability_one_always_fails(make_sandbox: Callable[..., LocalSandbox], sandbox_dirs: Path) -> None:
    env = make_sandbox(cls=FaultySandbox, fail_start_probability=1.0)
    with pytest.raises(SandboxStartError, match="injected") as caught:
        asyncio.run(env.start(force_build=False))
    assert is_sandbox_failure_type(type(caught.value).__name__)
    assert list(sandbox_dirs.iterdir()) == []  # it failed before creating anything


def test_seeded_start_faults_hit_the_rate_and_repeat_per_session(make_sandbox: Callable[..., LocalSandbox]) -> None:
    def fails(session: int, seed: int) -> bool:
        env = make_sandbox(cls=FaultySandbox, fail_start_probability=0.5, fail_start_seed=seed)
        env.session_id = f"trial-{session}__env"
        try:
            env.maybe_fail_start()
        except SandboxStartError:
            return True
        return False

    first = [fails(i, seed=7) for i in range(40)]
    assert 8 <= sum(first) <= 32  # about half
    assert first == [fails(i, seed=7) for i in range(40)]  # the same trial name and seed: the same fate
    assert first != [fails(i, seed=8) for i in range(40)]


def test_die_after_execs(make_sandbox: Callable[..., LocalSandbox]) -> None:
    async def main() -> list[str]:
        env = make_sandbox(cls=FaultySandbox, die_after_execs=2)
        await env.start(force_build=False)  # start's own probe is not counted
        seen = [(await env.exec("echo ok")).stdout.strip() for _ in range(2)]
        for _ in range(2):  # a dead sandbox stays dead
            with pytest.raises(SandboxDiedError, match="injected"):
                await env.exec("echo ok")
        return seen

    assert asyncio.run(main()) == ["ok", "ok"]


def test_missing_bwrap_names_the_package(
    make_sandbox: Callable[..., LocalSandbox], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = make_sandbox()
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(SandboxUnavailableError, match="apt-get install -y bubblewrap") as caught:
        asyncio.run(env.start(force_build=False))
    assert not is_sandbox_failure_type(type(caught.value).__name__)  # retrying cannot install it: fail fast


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (SandboxError("x"), True),
        (SandboxStartError("x"), True),
        (SandboxDiedError("x"), True),
        (EnvironmentStartTimeoutError("x"), True),
        (HealthcheckError("x"), True),
        (SandboxBuildFailedError("x"), True),
        (AddTestsDirError("x"), True),
        (SandboxUnavailableError("x"), False),
        (AgentTimeoutError("x"), False),
        (VerifierTimeoutError("x"), False),
        (RewardFileNotFoundError("x"), False),
        (EngineError("model server down"), False),
        (RuntimeError("agent bug"), False),
        (asyncio.CancelledError(), False),
        (TimeoutError(), False),
        (None, False),
    ],
)
def test_is_sandbox_failure_on_exceptions(exc: BaseException | None, expected: bool) -> None:
    # Harbor keeps only the class name of the exception that ended a trial: the verdict is made on it
    assert is_sandbox_failure_type(None if exc is None else type(exc).__name__) is expected


def test_an_agent_exit_is_not_a_sandbox_failure() -> None:
    assert not is_sandbox_failure_type("NonZeroAgentExitCodeError")
