"""What every flow does first: validate its config again (the UI skips validators), fix the run_id, and name
the flow run after it."""

from __future__ import annotations

import os

from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

from grpoflow.config import RunConfig, parse_run_config

# Offline hygiene for everything the flows start (Harbor, LiteLLM); set before they are imported by tasks.
os.environ.setdefault("HARBOR_TELEMETRY", "0")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def flow_run_name(prefix: str):
    """A `flow_run_name` callable: `<prefix>-<run_id>`, or `<prefix>-pending` until the flow assigns one."""

    def name() -> str:
        cfg = flow_run.parameters.get("config")
        run_id = cfg.get("run_id") if isinstance(cfg, dict) else getattr(cfg, "run_id", None)
        return f"{prefix}-{run_id or 'pending'}"

    return name


def start_run(config: RunConfig | dict, prefix: str) -> RunConfig:
    cfg = parse_run_config(config, source="flow parameter `config`")
    given = config.get("run_id") if isinstance(config, dict) else config.run_id
    if not given and flow_run.id:  # generated here: rename the flow run so the UI shows the run_id
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=f"{prefix}-{cfg.run_id}")
    return cfg
