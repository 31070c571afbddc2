"""Every flow emits `grpoflow.run.completed` or `grpoflow.run.failed` with the run's summary when it ends."""

import pytest

from flows.prepare import prepare_flow
from grpoflow.config import parse_run_config
from grpoflow.preflight import PreflightError
from tests.integration.faults.events import run_events

pytestmark = pytest.mark.flow


def test_prepare_emits_completed_then_failed_for_a_taken_run_dir(tmp_path, tiny_model_dir):
    cfg = parse_run_config(
        {
            "run_id": "ev-1",
            "output_dir": str(tmp_path),
            "model": {"source": str(tiny_model_dir)},
            "dataset": {"path": "builtin-fixed"},
        }
    )
    prepare_flow(cfg)
    with pytest.raises(PreflightError):
        prepare_flow(cfg)  # the run dir exists now
    events = run_events("ev-1", expect=2)
    assert [e.event for e in events] == ["grpoflow.run.completed", "grpoflow.run.failed"]
    done, failed = events
    assert done.resource.id == "grpoflow.run.ev-1" and done.resource["grpoflow.flow"] == "prepare"
    assert done.payload["run_id"] == "ev-1" and done.payload["flow"] == "prepare"
    assert done.payload["run_dir"] == str((tmp_path / "ev-1").resolve()) and done.payload["steps"] == 0
    assert any(r.id.startswith("prefect.flow-run.") for r in done.related)  # automations can reach the flow run
    assert failed.payload["error"].startswith("PreflightError: ") and "already exists" in failed.payload["error"]
