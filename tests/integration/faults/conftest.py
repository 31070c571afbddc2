"""Fault tests share one temporary Prefect server for the session (as tests/integration/flows does): the flow-level faults run
the real train flow. Core-level faults (engine, sandbox, verifier, disk) need no server but share the folder."""

import pytest
from prefect.testing.utilities import prefect_test_harness

from flows.common import EPHEMERAL_STARTUP_TIMEOUT_S


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    with prefect_test_harness(server_startup_timeout=EPHEMERAL_STARTUP_TIMEOUT_S):
        yield
