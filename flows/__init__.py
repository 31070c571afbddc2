"""Prefect flows of grpoflow and the `grpoflow` command line.

Offline hygiene (`grpoflow.offline`) is applied here, before Prefect, Harbor or LiteLLM are imported: tests and
benches import this package, and run.sh relies on it.
"""

from grpoflow.offline import OFFLINE_ENV, apply_offline_env

apply_offline_env()

__all__ = ["OFFLINE_ENV"]
