"""One rollout step through the run's real path (`policy_access` then `collect_step`), for tests that bring
their own engine; `scripted_task_step` brings a scripted one and a built-in task."""

import asyncio
from pathlib import Path

from grpoflow.config import RunConfig, parse_run_config
from grpoflow.prepare.dataset import builtin_dataset_path, load_task
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.policy import policy_access
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import StepRollout, collect_step
from grpoflow.rollout.trials import plan_group_trials
from tests.fakes.scripted_engine import ScriptedEngine


def run_step(
    cfg: RunConfig, engine_url: str, tokenizer_path: str, prompts: list[PromptRecord], out: Path
) -> StepRollout:
    """Step 0 of `cfg.rollout` on `prompts` against the engine at `engine_url`; trials and details under `out`."""

    async def step() -> StepRollout:
        async with policy_access(cfg.rollout, cfg.engine, engine_url, tokenizer_path) as policy:
            return await collect_step(
                "t",
                0,
                plan_group_trials(prompts, 0, cfg.rollout.n_samples_per_prompt, 0),
                cfg.rollout,
                policy,
                sandbox_config(cfg.rollout, **policy.sandbox_kwargs),
                out / "trials",
                out / "details",
            )

    return asyncio.run(step())


def scripted_task_step(
    model_dir: str, script, rollout: dict, out: Path, task: str = "hello-file"
) -> tuple[StepRollout, ScriptedEngine]:
    """Step 0 of the built-in `task`'s trials under `rollout` (over one trial, 4 turns of at most 400 tokens)
    against a scripted `/generate` (`ScriptedEngine(model_dir, script)`); returns the step and the engine."""
    t = load_task(builtin_dataset_path() / task)
    prompts = [PromptRecord(instance_id=task, task_path=str(t.path), instruction=t.instruction)]
    cfg = parse_run_config({"rollout": {"n_samples_per_prompt": 1, "max_turns": 4, "max_new_tokens": 400, **rollout}})
    engine = ScriptedEngine(str(model_dir), script)
    try:
        return run_step(cfg, engine.url, str(model_dir), prompts, out), engine
    finally:
        engine.stop()
