"""Engines restarted in place: a thread that watches the processes of the engines a run started and, when one
exits (out of memory, a fault in a kernel, a kill), starts it again on the same port and GPUs with generation
held, has the run give it the weights it served (`restore`), then lets it generate again.

Nothing else in the run waits for this: a trial whose request meets the dead engine keeps retrying it for
`engine.outage_wait_s` and goes on where it was once the engine answers with its weights, so the step's finished
trials are kept and its unfinished ones continue. The restart and the restore run under the run's weights lock
(`lock`: its update, save and sync take it too), so no sync meets a held engine; a run's own calls wait for a
restart under way first (`settle`). After `engine.max_restarts` restarts, or when one fails, an engine that exits
stays down: an outage, as with an attached engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

from pydantic import BaseModel, ConfigDict

from grpoflow.engine.launch import EngineProcess, stop_process_group
from grpoflow.errors import EngineError
from grpoflow.lifeline import exit_signal

logger = logging.getLogger(__name__)

POLL_S = 0.5


class Restart(BaseModel):
    """One engine exit and what became of it (run.json keeps them: `engine_restarts`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at: str  # when the exit was seen (UTC, ISO 8601)
    engine: str  # its URL
    exit: str  # "code 1", "SIGKILL"
    seconds: float  # from the exit seen to the engine generating on its weights again (or being given up)
    weight_version: str | None = None  # what it serves again; None when it was not brought back
    error: str | None = None  # why it was not brought back


def exit_reason(returncode: int) -> str:
    """The signal's name for a process a signal ended; `code N`, with the signal behind a lifeline's 128 + N."""
    sig = exit_signal(returncode)
    if sig is None:
        return f"code {returncode}"
    return sig.name if returncode < 0 else f"code {returncode} ({sig.name})"


class EngineKeeper:
    """Watches `processes` (the run's started engines) from a thread; `restore(i)` gives engine `i`, restarted and
    held, the run's weights and returns the version it serves (EngineError when it cannot), both under `lock`;
    `check(i)`, once it generates again, proves it serves them. `on_restart` is told each `Restart` (run.json keeps
    them). A context manager: the thread stops at the end of the block."""

    def __init__(
        self,
        processes: tuple[EngineProcess, ...],
        restore: Callable[[int], str],
        *,
        lock: threading.Lock | None = None,
        max_restarts: int,
        startup_timeout_s: float,
        check: Callable[[int], None] | None = None,
        on_restart: Callable[[Restart], None] | None = None,
    ):
        self.processes, self.restore, self.check = processes, restore, check
        self.lock = lock or threading.Lock()
        self.max_restarts, self.startup_timeout_s = max_restarts, startup_timeout_s
        self.on_restart = on_restart
        self.restarts: list[Restart] = []
        self._down: set[int] = set()  # engines left down: out of restarts, or a restart failed
        self._busy = 0  # restarts under way
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-keeper", daemon=True)

    def __enter__(self) -> EngineKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def brought_back(self) -> int:
        return sum(r.error is None for r in self.restarts)

    def settle(self, grace_s: float = 0.0) -> None:
        """Return once no restart is under way, and none is due: an engine that exited is restarted first.
        `grace_s`: first give an engine that is going down (a call to it just failed) that long to exit."""
        deadline = time.monotonic() + grace_s
        while True:
            with self._cond:
                if self._busy == 0 and not self._exited() and time.monotonic() >= deadline:
                    return
                if not self._thread.is_alive():
                    raise EngineError("the engine keeper stopped: no engine is restarted any more")
                self._cond.wait(POLL_S)
            if self._busy == 0 and not self._exited() and all(p.client.health(1.0) for p in self._up()):
                deadline = 0.0  # every engine answers: nothing is going down

    def _up(self) -> list[EngineProcess]:
        return [p for i, p in enumerate(self.processes) if i not in self._down]

    def _exited(self) -> list[int]:
        return [i for i, p in enumerate(self.processes) if i not in self._down and p.process.poll() is not None]

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            for i in self._exited():
                with self._cond:
                    self._busy += 1
                try:
                    self._bring_back(i)
                finally:
                    with self._cond:
                        self._busy -= 1
                        self._cond.notify_all()

    def _bring_back(self, i: int) -> None:
        proc, t0 = self.processes[i], time.monotonic()
        at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        why = exit_reason(proc.process.returncode)
        version: str | None = None
        error: str | None = None
        if len(self.restarts) >= self.max_restarts:
            error = f"not restarted: engine.max_restarts ({self.max_restarts}) reached"
        else:
            logger.warning(
                "engine %s exited (%s): restarting it in place (%d of at most %d)",
                proc.url,
                why,
                len(self.restarts) + 1,
                self.max_restarts,
            )
            try:
                with self.lock:
                    proc.restart(self.startup_timeout_s)
                    version = self.restore(i)
                    proc.release()
                if self.check is not None:
                    self.check(i)
            except Exception as err:  # noqa: BLE001  (the keeper's thread: recorded and logged, the engine left down)
                error = f"restart failed: {err}" if isinstance(err, EngineError) else f"restart failed: {err!r}"
                # not proc.stop(): its client is the run's, and stays usable (an outage) while the engine is down
                stop_process_group(proc.process, proc.stop_timeout)
        record = Restart(
            at=at,
            engine=proc.url,
            exit=why,
            seconds=round(time.monotonic() - t0, 1),
            weight_version=version,
            error=error,
        )
        self.restarts.append(record)
        if error is None:
            logger.warning("engine %s serves weight version %s again after %.1fs", proc.url, version, record.seconds)
        else:
            self._down.add(i)
            logger.error("engine %s exited (%s) and stays down: %s", proc.url, why, error.splitlines()[0])
        if self.on_restart is not None:
            try:
                self.on_restart(record)
            except Exception as err:  # noqa: BLE001  (the record is logged above; the keeper goes on)
                logger.error("engine %s: its restart could not be recorded: %r", proc.url, err)
