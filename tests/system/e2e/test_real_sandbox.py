"""End to end on a real cloud sandbox: preflight -> prepare -> a rollout-only step -> at least one verified trial.

The oracle agent runs each task's own solution, so no engine or GPU is involved: what is tested is the sandbox
path (credentials, Harbor's environment, the provider's API, the verifier's reward coming back).

Skipped unless both are set:

    GRPOFLOW_E2E_SANDBOX   the Harbor environment type to test, e.g. `e2b`
    its key variable       e.g. `E2B_API_KEY` for e2b; or GRPOFLOW_E2E_KEY_FILE, a file holding the key (it is
                           passed as rollout.sandbox.api_key_file, which is the path production runs can use)

Optional: GRPOFLOW_E2E_TASKS, comma-separated built-in tasks (default `hello-file,answer-42`); the provider's own
settings (e.g. E2B_DOMAIN or E2B_API_URL for a self-hosted E2B). Run:

    GRPOFLOW_E2E_SANDBOX=e2b E2B_API_KEY=e2b_... .venv/bin/python -m pytest -q tests/system/e2e -rs

Every invocation makes a new run dir (run_id `e2e-<sandbox>-<timestamp>-<hash>`; runs are never overwritten), so
trials from an earlier run cannot make this one pass. The first e2b run builds a template from the task's
Dockerfile, which takes a few minutes; later runs reuse it.
"""

import asyncio
import json
import os

import pytest
from harbor.models.trial.config import AgentConfig

from grpoflow.config import parse_run_config
from grpoflow.credentials import export_sandbox_key, sandbox_key_var
from grpoflow.paths import new_run_id
from grpoflow.preflight import check_run, format_problems
from grpoflow.prepare.prompts import load_prompts
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials

SANDBOX = os.environ.get("GRPOFLOW_E2E_SANDBOX", "").strip()
KEY_VAR = sandbox_key_var(SANDBOX) if SANDBOX else None
KEY_FILE = os.environ.get("GRPOFLOW_E2E_KEY_FILE", "").strip() or None
TASKS = [t.strip() for t in os.environ.get("GRPOFLOW_E2E_TASKS", "hello-file,answer-42").split(",") if t.strip()]


def _skip_reason() -> str | None:
    if not SANDBOX:
        return "set GRPOFLOW_E2E_SANDBOX (e.g. e2b) and its key variable to run the real-sandbox check"
    if KEY_VAR is None:
        return f"GRPOFLOW_E2E_SANDBOX={SANDBOX}: grpoflow knows no key variable for it (see grpoflow.credentials)"
    if not (os.environ.get(KEY_VAR, "").strip() or KEY_FILE):
        return f"set {KEY_VAR} (or GRPOFLOW_E2E_KEY_FILE) to run the real-sandbox check on {SANDBOX}"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]


@pytest.fixture(scope="module")
def prefect_server():
    from tests.fakes.prefect_server import temporary_prefect_server

    with temporary_prefect_server():
        yield


def test_oracle_trials_on_the_real_sandbox_are_verified(prefect_server, tmp_path, tiny_model_dir):
    from flows.prepare import prepare_flow

    rollout = {
        "sandbox": SANDBOX,
        "n_samples_per_prompt": 1,
        "concurrency": 2,
        "sandbox_retries": 2,
        "retry_backoff_s": 2.0,
    }
    if KEY_FILE:
        rollout["sandbox_api_key_file"] = KEY_FILE
    cfg = parse_run_config(
        {
            "run_id": f"e2e-{SANDBOX}-{new_run_id()}",
            "output_dir": str(tmp_path / "runs"),
            "model": {"source": str(tiny_model_dir)},
            "dataset": {"path": "builtin-fixed"},
            "rollout": rollout,
        }
    )

    # 1. preflight: the checks a train run makes first (key, API reachable, Harbor's environment).
    problems = check_run(cfg, "train")
    assert not problems, format_problems(problems)

    # 2. prepare: a fresh run dir for this run_id, with no trials in it yet.
    run = prepare_flow(cfg)
    trials_dir = run.paths.trials(0)
    assert run.paths.root.name == cfg.run_id and not trials_dir.exists()
    prompts = [p for p in load_prompts(run.paths.prompts) if p.instance_id in TASKS]
    assert {p.instance_id for p in prompts} == set(TASKS), f"built-in tasks not found: {TASKS}"

    # 3. a rollout-only step on the real sandbox (the key reaches the provider through the process environment).
    export_sandbox_key(cfg.rollout.sandbox.backend, cfg.rollout.sandbox.api_key_file)
    step = asyncio.run(
        collect_step(
            cfg.run_id,
            0,
            plan_group_trials(prompts, 0, cfg.rollout.n_samples_per_prompt, cfg.seed),
            cfg.rollout,
            PolicyAccess(lambda spec: AgentConfig(name="oracle")),
            sandbox_config(cfg.rollout),
            trials_dir,
            run.paths.details(0),
        )
    )

    # 4. at least one trial of this run finished without an exception and with the verifier's reward.
    results = [json.loads(p.read_text()) for p in trials_dir.glob("*/result.json")]
    verified = [
        r for r in results if r.get("exception_info") is None and (r.get("verifier_result") or {}).get("rewards")
    ]
    summary = [(s.instance_id, s.exit_status, s.reward, s.exit_reason) for s in step.samples]
    assert verified, f"no verified trial on {SANDBOX}: {summary}"
    assert any(s.status == "COMPLETED" and s.reward is not None for s in step.samples), summary
    key = os.environ.get(KEY_VAR or "", "")
    if key:
        leaked = [str(p) for p in run.paths.root.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
        assert leaked == [], f"the sandbox key was written to {leaked}"
