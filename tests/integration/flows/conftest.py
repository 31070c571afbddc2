"""Flow tests share one temporary Prefect server for the whole session (it takes 10-15 s to start)."""

import pytest
from prefect.testing.utilities import prefect_test_harness

from flows.common import EPHEMERAL_STARTUP_TIMEOUT_S


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    with prefect_test_harness(server_startup_timeout=EPHEMERAL_STARTUP_TIMEOUT_S):
        yield
