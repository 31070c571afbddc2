"""The sandbox breaker's rule on constructed attempt results: when it opens, what a probe does, when it gives up,
and the bound on starts per second."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from grpoflow.config.rollout import BreakerConfig
from grpoflow.rollout.breaker import SandboxAdmission, SandboxOutageError, start_failed

STARTED = SimpleNamespace(agent_setup=object(), exception_info=None)
START_FAILED = SimpleNamespace(
    agent_setup=None, exception_info=SimpleNamespace(exception_type="SandboxStartError", exception_message="down")
)
AGENT_FAILED = SimpleNamespace(  # before the agent's setup, for a reason that is not the sandbox's
    agent_setup=None, exception_info=SimpleNamespace(exception_type="ValueError", exception_message="bad")
)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admission(clock, **breaker) -> SandboxAdmission:
    cfg = BreakerConfig(
        **({"window": 4, "failure_rate": 0.5, "wait_s": 10, "max_wait_s": 25, "give_up_s": 100} | breaker)
    )
    return SandboxAdmission(cfg, clock=clock)


def opened(a: SandboxAdmission) -> None:
    """Two failed starts fill a window of 2: the breaker opens."""
    assert [a.record(START_FAILED, False) for _ in range(2)] == [False, True] and a.is_open


def admitted_now(a: SandboxAdmission) -> bool | None:
    """The probe flag when `admit` returns without waiting; None when it would wait."""

    async def one():
        try:
            return await asyncio.wait_for(a.admit(), timeout=0.5)
        except TimeoutError:
            return None

    return asyncio.run(one())


def test_what_a_start_says():
    assert (start_failed(STARTED), start_failed(START_FAILED), start_failed(AGENT_FAILED)) == (False, True, None)
    no_image = SimpleNamespace(
        agent_setup=None, exception_info=SimpleNamespace(exception_type="ImageBuildError", exception_message="x")
    )
    assert start_failed(no_image) is None  # the task's own fault: the provider is not down
    assert start_failed(None) is None


def test_it_opens_above_the_rate_and_a_started_probe_closes_it():
    clock = Clock()
    a = admission(clock)
    # 2 of 4 failed: not above 0.5; each failure costs its trial a retry (False)
    assert [a.record(r, False) for r in (START_FAILED, STARTED, START_FAILED, STARTED)] == [False] * 4
    assert not a.is_open and admitted_now(a) is False
    assert a.record(AGENT_FAILED, False) is False and not a.is_open  # says nothing about the provider
    assert a.record(START_FAILED, False) is False  # window F S F S F... 2 of 4 -> still closed
    assert a.record(START_FAILED, False) is True and a.is_open  # 3 of the last 4: the outage's
    assert a.record(START_FAILED, False) is True  # in flight when it opened: the outage's too
    assert a.record(STARTED, False) is False and a.is_open  # a trial already running: the breaker stays open
    assert admitted_now(a) is None  # no start while open
    clock.now += 10
    assert admitted_now(a) is True  # the probe
    assert admitted_now(a) is None  # one probe at a time
    assert a.record(START_FAILED, True) is True and a.is_open
    clock.now += 10
    assert admitted_now(a) is None  # the wait doubled: 20 s
    clock.now += 10
    assert admitted_now(a) is True
    assert a.record(STARTED, True) is False and not a.is_open
    assert admitted_now(a) is False and admitted_now(a) is False
    assert a.figures() == {"sandbox_breaker_openings": 1.0, "sandbox_breaker_open_s": 30.0}
    assert [a.record(START_FAILED, False) for _ in range(3)] == [False, False, False]  # the window starts afresh


def test_a_lost_probe_lets_the_next_attempt_probe():
    clock = Clock()
    a = admission(clock, window=2, failure_rate=0.0)
    opened(a)
    clock.now += 10
    assert admitted_now(a) is True
    assert a.record(None, True) is False  # the probe's attempt was lost (a worker died, it was cancelled)
    assert admitted_now(a) is True


def test_it_gives_up_after_give_up_s_naming_the_last_failure():
    clock = Clock()
    a = admission(clock, window=2)
    opened(a)
    clock.now += 101
    with pytest.raises(SandboxOutageError, match=r"open 101 s in 1 openings .*give_up_s 100.*SandboxStartError: down"):
        admitted_now(a)


def test_give_up_counts_every_opening_and_waits_for_a_running_probe():
    clock = Clock()
    a = admission(clock, window=2)
    opened(a)
    clock.now += 60
    assert admitted_now(a) is True
    assert a.record(STARTED, True) is False and not a.is_open  # 60 s open, closed
    opened(a)  # a flapping provider: open again
    clock.now += 30
    assert admitted_now(a) is True  # 90 s in all: the probe goes
    clock.now += 20  # 110 s in all, but the probe runs: its sandbox may have started
    assert admitted_now(a) is None
    assert a.record(START_FAILED, True) is True
    with pytest.raises(SandboxOutageError, match=r"open 110 s in 2 openings"):
        admitted_now(a)


def test_failure_rate_one_never_opens():
    a = admission(Clock(), failure_rate=1.0)
    assert [a.record(START_FAILED, False) for _ in range(10)] == [False] * 10 and not a.is_open


def test_starts_per_second_are_spaced():
    a = SandboxAdmission(BreakerConfig(), max_starts_per_s=20.0)

    async def five():
        t0 = time.monotonic()
        for _ in range(5):
            await a.admit()
        return time.monotonic() - t0

    assert asyncio.run(five()) >= 4 / 20 - 0.01  # the 5th start waits for 4 intervals of 1/20 s
