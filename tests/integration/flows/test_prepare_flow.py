import json

import pytest
from prefect.client.orchestration import get_client

from flows.prepare import prepare_flow
from grpoflow.config import RunConfig, parse_run_config
from grpoflow.errors import ModelError

pytestmark = pytest.mark.flow


def _flow_run(run_id_prefix: str):
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
    return [r for r in runs if r.name.startswith(run_id_prefix)]


def _artifact(key: str):
    with get_client(sync_client=True) as client:
        return [a for a in client.read_latest_artifacts() if a.key == key]


def test_prepare_flow_records_the_run_and_a_summary_artifact(tiny_model_dir, tmp_path):
    cfg = parse_run_config(
        {
            "run_id": "flow-1",
            "output_dir": str(tmp_path),
            "model": {"source": str(tiny_model_dir)},
            "dataset": {"path": "builtin-fixed"},
        }
    )
    run = prepare_flow(cfg)
    root = tmp_path / "flow-1"
    assert {p.name for p in root.iterdir()} == {"config.json", "run.json", "prompts.jsonl", "gate.json"}
    info = json.loads((root / "run.json").read_text())
    [fr] = _flow_run("prepare-flow-1")
    assert info["flow_run_id"] == str(fr.id) and fr.state.is_completed()
    [art] = _artifact("prepare-flow-1")
    assert run.model.weights_sha256 in art.data and f"| tasks | {run.n_tasks} |" in art.data


def test_flow_without_run_id_generates_one_and_names_the_flow_run(tiny_model_dir, tmp_path):
    run = prepare_flow(RunConfig(output_dir=str(tmp_path), model={"source": str(tiny_model_dir)}))
    run_id = run.paths.root.name
    assert (tmp_path / run_id / "config.json").is_file()
    assert _flow_run(f"prepare-{run_id}")


def test_flow_with_bad_model_fails_with_the_one_line_error(tmp_path):
    cfg = RunConfig(run_id="flow-bad", output_dir=str(tmp_path), model={"source": str(tmp_path / "none")})
    with pytest.raises(ModelError, match="no such file or directory"):
        prepare_flow(cfg)
    assert not (tmp_path / "flow-bad").exists()
