"""Read what a flow reported as events (grpoflow run events, task runs) back from the Prefect server the tests
share."""

from __future__ import annotations

import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
from prefect.events.worker import EventsWorker


def task_runs(flow_run_id, expect: set[str], timeout_s: float = 20.0) -> dict[str, tuple]:
    """`{name: (start_time, end_time)}` of a flow run's task runs; waits until every name in `expect` has ended
    (task runs reach the server as events, which its task-run recorder writes shortly after)."""
    EventsWorker.drain_all(timeout=10)
    flt = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            runs = {r.name: (r.start_time, r.end_time) for r in client.read_task_runs(flow_run_filter=flt)}
        if all(runs.get(name, (None, None))[1] is not None for name in expect) or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


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
