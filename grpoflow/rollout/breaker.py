"""Admission of a step's sandbox starts: a bound on starts per second, and a breaker for provider outages.

Each trial retries its own failed sandbox start (`grpoflow.rollout.trials`), which is right for a sandbox that
failed on its own and wrong for a provider that is down or throttling: every trial of the step would retry into
the outage, spend its retries, and its group would be dropped. The breaker watches the outcome of the last
`window` sandbox starts. When more than `failure_rate` of them failed it opens: no new attempt starts; after
`wait_s` one attempt goes through as a probe; its sandbox starting closes the breaker, its failure reopens it with
the wait doubled (up to `max_wait_s`). Trials already running are left alone. A start that fails while the
breaker is open (or that opens it) is the outage's, not the trial's: it costs the trial none of its retries, and
the trial waits for the breaker and runs again. Open for longer than `give_up_s` in all, the step fails with
`SandboxOutageError`, which names the last failure; the run resumes from its last checkpoint later.

State is plain numbers read against the clock, awaited by polling: no asyncio object outlives the event loop of
one step (each step runs its own).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from harbor.models.trial.result import TrialResult

from grpoflow.config.rollout import BreakerConfig
from grpoflow.errors import GrpoflowError, one_line
from grpoflow.rollout.environments import ImageBuildError, is_sandbox_failure_type

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a waiting attempt looks at the breaker again


class SandboxOutageError(GrpoflowError):
    """Sandbox starts kept failing for longer than `rollout.sandbox.breaker.give_up_s`: the provider is down."""


# Start failures of the task, not of the provider: its image does not build. Such a task's trials fail their starts
# whatever the provider does; the breaker must not wait on them, nor let one as its probe keep it open.
TASK_START_FAILURES = frozenset({ImageBuildError.__name__, "SandboxBuildFailedError"})


def start_failed(result: TrialResult | None) -> bool | None:
    """Whether the attempt's sandbox failed to start: True when it ended in a sandbox failure before its agent was
    set up (Harbor sets the agent up only in a started sandbox), False when the agent was set up, None when the
    attempt ended otherwise before that (its image did not build, say), or has no result (lost, cancelled): nothing
    to say about the provider."""
    if result is None:
        return None
    if result.agent_setup is not None:
        return False
    exc = result.exception_info
    if exc is None or exc.exception_type in TASK_START_FAILURES or not is_sandbox_failure_type(exc.exception_type):
        return None
    return True


@dataclass
class Opening:
    """One time the breaker was open: when (monotonic clock), for how long, and the failure that opened it."""

    at: float
    reason: str
    seconds: float = 0.0
    probes: int = 0


@dataclass
class SandboxAdmission:
    """Admits a step's attempts to start a sandbox (`admit`), and hears how each start went (`record`)."""

    breaker: BreakerConfig
    max_starts_per_s: float | None = None
    clock: Callable[[], float] = time.monotonic
    openings: list[Opening] = field(default_factory=list)
    _recent: deque[bool] = field(default_factory=deque)  # last starts, True: failed
    _open: Opening | None = None
    _retry_at: float = 0.0
    _wait_s: float = 0.0
    _probing: bool = False
    _next_start: float = 0.0

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=self.breaker.window)

    @property
    def is_open(self) -> bool:
        return self._open is not None

    async def admit(self) -> bool:
        """Wait until an attempt may start its sandbox; True when it is the breaker's probe (its outcome closes or
        reopens the breaker). Raises `SandboxOutageError` once the breaker was open for `give_up_s` in all (over
        the step's openings: a provider that flaps gives up too), unless a probe is still running: its sandbox may
        have started."""
        while (opened := self._open) is not None:
            now = self.clock()
            open_s = self.open_seconds()
            if open_s > self.breaker.give_up_s and not self._probing:
                probes = sum(o.probes for o in self.openings)
                raise SandboxOutageError(
                    f"sandbox starts kept failing: the breaker was open {open_s:.0f} s in {len(self.openings)} "
                    f"openings (rollout.sandbox.breaker.give_up_s {self.breaker.give_up_s:g}), {probes} probes; "
                    f"last: {opened.reason}"
                )
            if not self._probing and now >= self._retry_at:
                self._probing = True
                opened.probes += 1
                log.warning("sandbox breaker: probing with one sandbox start after %.0f s open", now - opened.at)
                return True
            await asyncio.sleep(POLL_S)
        await self._pace()
        return False

    async def _pace(self) -> None:
        if not self.max_starts_per_s:
            return
        now = self.clock()
        slot = max(now, self._next_start)
        self._next_start = slot + 1.0 / self.max_starts_per_s
        if slot > now:
            await asyncio.sleep(slot - now)

    def record(self, result: TrialResult | None, probe: bool) -> bool:
        """Count an attempt's sandbox start. True when its failure is the outage's (the breaker is open, or this
        failure opened it): the trial is run again without spending a retry."""
        failed = start_failed(result)
        if probe:
            self._probing = False
        if failed is None:
            return False
        now, reason = self.clock(), self._reason(result)
        if probe and self._open is not None:
            if failed:
                self._wait_s = min(2 * self._wait_s, self.breaker.max_wait_s)
                self._retry_at = now + self._wait_s
                log.warning("sandbox breaker: the probe failed (%s); next probe in %.0f s", reason, self._wait_s)
                return True
            self._close(now)
            return False
        self._recent.append(failed)
        if self._open is not None:
            return failed
        if failed and len(self._recent) == self._recent.maxlen:
            share = sum(self._recent) / len(self._recent)
            if share > self.breaker.failure_rate:
                self._open = Opening(at=now, reason=reason)
                self.openings.append(self._open)
                self._wait_s = self.breaker.wait_s
                self._retry_at = now + self._wait_s
                log.warning(
                    "sandbox breaker open: %d of the last %d sandbox starts failed (last: %s); no new trial starts "
                    "for %.0f s, then one probe",
                    sum(self._recent),
                    len(self._recent),
                    reason,
                    self._wait_s,
                )
                return True
        return False

    def _close(self, now: float) -> None:
        assert self._open is not None
        self._open.seconds = now - self._open.at
        log.warning("sandbox breaker closed: the probe's sandbox started after %.0f s open", self._open.seconds)
        self._open = None
        self._recent.clear()

    @staticmethod
    def _reason(result: TrialResult | None) -> str:
        exc = result.exception_info if result else None
        return one_line(f"{exc.exception_type}: {exc.exception_message}", 200) if exc else "no exception"

    def open_seconds(self) -> float:
        """Seconds the breaker was open over the step's openings, the current one until now."""
        now = self.clock()
        return sum(o.seconds or (now - o.at) for o in self.openings)

    def figures(self) -> dict[str, float]:
        """Wall-clock figures of the step (timings.jsonl): openings, and the seconds the breaker was open."""
        return {"sandbox_breaker_openings": float(len(self.openings)), "sandbox_breaker_open_s": self.open_seconds()}
