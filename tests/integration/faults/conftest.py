"""Fault tests share one temporary Prefect server for the session (as tests/integration/flows does): the flow-level faults run
the real train flow. Core-level faults (engine, sandbox, verifier, disk) need no server but share the folder."""

import pytest

from tests.fakes.prefect_server import temporary_prefect_server


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    with temporary_prefect_server():
        yield
