"""The one-process route: `python -m flows.serve` serves the deployments of deployments/prefect.yaml, with the same
names, schedules and parameters as `prefect deploy --all`, and runs a triggered flow run itself (no worker).

Runs after the API and browser tests (file order): it deletes two deployments of the shared server and serves them
instead. (Served over a deployed one, a deployment would keep its work pool and the worker could take its runs: the
two routes are alternatives on one server.)"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from flows.serve import ROOT, build_deployments, main, read_specs
from grpoflow.errors import GrpoflowError
from tests.system.deployments.conftest import artifacts_of, stop_tree, tiny_config

pytestmark = pytest.mark.slow


def _present(specs):
    return [s for s in specs if s.entrypoint_file.is_file()]


def test_serve_builds_what_the_yaml_declares(monkeypatch):
    monkeypatch.chdir(ROOT)
    specs = _present(read_specs())
    for spec, dep in zip(specs, build_deployments(specs), strict=True):
        assert (dep.name, dep.entrypoint, dep.description) == (spec.name, spec.entrypoint, spec.description)
        assert dep.parameters == spec.parameters and sorted(dep.tags) == sorted(spec.tags)
        assert dep.enforce_parameter_schema is True and dep.work_pool_name is None
        got = [(s.schedule.cron, s.schedule.timezone, s.active) for s in dep.schedules]
        assert got == [(c.cron, c.timezone, c.active) for c in spec.schedules]
        assert [(t.expect, t.parameters) for t in dep.triggers] == [
            (set(t["expect"]), t["parameters"]) for t in spec.triggers
        ]
        assert dep._parameter_openapi_schema.properties, spec.name


def test_serve_bad_input_is_one_line(tmp_path, capsys):
    bad = tmp_path / "prefect.yaml"
    bad.write_text("deployments:\n  - name: x\n    entrypoint: flows/nope.py:f\n")
    with pytest.raises(GrpoflowError, match="entrypoint file missing for x"):
        build_deployments(read_specs(bad))
    assert main(["--file", str(bad), "--only", "y"]) == 2
    assert "--only y: not in" in capsys.readouterr().err
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "nightly-train" in listed and "0 1 * * * Europe/Berlin" in listed


def test_served_deployment_runs_a_triggered_flow(prefect_stack, tiny_model_dir):
    stack = prefect_stack
    for name in ("manual-train", "nightly-train"):
        assert stack.delete(f"/deployments/{stack.deployments[name]['id']}").status_code in (200, 204)
    log = open(stack.tmp / "serve.log", "ab")
    # Started outside the repository: serve changes into it, as the worker's pull step does.
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.serve", "--only", "manual-train", "--only", "nightly-train"],
        cwd=stack.tmp,
        env={**stack.env, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        t0 = time.monotonic()
        served = None
        while served is None:
            assert proc.poll() is None, (stack.tmp / "serve.log").read_text()[-3000:]
            assert time.monotonic() - t0 < 120, "serve did not register its deployments in 120 s"
            deps = {d["name"]: d for d in stack.post("/deployments/filter").json()}
            if {"manual-train", "nightly-train"} <= set(deps):
                served = deps
                assert served["manual-train"]["work_pool_name"] is None  # the runner itself runs them
            time.sleep(0.5)
        nightly = served["nightly-train"]
        assert [(s["schedule"]["cron"], s["schedule"]["timezone"]) for s in nightly["schedules"]] == [
            ("0 1 * * *", "Europe/Berlin")
        ]
        assert nightly["parameters"] == stack.deployments["nightly-train"]["parameters"]
        assert served["manual-train"]["enforce_parameter_schema"] is True
        cfg = tiny_config("served-tiny", stack.tmp / "runs", tiny_model_dir)
        bad = stack.post(
            f"/deployments/{served['manual-train']['id']}/create_flow_run",
            {"parameters": {"config": {**cfg, "seed": -1}}},
        )
        assert bad.status_code == 409 and "'config.seed'" in bad.text, bad.text
        r = stack.post(f"/deployments/{served['manual-train']['id']}/create_flow_run", {"parameters": {"config": cfg}})
        assert r.status_code == 201, r.text
        fr = stack.wait_final(r.json()["id"])
        assert fr["state_type"] == "COMPLETED", (stack.tmp / "serve.log").read_text()[-5000:]
        assert "served-tiny-summary" in artifacts_of(stack, fr["id"])
        assert (stack.tmp / "runs" / "served-tiny" / "metrics.jsonl").is_file()
        print(f"serve: registered in {time.monotonic() - t0:.1f}s incl. a completed run")
    finally:
        stop_tree(proc)  # a Ctrl-C: the runner stops and pauses its schedules
        log.close()
