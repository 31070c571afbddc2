"""An episode budget past the engine's context: SGLang refuses (400, not retried) a request whose prompt +
max_new_tokens reaches the model's context length. The SGLang stand-in refuses the same way; the rollout must
bound episodes by the engine's context, so such an episode ends by its budget instead of failing its group."""

import asyncio
import shutil

import pytest

from grpoflow.config import parse_run_config
from grpoflow.engine.client import SglangClient
from grpoflow.prepare.dataset import builtin_dataset_path, load_task
from grpoflow.prepare.prompts import PromptRecord
from grpoflow.rollout.agents.shell import SYSTEM_PROMPT
from grpoflow.rollout.policy import fit_to_engine
from grpoflow.tokens import TokenTrajectory, load_tokenizer
from tests.fakes.rollout_step import run_step
from tests.fakes.sglang_standin import StandinServer


def _prompt_len(model_dir, instruction):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
    return TokenTrajectory.start(load_tokenizer(str(model_dir)), messages).prompt_len


def test_the_engine_context_is_read_as_sglang_reports_it(tiny_model_dir):
    with StandinServer(str(tiny_model_dir), context_length=300) as server:

        async def read():
            client = SglangClient(server.url)
            try:
                return await client.acontext_length(), await client.aserver_info()
            finally:
                await client.aclose()

        context, info = asyncio.run(read())
        # SGLang's /get_server_info holds the --context-length flag (None here); /v1/models has the model's
        assert (context, info["context_length"]) == (300, None)
        cfg = parse_run_config({"rollout": {"episode": {"max_context_tokens": 4096}}})
        fitted = asyncio.run(fit_to_engine(cfg.rollout, cfg.engine, server.url))
        assert (
            fitted.episode.max_context_tokens == 293 and cfg.rollout.episode.max_context_tokens == 4096
        )  # SGLang's 300 - 7
        small = parse_run_config({"rollout": {"episode": {"max_context_tokens": 256}}}).rollout
        assert asyncio.run(fit_to_engine(small, cfg.engine, server.url)) is small


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_an_episode_past_the_engine_context_ends_by_its_budget_not_as_a_failed_trial(tmp_path, tiny_model_dir):
    task = load_task(builtin_dataset_path() / "hello-file")
    prompt_len = _prompt_len(tiny_model_dir, task.instruction)
    cfg = parse_run_config(
        {
            "engine": {"retries": 0},
            "rollout": {
                "n_samples_per_prompt": 2,
                "sampling": {"max_new_tokens": 64},
                "episode": {"max_context_tokens": 4096},
            },
        }
    )
    prompts = [PromptRecord(instance_id="hello-file", task_path=str(task.path), instruction=task.instruction)]
    # room for the prompt but not for a whole turn: the first request would reach the context length
    with StandinServer(str(tiny_model_dir), context_length=prompt_len + 32) as server:
        res = run_step(cfg, server.url, str(tiny_model_dir), prompts, tmp_path)
    for s in res.samples:
        assert (s.status, s.exit_status) == ("TRUNCATED", "SequenceLengthLimitExceeded"), s.exit_reason
        assert s.reward is not None
    assert "/generate" not in server.requests  # no request the engine would refuse was sent
