"""One rollout step through the run's real path (`policy_access` then `collect_step`), for tests that bring
their own engine."""

import asyncio
from pathlib import Path

from grpoflow.config import RunConfig
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.policy import policy_access
from grpoflow.rollout.step import StepRollout, collect_step, sandbox_config


def run_step(
    cfg: RunConfig, engine_url: str, tokenizer_path: str, prompts: list[PromptRecord], out: Path
) -> StepRollout:
    """Step 0 of `cfg.rollout` on `prompts` against the engine at `engine_url`; trials and details under `out`."""

    async def step() -> StepRollout:
        async with policy_access(cfg.rollout, cfg.engine, engine_url, tokenizer_path) as policy:
            return await collect_step(
                "t",
                0,
                prompts,
                cfg.rollout,
                0,
                policy,
                sandbox_config(cfg.rollout, **policy.sandbox_kwargs),
                out / "trials",
                out / "details",
            )

    return asyncio.run(step())
