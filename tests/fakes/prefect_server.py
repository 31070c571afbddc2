"""One temporary Prefect server per test folder, with the events worker bound to it.

Prefect keeps one events worker per process, keyed without the server's URL, and task runs reach the server as
events (its task-run recorder writes them). A worker left from an earlier folder's server would send this folder's
events there: task runs and grpoflow run events would be missing here. So the worker is flushed and stopped on
entry (the next event starts one on this server) and on exit (nothing is left queued for a stopped server)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect.events.worker import EventsWorker
from prefect.testing.utilities import prefect_test_harness

from flows.common import EPHEMERAL_STARTUP_TIMEOUT_S


@contextmanager
def temporary_prefect_server() -> Iterator[None]:
    EventsWorker.drain_all(timeout=10)
    with prefect_test_harness(server_startup_timeout=EPHEMERAL_STARTUP_TIMEOUT_S):
        EventsWorker.drain_all(timeout=10)
        try:
            yield
        finally:
            EventsWorker.drain_all(timeout=10)
