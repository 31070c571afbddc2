"""Shared pieces of the fault tests: built-in prompts, a one-step collect through the shell agent, the stand-in."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from grpoflow.config import parse_run_config
from grpoflow.prepare.dataset import builtin_dataset_path, load_task
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.harnesses import agent_factory
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials


def prompt(name_or_path) -> PromptRecord:
    path = Path(name_or_path) if Path(str(name_or_path)).is_absolute() else builtin_dataset_path() / name_or_path
    t = load_task(path)
    return PromptRecord(instance_id=path.name, task_path=str(t.path), instruction=t.instruction)


def collect(tmp_path, engine_url, tiny_model_dir, prompts, engine=None, **rollout):
    """One rollout step of the shell agent against `engine_url` (no Prefect); returns (StepRollout, retried ids)."""
    cfg = parse_run_config(
        {
            "rollout": {
                "n_samples_per_prompt": 1,
                "max_turns": 3,
                **rollout,
                "sandbox": {"retry_backoff_s": 0.0, **rollout.get("sandbox", {})},
            },
            "engine": {"backend": "sglang", "url": engine_url, **(engine or {})},
        }
    )
    retried: list[str] = []
    make_agent = agent_factory(cfg.rollout, cfg.engine, engine_url, str(tiny_model_dir))
    res = asyncio.run(
        collect_step(
            "faults",
            0,
            plan_group_trials(prompts, 0, cfg.rollout.n_samples_per_prompt, 0),
            cfg.rollout,
            PolicyAccess(make_agent),
            sandbox_config(cfg.rollout),
            tmp_path / "trials",
            tmp_path / "details",
            on_retry=lambda spec, att: retried.append(spec.rollout_id),
        )
    )
    return res, retried


def accounted(res, n_trials: int) -> None:
    """Every trial is a sample on disk, each with a reward or a FAILED status that names why (never a silent 0)."""
    lines = [json.loads(x) for x in res.details_path.read_text().splitlines()]
    assert len(res.samples) == len(lines) == n_trials
    for s in lines:
        assert s["exit_status"] in {
            "Submitted",
            "TimeLimitExceeded",
            "SequenceLengthLimitExceeded",
            "AgentError",
            "SandboxError",
            "EngineError",
            "VerifierError",
        }
        if s["status"] == "FAILED":
            assert s["reward"] is None and s["exit_reason"]
        else:
            assert s["reward"] is not None


def load_standin():
    from tests.fakes.sglang_standin import StandinServer

    return StandinServer
