"""A misbehaving engine. The client against the SGLang stand-in: `EngineError`, one line naming the endpoint (or
the URL once retries run out). The shell agent in real Harbor trials against such an engine: each trial is FAILED
with reward None (never 0) and its group dropped; an engine that answers nonsense is the agent's error (AgentError,
not retried), one that does not answer is infrastructure (EngineError, run again in a fresh sandbox first)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from grpoflow.config import parse_run_config
from grpoflow.engine.client import SglangClient
from grpoflow.errors import EngineError
from grpoflow.prepare.dataset import builtin_dataset_path, load_task
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.harnesses import agent_factory
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials
from grpoflow.samples import select_trainable

# tests/integration/engine is not a package: its modules import each other by bare name, as pytest's rootdir insertion lets
# them; do the same (the stand-in imports SGLang's field lists from test_sglang_contract).
from tests.fakes.sglang_standin import StandinServer

from .conftest import assert_one_line

FAULTS = {
    # fault kind -> what the one-line error names
    "malformed_json": ["/generate", "malformed response"],
    "missing_finish_reason": ["/generate", "finish_reason"],
    "5xx": ["POST", "/generate", "failed after 2 attempts", "HTTP 503"],
    "drop": ["POST", "/generate", "failed after 2 attempts"],
}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_client_raises_one_line_naming_the_endpoint(tiny_model_dir, kind):
    with StandinServer(str(tiny_model_dir)) as server:
        server.faults.inject(kind, times=None)
        client = SglangClient(server.url, timeout=5.0, retries=1, backoff_s=0.01)
        with pytest.raises(EngineError) as info:
            client.generate([1, 2, 3])
        client.close()
    names = FAULTS[kind] + ([server.url] if kind in ("5xx", "drop") else [])
    assert_one_line(info.value, *names)


def test_client_error_on_model_info_names_that_endpoint(tiny_model_dir):
    with StandinServer(str(tiny_model_dir)) as server:
        server.faults.inject("malformed_json", times=None, path="/model_info")
        with pytest.raises(EngineError) as info, SglangClient(server.url, retries=0) as client:
            client.model_info()
    assert_one_line(info.value, "/model_info", "malformed response")


@pytest.fixture(scope="module")
def agent_trials(tmp_path_factory, tiny_model_dir):
    """One trial per fault kind (each against its own stand-in), plus a healthy engine as the control."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    root = tmp_path_factory.mktemp("engine-faults")
    task = load_task(builtin_dataset_path() / "hello-file")
    servers = {}
    for kind in [*FAULTS, "healthy"]:
        servers[kind] = StandinServer(str(tiny_model_dir)).start()
        if kind != "healthy":
            servers[kind].faults.inject(kind, times=None)
    prompts = [PromptRecord(instance_id=k, task_path=str(task.path), instruction=task.instruction) for k in servers]
    cfg = parse_run_config(
        {
            "engine": {"retries": 1, "request_timeout_s": 10, "outage_wait_s": 0},
            "rollout": {
                "n_samples_per_prompt": 1,
                "concurrency": 8,
                "episode": {"max_turns": 2},
                "sandbox": {"retries": 2, "retry_backoff_s": 0.0},
            },
        }
    )
    factories = {k: agent_factory(cfg.rollout, cfg.engine, s.url, str(tiny_model_dir)) for k, s in servers.items()}
    try:
        res = asyncio.run(
            collect_step(
                "bad",
                0,
                plan_group_trials(prompts, 0, cfg.rollout.n_samples_per_prompt, 0),
                cfg.rollout,
                PolicyAccess(lambda spec: factories[spec.instance_id](spec)),
                sandbox_config(cfg.rollout),
                root / "trials",
                root / "details",
            )
        )
    finally:
        for s in servers.values():
            s.stop()
    return {s.instance_id: s for s in res.samples}, res


UNAVAILABLE = {"5xx", "drop"}  # the engine did not answer: infrastructure


@pytest.mark.parametrize("kind", list(FAULTS))
def test_engine_fault_in_a_trial_fails_it_with_no_reward_and_names_why(agent_trials, kind):
    samples, _ = agent_trials
    s = samples[kind]
    assert s.reward is None, f"{kind}: scored {s.reward!r} ({s.exit_status}: {s.exit_reason})"
    status = "EngineError" if kind in UNAVAILABLE else "AgentError"
    assert (s.status, s.exit_status) == ("FAILED", status), (s.status, s.exit_status, s.exit_reason)
    error = "EngineUnavailableError: " if kind in UNAVAILABLE else "EngineError: "
    assert s.exit_reason.startswith(error) and "/generate" in s.exit_reason and "\n" not in s.exit_reason
    assert s.metrics["retries"] == (2 if kind in UNAVAILABLE else 0)  # rollout.sandbox.retries for infrastructure


def test_healthy_engine_trial_is_scored_and_faulty_groups_dropped(agent_trials):
    samples, res = agent_trials
    healthy = samples["healthy"]
    assert healthy.status in ("COMPLETED", "TRUNCATED") and healthy.reward is not None
    kept, dropped = select_trainable(list(samples.values()), "drop_group")
    assert [s.instance_id for s in kept] == ["healthy"] and dropped == len(FAULTS)
    assert (
        res.figures.computed["exit/AgentError"] + res.figures.computed["exit/EngineError"] == len(FAULTS)
        and res.figures.computed["scored"] == 1
    )


@pytest.mark.parametrize("fault", ["5xx", "slow"])
def test_an_outage_outlasting_the_agent_time_limit_is_the_engine_s_not_a_scored_episode(
    tmp_path, tiny_model_dir, fault
):
    """The engine is down (5xx), or hung with its connections open (`slow`: no answer within the task's time,
    though the generation's own timeout is longer), for longer than the task gives its agent: Harbor cuts the
    agent off (AgentTimeoutError) and still verifies, but that reward would score an episode the policy never
    played. It is an engine outage: FAILED EngineError, no reward, run again in a fresh sandbox."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    task_dir = tmp_path / "tasks" / "hello-file"
    shutil.copytree(builtin_dataset_path() / "hello-file", task_dir)
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text().replace("[agent]\ntimeout_sec = 120.0", "[agent]\ntimeout_sec = 3.0"))
    task = load_task(task_dir)
    assert task.agent_timeout_sec == 3.0
    cfg = parse_run_config(
        {
            "engine": {"retries": 1, "request_timeout_s": 1 if fault == "slow" else 10, "outage_wait_s": 600},
            "rollout": {
                "n_samples_per_prompt": 1,
                "episode": {"max_turns": 2},
                "sandbox": {"retries": 1, "retry_backoff_s": 0.0},
            },
        }
    )
    prompt = PromptRecord(instance_id="down", task_path=str(task.path), instruction=task.instruction)
    with StandinServer(str(tiny_model_dir)) as server:
        server.faults.inject(fault, times=None, delay_s=30.0)
        factory = agent_factory(cfg.rollout, cfg.engine, server.url, str(tiny_model_dir))
        res = asyncio.run(
            collect_step(
                "down",
                0,
                plan_group_trials([prompt], 0, 1, 0),
                cfg.rollout,
                PolicyAccess(factory),
                sandbox_config(cfg.rollout),
                tmp_path / "trials",
                tmp_path / "details",
            )
        )
    [s] = res.samples
    assert (s.status, s.exit_status, s.reward) == ("FAILED", "EngineError", None), s.exit_reason
    assert s.exit_reason.startswith("AgentTimeoutError") and s.metrics["retries"] == 1
