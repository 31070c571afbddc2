"""Read the grpoflow run events a flow emitted, back from the Prefect server the tests share."""

from __future__ import annotations

import time

from prefect.client.orchestration import get_client
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
from prefect.events.worker import EventsWorker


def fresh_events_worker() -> None:
    """Stop (after flushing) an events worker bound to an earlier test server (each test dir's conftest starts
    its own): the next event starts a worker on the current server, where `run_events` reads."""
    EventsWorker.drain_all(timeout=10)


def run_events(run_id: str, expect: int = 1, timeout_s: float = 20.0) -> list:
    """Events about resource `grpoflow.run.<run_id>`, oldest first; waits until `expect` have arrived."""
    EventsWorker.drain_all(timeout=10)  # emitted events leave through a background worker
    flt = EventFilter(
        event=EventNameFilter(prefix=["grpoflow.run."]),
        resource=EventResourceFilter(id=[f"grpoflow.run.{run_id}"]),
    )
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            events = sorted(client.read_events(filter=flt, limit=50).events, key=lambda e: e.occurred)
        if len(events) >= expect or time.monotonic() > deadline:
            return events
        time.sleep(0.5)
