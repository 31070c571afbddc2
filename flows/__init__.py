"""Prefect flows of grpoflow and the `grpoflow` command line.

Offline hygiene (`grpoflow.offline`) is applied here, before Prefect, Harbor or LiteLLM are imported: tests and
benches import this package, and run.sh relies on it. So is `PREFECT_HOME`: Prefect creates it only where its
parent exists, and a temporary server without it has no database and never starts.
"""

import contextlib
import os
from pathlib import Path

from grpoflow.offline import OFFLINE_ENV, apply_offline_env

apply_offline_env()
if home := os.environ.get("PREFECT_HOME"):
    with contextlib.suppress(OSError):  # not ours to report: Prefect says what it cannot create
        Path(home).expanduser().mkdir(parents=True, exist_ok=True)

__all__ = ["OFFLINE_ENV"]
