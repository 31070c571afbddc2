"""The shell agent: a Harbor agent whose policy writes one bash command per turn, in a fence.

Turn loop: generate (tokens in, tokens out, via the engine's `/generate`) -> parse the fenced command -> run it in
the sandbox -> feed back its output (capped) -> ... until the policy says DONE, gives no command, or the turn or
token budget runs out.

Early truncation exit: a turn that ends with finish_reason `length` ends the episode at once. Its half-written
command is not run and no further policy call is made (the tail would be discarded by training anyway, and in
long-context runs it was a fifth of all rollout time); the turn stays in the trajectory and the agent returns
normally, so Harbor still runs the verifier and the sample is scored (status TRUNCATED).

Everything the trainer needs is kept in `context.metadata["grpoflow"]`, updated after every turn, so it survives
a timeout or an error (Harbor keeps the context).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from typing import Any

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from pydantic import TypeAdapter

from grpoflow.config import Engine, EngineConfig, EpisodeConfig, SamplingConfig
from grpoflow.engine.clients import client_of
from grpoflow.engine.protocol import SamplingParams
from grpoflow.rollout.record import (
    END_DONE,
    END_ENGINE_DOWN,
    END_MAX_TURNS,
    END_NO_COMMAND,
    END_TOKEN_BUDGET,
    END_TRUNCATED,
    TrialRecord,
)
from grpoflow.seeds import turn_seed
from grpoflow.tokens import TokenTrajectory, is_cut_off, load_tokenizer, stop_ids

ENGINE: TypeAdapter[Engine] = TypeAdapter(EngineConfig)

SYSTEM_PROMPT = """You are a shell agent working in a Linux sandbox; your working directory is /app.
Reply with exactly one bash command in a fenced code block, like this:
```bash
echo hello > /app/hello.txt
```
You will see the command's output. When the task is done, reply with the single word DONE."""

# Stop at a fence followed by a newline: that is a command's closing fence (the opening one carries a language,
# "```bash\n", as the system prompt shows). What a small model writes after the command is never executed, and
# cutting it off at the engine saves the generation; the text is cut before the match, which the regex accepts.
STOP_STRINGS = ["```\n"]
_FENCE = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_DONE = re.compile(r"\bDONE\b")


def parse_command(reply: str) -> str | None:
    """The first fenced block's content, or None. An unclosed fence counts only if the turn was not cut off."""
    m = _FENCE.search(reply)
    if not m:
        return None
    cmd = m.group(1).strip()
    return cmd or None


def says_done(reply: str) -> bool:
    """The reply says DONE outside its commands: `echo DONE > /app/x` is a command that writes a word, not the
    end of the task (counted as one, it ended the episode after a command the policy never saw the output of)."""
    return _DONE.search(_FENCE.sub("", reply)) is not None


def format_output(stdout: str | None, stderr: str | None, return_code: int, cap: int) -> str:
    """Exit code plus output; over `cap` chars keep the head and the tail (errors tend to be at the end)."""
    out = (stdout or "") + (stderr or "")
    if len(out) > cap:
        half = cap // 2
        out = f"{out[:half]}\n[... {len(out) - 2 * half} characters cut ...]\n{out[-half:]}"
    return f"exit code {return_code}\n{out}".rstrip()


class ShellAgent(BaseAgent):
    def __init__(
        self,
        *args: Any,
        engine: Mapping[str, Any],
        engine_url: str,
        tokenizer_path: str,
        sampling: Mapping[str, Any],
        episode: Mapping[str, Any],
        seed: int,
        lora_path: str | None = None,
        **kwargs: Any,
    ):
        """`engine`, `sampling`, `episode`: the run's `engine`, `rollout.sampling` and `rollout.episode` sections
        as Harbor stores them with the trial (JSON), validated here; `seed`: the trial's; `lora_path`: the LoRA
        adapter the engine serves the policy as, if any."""
        super().__init__(*args, **kwargs)
        self.engine: Engine = ENGINE.validate_python(engine)
        self.sampling = SamplingConfig.model_validate(sampling)
        self.episode = EpisodeConfig.model_validate(episode)
        self.engine_url = engine_url
        self.tokenizer_path = tokenizer_path
        self.seed = seed
        self.lora_path = lora_path

    @staticmethod
    def name() -> str:
        return "grpoflow-shell"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    async def set_web_tools_disabled(self, disabled: bool, environment: BaseEnvironment) -> None:
        return None  # the agent has no web tools; the sandbox has no network anyway

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        tokenizer = load_tokenizer(self.tokenizer_path)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
        traj = TokenTrajectory.start(tokenizer, messages)
        rec = TrialRecord()
        client = client_of(self.engine, self.engine_url, lora_path=self.lora_path, waits_out_outages=True)
        try:
            rec.end_reason = await self._loop(traj, environment, client, rec, context)
        except asyncio.CancelledError:  # Harbor's agent timeout
            if client.outage is not None:
                rec.end_reason = END_ENGINE_DOWN
            raise
        finally:
            await client.aclose()
            self._record(context, traj, rec)

    async def _loop(self, traj, environment, client, rec, context) -> str:
        while True:
            s, ep = self.sampling, self.episode
            if rec.turns >= ep.max_turns:
                return END_MAX_TURNS
            if len(traj.tokens) + s.max_new_tokens > ep.max_context_tokens:
                return END_TOKEN_BUDGET
            params = SamplingParams(
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                sampling_seed=turn_seed(self.seed, rec.turns),
                stop=STOP_STRINGS,
                stop_token_ids=sorted(stop_ids(traj.tokenizer)),  # the turn end, where it is not the engine's EOS
            )
            t0 = time.perf_counter()
            resp = await client.agenerate(traj.tokens, params, return_logprob=True)
            rec.generation_time_s += time.perf_counter() - t0
            rec.policy_calls += 1
            rec.turns += 1
            rec.turn_weight_versions.append(resp.meta_info.weight_version)
            rec.weight_version = rec.turn_weight_versions[0]  # the oldest turn's (versions only grow)
            if rec.truncated:  # only reachable with the early exit switched off (benchmarks)
                rec.tokens_after_truncation += len(resp.output_ids)
            reply = traj.add_generated(resp.output_ids, resp.logprobs)
            if is_cut_off(resp.meta_info.finish_reason.type, resp.output_ids, stop_ids(traj.tokenizer)):
                rec.truncated = True
                if self.episode.early_truncation_exit:
                    return END_TRUNCATED
            self._record(context, traj, rec)
            command = parse_command(reply)
            if command is None:
                return END_DONE if says_done(reply) else END_NO_COMMAND
            t0 = time.perf_counter()
            result = await environment.exec(command, cwd="/app", timeout_sec=self.episode.command_timeout_sec)
            rec.tool_time_s += time.perf_counter() - t0
            rec.commands_run += 1
            feedback = format_output(result.stdout, result.stderr, result.return_code, self.episode.output_cap_chars)
            traj.add_user(feedback)
            if says_done(reply):
                return END_DONE

    def _record(self, context: AgentContext, traj: TokenTrajectory, rec: TrialRecord) -> None:
        gen = traj.n_generated
        context.n_input_tokens = len(traj.tokens) - gen
        context.n_output_tokens = gen
        rec.model_copy(
            update={
                "end_reason": rec.end_reason
                if rec.end_reason is not None
                else (END_TRUNCATED if rec.truncated else None),
                "tokens": list(traj.tokens),
                "loss_mask": list(traj.loss_mask),
                "rollout_logprobs": list(traj.logprobs),
                "prompt_len": traj.prompt_len,
                "messages": list(traj.messages),
            }
        ).write(context)
