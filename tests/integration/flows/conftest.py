"""Flow tests share one temporary Prefect server for the whole session (it takes 10-15 s to start)."""

import pytest

from tests.fakes.prefect_server import temporary_prefect_server


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    with temporary_prefect_server():
        yield
