"""The sandbox a step's trials run in, as Harbor's `EnvironmentConfig`."""

from __future__ import annotations

from typing import Any

from harbor.models.environment_type import EnvironmentType
from harbor.models.trial.config import EnvironmentConfig

from grpoflow.config import RolloutConfig
from grpoflow.rollout.environments import LOCAL_SANDBOX_IMPORT_PATH
from grpoflow.rollout.harnesses import get_binding, sandbox_allowed_hosts


def sandbox_config(
    rollout: RolloutConfig, base_images: dict[str, str] | None = None, **kwargs: Any
) -> EnvironmentConfig:
    """Harbor's environment for `rollout.sandbox.backend`: our bubblewrap `LocalSandbox`, or a Harbor environment type
    passed straight through. What the harness needs of the local sandbox (terminus-2: processes that live across
    execs), then `rollout.sandbox.kwargs`, then `kwargs` (which win) go to its constructor, and `base_images`
    (`dataset.base_images`: the local sandbox builds a task's image from them).

    No credentials here: Harbor writes this config into every trial dir. A provider's key reaches its SDK through
    the process environment (`grpoflow.credentials.export_sandbox_key`).
    """
    merged = {**rollout.sandbox.kwargs, **kwargs}
    hosts = sandbox_allowed_hosts(rollout)  # a CLI harness's session server (Harbor's network policy)
    if rollout.sandbox.local:
        merged = {**get_binding(rollout.harness.name).local_sandbox_kwargs, **merged}
        merged["base_images"] = dict(base_images or {})
        return EnvironmentConfig(import_path=LOCAL_SANDBOX_IMPORT_PATH, kwargs=merged, extra_allowed_hosts=hosts)
    return EnvironmentConfig(type=EnvironmentType(rollout.sandbox.backend), kwargs=merged, extra_allowed_hosts=hosts)
