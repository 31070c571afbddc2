"""One rollout step end to end, without Prefect: plan the GRPO groups, run the trials, score them, write traces.

`collect_step` is what the train and evaluate flows call (through a thin Prefect task) once per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor.models.environment_type import EnvironmentType
from harbor.models.trial.config import AgentConfig, EnvironmentConfig

from grpoflow.config import EngineConfig, RolloutConfig
from grpoflow.evaluate import step_metrics, to_sample
from grpoflow.fileio import write_jsonl_atomic
from grpoflow.prompts import PromptRecord
from grpoflow.rollout import (
    LOCAL_SANDBOX,
    Attempt,
    SandboxGate,
    TrialOutcome,
    TrialSpec,
    plan_group_trials,
    run_trials,
)
from grpoflow.samples import Sample

SHELL_AGENT = "grpoflow.agents.shell:ShellAgent"


@dataclass
class StepRollout:
    samples: list[Sample]
    metrics: dict[str, float]
    details_path: Path


def shell_agent_factory(
    rollout: RolloutConfig, engine: EngineConfig, engine_url: str, tokenizer_path: str
) -> Callable[[TrialSpec], AgentConfig]:
    def make(spec: TrialSpec) -> AgentConfig:
        return AgentConfig(
            import_path=SHELL_AGENT,
            kwargs={
                "engine_url": engine_url,
                "tokenizer_path": tokenizer_path,
                "max_turns": rollout.max_turns,
                "max_new_tokens": rollout.max_new_tokens,
                "max_context_tokens": rollout.max_context_tokens,
                "temperature": rollout.temperature,
                "top_p": rollout.top_p,
                "top_k": rollout.top_k,
                "seed": spec.seed,
                "command_timeout_sec": rollout.command_timeout_sec,
                "output_cap_chars": rollout.output_cap_chars,
                "early_truncation_exit": rollout.early_truncation_exit,
                "request_timeout_s": engine.request_timeout_s,
                "engine_retries": engine.retries,
            },
        )

    return make


def sandbox_config(rollout: RolloutConfig, **kwargs: Any) -> EnvironmentConfig:
    """Harbor's environment for `rollout.sandbox`: our bubblewrap `LocalSandbox`, or a Harbor environment type
    passed straight through. `rollout.sandbox_kwargs` then `kwargs` (which win) go to its constructor.

    No credentials here: Harbor writes this config into every trial dir. A provider's key reaches its SDK through
    the process environment (`grpoflow.credentials.export_sandbox_key`).
    """
    merged = {**rollout.sandbox_kwargs, **kwargs}
    if rollout.sandbox == "local":
        return EnvironmentConfig(import_path=LOCAL_SANDBOX, kwargs=merged)
    return EnvironmentConfig(type=EnvironmentType(rollout.sandbox), kwargs=merged)


async def collect_step(
    run_id: str,
    step: int,
    prompts: Sequence[PromptRecord],
    rollout: RolloutConfig,
    seed: int,
    make_agent: Callable[[TrialSpec], AgentConfig],
    environment: EnvironmentConfig,
    trials_dir: Path,
    details_dir: Path,
    on_done: Callable[[TrialOutcome], Any] | None = None,
    on_retry: Callable[[TrialSpec, Attempt], None] | None = None,
    sandbox_gate: SandboxGate | None = None,
) -> StepRollout:
    specs = plan_group_trials(prompts, step, rollout.n_samples_per_prompt, seed)
    t0 = time.perf_counter()
    outcomes = await run_trials(
        specs, make_agent, environment, trials_dir, concurrency=rollout.concurrency,
        retries=rollout.sandbox_retries, backoff_s=rollout.retry_backoff_s, on_done=on_done, on_retry=on_retry,
        sandbox_gate=sandbox_gate,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    samples = [to_sample(o, run_id, step) for o in outcomes]
    details = details_dir / "samples.jsonl"
    write_jsonl_atomic(details, (s.model_dump(mode="json") for s in samples))
    return StepRollout(samples, step_metrics(samples, wall), details)


def select_step_prompts(prompts: Sequence[PromptRecord], step: int, per_step: int, split: str = "train") -> list[PromptRecord]:
    """Prompts of one training step: walk the split's (already seed-shuffled) order cyclically."""
    pool = [p for p in prompts if p.split == split]
    if not pool:
        raise ValueError(f"no prompts in split `{split}`")
    start = (step * per_step) % len(pool)
    return [pool[(start + i) % len(pool)] for i in range(min(per_step, len(pool)))]
