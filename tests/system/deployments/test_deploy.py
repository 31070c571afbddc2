"""`prefect deploy --all` with deployments/prefect.yaml against a real server: what was deployed, what the server
schedules, what it refuses, and a manual-train run triggered through the API and run by the worker."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import pytest

from flows.cli import main as cli_main
from flows.serve import ROOT, read_specs
from grpoflow.config import parse_run_config
from grpoflow.ledger import unaccounted
from grpoflow.prepare.presets import load_preset
from grpoflow.run.metrics import read_step_records, training_rows
from grpoflow.run.regrade import read_regrades
from tests.fakes.triggers import fires, render_parameters
from tests.system.deployments.conftest import POOL, artifacts_of, dumps, tiny_config

pytestmark = pytest.mark.slow

TRAIN_AND_EVALUATE = ["nightly-train", "nightly-evaluate", "manual-train"]


def test_yaml_declares_the_deployments_the_issue_asks_for():
    specs = {s.name: s for s in read_specs()}
    assert set(specs) == {"nightly-train", "nightly-evaluate", "manual-train", "rerun", "resume"}
    (sched,) = specs["nightly-train"].schedules
    assert sched.cron and sched.timezone and sched.active
    # the evaluation follows each completed nightly-train run (its event), not a clock, on that run's checkpoint
    (trigger,) = specs["nightly-evaluate"].triggers
    assert not specs["nightly-evaluate"].schedules and trigger["expect"] == ["grpoflow.run.completed"]
    assert trigger["match_related"]["prefect.resource.name"] == "nightly-train"
    assert trigger["parameters"] == {"from_run": "{{ event.payload.run_dir }}"}
    for name in ("nightly-train", "nightly-evaluate"):
        assert specs[name].parameters["config"], f"{name}: nightly parameters are explicit"
        assert "run_id" not in specs[name].parameters["config"], f"{name}: a fixed run_id would collide the 2nd night"
    assert specs["manual-train"].parameters == {} and not specs["manual-train"].schedules  # the form shows defaults
    # the nightly run is the main job's recipe, with the deterministic engine
    nightly = parse_run_config(specs["nightly-train"].parameters["config"])
    recipe = load_preset("embedded-default", {"engine.deterministic": True, "seed": 0})
    assert nightly.model_dump(exclude={"run_id"}) == recipe.model_dump(exclude={"run_id"})
    assert all(s.enforce_parameter_schema for s in specs.values())


def _completed(flow: str, *deployments: str) -> dict:
    related = [
        {"prefect.resource.id": f"prefect.deployment.{n}", "prefect.resource.role": "deployment"}
        | {"prefect.resource.name": name}
        for n, name in enumerate(deployments)
    ]
    return {
        "occurred": datetime.now(timezone.utc).isoformat(),
        "event": "grpoflow.run.completed",
        "resource": {"prefect.resource.id": "grpoflow.run.n1", "grpoflow.flow": flow},
        "related": related,
        "id": "7d7bd0c4-4bb6-4a3c-a0a7-38e9f6a8c0a1",
    }


def test_nightly_evaluation_follows_nightly_runs_and_their_resumes_only():
    (trigger,) = {s.name: s for s in read_specs()}["nightly-evaluate"].triggers
    assert fires(trigger, _completed("train", "nightly-train"))
    # a nightly run finished by `resume`: the resume deployment's run, announced as from nightly-train too
    assert fires(trigger, _completed("resume", "resume", "nightly-train"))
    assert not fires(trigger, _completed("resume", "resume"))  # a resume of a manual run
    assert not fires(trigger, _completed("train", "manual-train"))
    assert not fires(trigger, _completed("evaluate", "nightly-train"))


def _flow_run_ended(state: str, flow: str, name: str) -> dict:
    """The event Prefect emits when flow run `name` of flow `flow` enters `state`."""
    return {
        "occurred": datetime.now(timezone.utc).isoformat(),
        "event": f"prefect.flow-run.{state}",
        "resource": {"prefect.resource.id": "prefect.flow-run.4f0d", "prefect.resource.name": name},
        "related": [
            {"prefect.resource.id": "prefect.flow.9a1c", "prefect.resource.role": "flow", "prefect.resource.name": flow}
        ],
        "id": "1b0c5e2e-7d0a-4e0e-9a43-5d1f3a9c2b10",
    }


def test_crashed_train_runs_and_their_resumes_are_resumed_and_nothing_else():
    (trigger,) = {s.name: s for s in read_specs()}["resume"].triggers
    assert fires(trigger, _flow_run_ended("Crashed", "train", "train-night-1"))
    assert fires(trigger, _flow_run_ended("Crashed", "resume", "resume-night-1"))  # crashed again while resuming
    assert not fires(trigger, _flow_run_ended("Failed", "train", "train-night-1"))  # its own reason: a person's
    assert not fires(trigger, _flow_run_ended("Crashed", "evaluate", "evaluate-e1"))  # nothing to resume
    assert not fires(trigger, _flow_run_ended("Crashed", "rerun", "rerun-r1"))
    # the run to resume, as the server renders it from the crashed flow run: its name less the prefix, its dir
    for name, params, output_dir in [
        ("train-night-1", {"config": {"output_dir": "/srv/runs"}}, "/srv/runs"),
        ("train-20261207-010000-ab12cd", {"config": {}}, "runs"),  # the nightly config: the default dir
        ("resume-night-1", {"run_id": "night-1", "output_dir": "/srv/runs"}, "/srv/runs"),
    ]:
        got = render_parameters(trigger, flow_run=SimpleNamespace(name=name, parameters=params))
        assert got == {"run_id": name.split("-", 1)[1], "output_dir": output_dir, "max_resumes": 3}


def test_deployed_as_declared(prefect_stack):
    """Every train/evaluate deployment is on the server exactly as the yaml says, on the process pool, with a pull
    step that takes the run into this repository."""
    stack = prefect_stack
    for spec in read_specs():
        if spec.name in stack.not_deployed:
            continue
        d = stack.deployments.get(spec.name)
        assert d is not None, f"{spec.name} not deployed:\n{stack.deploy_output[-3000:]}"
        assert d["entrypoint"] == spec.entrypoint
        assert d["work_pool_name"] == POOL and d["work_queue_name"] == "default"
        assert d["enforce_parameter_schema"] is True
        assert d["parameters"] == spec.parameters
        assert d["description"] == spec.description and sorted(d["tags"]) == sorted(spec.tags)
        assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
        got = [(s["schedule"]["cron"], s["schedule"]["timezone"], s["active"]) for s in d["schedules"]]
        assert got == [(c.cron, c.timezone, c.active) for c in spec.schedules], spec.name
        assert d["job_variables"] == {"env": spec.env} and spec.env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]  # heartbeats
        if spec.concurrency_limit:
            assert d["global_concurrency_limit"]["limit"] == spec.concurrency_limit


def test_rerun_and_resume_deploy(prefect_stack):
    missing = [n for n in ("rerun", "resume") if n in prefect_stack.not_deployed]
    if missing:
        pytest.skip(
            f"entrypoint files of {', '.join(missing)} are not in the tree yet (flows/rerun.py, flows/resume.py)"
        )
    for name in ("rerun", "resume"):
        d = prefect_stack.deployments[name]
        schema = d["parameter_openapi_schema"]
        assert schema["properties"]["run_id"]["type"] == "string", dumps(schema)
        assert "run_id" in schema.get("required", []), f"{name}: run_id must be asked for"
        assert d["work_pool_name"] == POOL and d["enforce_parameter_schema"] is True


@pytest.mark.parametrize("name, local_hour", [("nightly-train", 1)])
def test_server_schedules_nightly_runs_in_the_declared_timezone(prefect_stack, name, local_hour):
    """The server itself expands the cron: in winter and in summer (DST) the runs start at the same Berlin hour,
    i.e. at different UTC hours. The runs are far in the future (no worker takes them) and deleted afterwards."""
    stack = prefect_stack
    dep = stack.deployments[name]
    tz = ZoneInfo(dep["schedules"][0]["schedule"]["timezone"])
    year = datetime.now(timezone.utc).year + 1
    utc_hours = set()
    for month in (1, 7):
        start = datetime(year, month, 10, tzinfo=timezone.utc)
        r = stack.post(
            f"/deployments/{dep['id']}/schedule",
            {"start_time": start.isoformat(), "end_time": (start + timedelta(days=2)).isoformat()},
        )
        assert r.status_code in (200, 201), r.text
        runs = [
            fr
            for fr in stack.flow_runs(name)
            if start <= datetime.fromisoformat(fr["expected_start_time"]) < start + timedelta(days=2)
        ]
        assert len(runs) == 2, dumps(runs)
        for fr in runs:
            t = datetime.fromisoformat(fr["expected_start_time"])
            local = t.astimezone(tz)
            assert (local.hour, local.minute) == (local_hour, 0), f"{name}: {t} is {local} in {tz}"
            assert fr["state_type"] == "SCHEDULED" and fr["parameters"] == dep["parameters"]
            utc_hours.add(t.hour)
            assert stack.delete(f"/flow_runs/{fr['id']}").status_code in (200, 204)
    assert len(utc_hours) == 2, f"{name}: the same UTC hour in winter and summer ({utc_hours}): timezone ignored?"


def _leaves(schema: dict, node: dict, path: str = ""):
    """(dotted path, property schema) of every non-object field of a parameter schema, following $ref."""
    if "$ref" in node:
        node = {
            **schema["definitions"][node["$ref"].rsplit("/", 1)[1]],
            **{k: v for k, v in node.items() if k != "$ref"},
        }
    if node.get("type") == "object" and "properties" in node:
        for k, v in node["properties"].items():
            yield from _leaves(schema, v, f"{path}.{k}" if path else k)
    elif "discriminator" in node:  # a section with variants (`engine`): each variant's fields
        for variant in node["anyOf"]:
            yield from _leaves(schema, variant, path)
    else:
        yield path, node


def test_parameter_schema_is_a_typed_form(prefect_stack):
    """What the UI builds its form from: every field has a description and a default, choices are enums."""
    stack = prefect_stack
    schema = stack.deployments["manual-train"]["parameter_openapi_schema"]
    assert schema["definitions"]["RunConfig"]["description"], "the `config` parameter has no description"
    leaves = dict(_leaves(schema, schema["properties"]["config"], "config"))
    assert len(leaves) >= 50, sorted(leaves)
    no_doc = [p for p, s in leaves.items() if not s.get("description")]
    assert not no_doc, f"fields without a description in the form: {no_doc}"
    no_default = [
        p
        for p, s in leaves.items()
        if "default" not in s
        and "const" not in s  # the backend a variant is
        and p not in ("config.engine.sglang.args", "config.engine.vllm.args", "config.rollout.sandbox.kwargs")
        and p not in ("config.engine.url", "config.engine.sglang.python", "config.engine.vllm.python")  # required
    ]  # default_factory lists/dicts render as empty
    assert not no_default, f"fields without a default in the form: {no_default}"
    engine = schema["definitions"]["RunConfig"]["properties"]["engine"]
    assert sorted(engine["discriminator"]["mapping"]) == ["embedded", "sglang", "sglang-launch", "vllm", "vllm-launch"]
    rollout = schema["definitions"]["RolloutConfig"]["properties"]
    assert sorted(rollout["harness"]["discriminator"]["mapping"]) == ["claude-code", "opencode", "shell", "terminus-2"]
    sandboxes = rollout["sandbox"]["discriminator"]["mapping"]  # `local`, and each Harbor environment
    assert sandboxes["e2b"] == sandboxes["modal"] != sandboxes["local"], sandboxes
    local = schema["definitions"][sandboxes["local"].rsplit("/", 1)[1]]["properties"]["backend"]
    assert local["default"] == "local"
    assert "e2b" in leaves["config.rollout.sandbox.backend"]["enum"]  # the Harbor type's choice
    assert leaves["config.train.loss.loss_aggregation"]["enum"] == ["token", "sample"]
    assert leaves["config.rollout.sampling.temperature"]["maximum"] == 2.0
    ev = stack.deployments["nightly-evaluate"]["parameter_openapi_schema"]["properties"]["split"]
    assert ev["enum"] == ["eval", "train", "all"] and ev["default"] == "eval" and ev["description"]


BAD_CONFIGS = [
    ({"rollout": {"sampling": {"temperature": 5}}}, "config.rollout.sampling.temperature"),
    ({"engine": {"backend": "tgi"}}, "config.engine"),  # Prefect: "{'backend': 'tgi'} is not valid under any"
    ({"rollout": {"sandbox": {"backend": "my-laptop"}}}, "config.rollout.sandbox"),  # as `engine`'s
    ({"rollout": {"harness": {"name": "shell", "summarize": True}}}, "config.rollout.harness"),  # terminus-2's
    ({"run_id": "Not A Valid Id"}, "config.run_id"),
    ({"train": {"steps": "many"}}, "config.train.steps"),
    ({"train": {"stepz": 3}}, "config.train"),  # a typo is refused, not ignored
]


def test_invalid_parameters_are_refused_before_a_run_exists(prefect_stack, tmp_path):
    stack = prefect_stack
    dep_id = stack.deployments["manual-train"]["id"]
    before = {fr["id"] for fr in stack.flow_runs("manual-train")}
    for bad, field in BAD_CONFIGS:
        cfg = {**tiny_config("never-runs", tmp_path / "runs", tmp_path / "no-model"), **bad}
        r = stack.post(f"/deployments/{dep_id}/create_flow_run", {"parameters": {"config": cfg}})
        assert r.status_code == 409, f"{bad}: {r.status_code} {r.text}"
        assert f"'{field}'" in r.json()["detail"], r.text
    # (Not covered: an unknown top-level parameter *name*. Prefect's generated schema allows extra top-level keys,
    # so the API creates that run and the flow engine refuses it at start. The UI form cannot produce one.)
    ev_id = stack.deployments["nightly-evaluate"]["id"]
    r = stack.post(f"/deployments/{ev_id}/create_flow_run", {"parameters": {"split": "test"}})
    assert r.status_code == 409 and "'split'" in r.json()["detail"], r.text
    after = {fr["id"] for fr in stack.flow_runs("manual-train")}
    assert after == before, f"refused parameters still created flow runs: {after - before}"
    assert not (tmp_path / "runs").exists()


def test_manual_train_run_through_the_api(prefect_stack, finished_run):
    stack, fr, cfg = prefect_stack, finished_run["flow_run"], finished_run["config"]
    assert fr["name"] == f"train-{cfg['run_id']}" and fr["deployment_id"] == stack.deployments["manual-train"]["id"]
    assert fr["parameters"]["config"] == cfg
    arts = artifacts_of(stack, fr["id"])
    rid = cfg["run_id"]
    assert {f"{rid}-summary", f"{rid}-steps", f"{rid}-run-dir", f"{rid}-step-0-trials"} <= set(arts), sorted(arts)
    steps = arts[f"{rid}-steps"]["data"]
    steps = json.loads(steps) if isinstance(steps, str) else steps
    assert [row["step"] for row in steps] == [0]
    assert str(finished_run["run_dir"]) in arts[f"{rid}-run-dir"]["data"]
    run_dir = finished_run["run_dir"]
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1
    assert (run_dir / "checkpoints" / "step_0").is_dir()
    assert json.loads((run_dir / "config.json").read_text())["run_id"] == rid


def test_nightly_evaluate_run_through_the_api(prefect_stack, tiny_model_dir):
    """The nightly evaluation, triggered now with the tiny model in place of its nightly parameters."""
    stack = prefect_stack
    cfg = tiny_config("deployed-eval", stack.tmp / "runs", tiny_model_dir)
    r = stack.post(
        f"/deployments/{stack.deployments['nightly-evaluate']['id']}/create_flow_run",
        {"parameters": {"config": cfg, "split": "eval"}},
    )
    assert r.status_code == 201, r.text
    fr = stack.wait_final(r.json()["id"])
    assert fr["state_type"] == "COMPLETED", (stack.tmp / "worker.log").read_text(errors="replace")[-5000:]
    assert fr["name"] == "evaluate-deployed-eval"
    assert "deployed-eval-evaluation" in artifacts_of(stack, fr["id"])
    assert (stack.tmp / "runs" / "deployed-eval" / "metrics.jsonl").read_text().count("\n") == 1


def test_two_nights_train_then_evaluate_by_event(prefect_stack, tiny_model_dir, capsys):
    """Two nights: nightly-train runs (a tiny config in place of its nightly one) and completes; each run's
    `grpoflow.run.completed` event makes the server start nightly-evaluate on that run's final checkpoint, whose
    run.json links back to it. Then the morning report: each night's ledger balances, `grpoflow tasks` shows both
    nights per task, and each night left its trajectory viewer."""
    stack = prefect_stack
    ev = stack.deployments["nightly-evaluate"]
    runs = stack.tmp / "nights"
    eval_config = {
        **tiny_config("", runs, tiny_model_dir),
        "run_id": None,
        "train": {"eval": {"samples_per_prompt": 0}},
    }
    r = stack.request("PATCH", f"/deployments/{ev['id']}", {"parameters": {"config": eval_config, "split": "all"}})
    assert r.status_code == 204, r.text
    try:
        for night in ("night-1", "night-2"):
            before = {fr["id"] for fr in stack.flow_runs("nightly-evaluate")}
            cfg = tiny_config(night, runs, tiny_model_dir)
            r = stack.post(
                f"/deployments/{stack.deployments['nightly-train']['id']}/create_flow_run",
                {"parameters": {"config": cfg}},
            )
            assert r.status_code == 201, r.text
            train = stack.wait_final(r.json()["id"])
            assert train["state_type"] == "COMPLETED", (stack.tmp / "worker.log").read_text(errors="replace")[-5000:]
            deadline = time.monotonic() + 120
            while not (new := [fr for fr in stack.flow_runs("nightly-evaluate") if fr["id"] not in before]):
                assert time.monotonic() < deadline, f"no nightly-evaluate run followed {night}'s completed event"
                time.sleep(1)
            (triggered,) = new
            assert triggered["parameters"]["from_run"] == str((runs / night).resolve())
            done = stack.wait_final(triggered["id"])
            assert done["state_type"] == "COMPLETED", (stack.tmp / "worker.log").read_text(errors="replace")[-5000:]
    finally:
        stack.request("PATCH", f"/deployments/{ev['id']}", {"parameters": ev["parameters"]})
    infos = [json.loads(p.read_text()) for p in runs.glob("*/run.json")]
    parents = sorted(i["parent"]["run_id"] for i in infos if i["flow"] == "evaluate")
    assert parents == ["night-1", "night-2"]  # each night evaluated once, on its own checkpoint
    assert {i["deployment"]["name"] for i in infos} == {"nightly-train", "nightly-evaluate"}  # who started each run
    for night in ("night-1", "night-2"):
        rows = read_step_records(runs / night / "metrics.jsonl")
        assert rows and all(unaccounted(r) == 0 and r["ledger/generated"] > 0 for r in training_rows(rows))
        assert (runs / night / "viewer.html").is_file()  # rendered in Chromium by tests/integration/flows
        regrades = read_regrades(runs / night)  # one stored trial per task graded again by Harbor
        assert regrades and all(r.error is None and not r.differs for r in regrades)
    capsys.readouterr()
    assert cli_main(["tasks", "--output-dir", str(runs)]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| task |"))
    assert "| night-1 |" in header and "| night-2 |" in header and "| regrades differing |" in header
