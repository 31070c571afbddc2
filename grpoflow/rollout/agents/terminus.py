"""Harbor's terminus-2, unchanged but for three things training needs: the early truncation exit, the metadata the
evaluator reads, and the time spent running commands.

Early truncation exit. On a reply cut off at `max_tokens` (finish_reason `length`) Harbor's LiteLLM raises
`OutputLengthExceededError` and terminus-2 recovers: it salvages a complete action from the cut reply (XML parser;
its commands then run) or re-sends the cut reply with an "ERROR!! ... re-issue" user turn, i.e. it extends a turn
the session server has closed. Neither is what the policy produced within its limit. Here the LLM's `call` is
wrapped: the first truncated reply raises `TurnTruncated`, a `BaseException`, so no `except Exception` in terminus-2
(its recovery, summarisation fallbacks, tenacity retries) catches it; every later call raises it again without
reaching the server. `run()` catches it and returns normally, so Harbor still runs the verifier, and the episode
ends with `end_reason` `truncated` (evaluate: status TRUNCATED, exit SequenceLengthLimitExceeded). No command of
the cut reply runs: commands run only after a reply parsed, and the cut reply never returns.

Context overflow without summarisation (`ContextLengthExceededError`) ends the episode the same way, with
`end_reason` `token_budget` (as the shell agent's budget end), so it is verified too.

Everything the evaluator reads is in `context.metadata["grpoflow"]` (see `record`), next to terminus-2's own keys.
Tokens are not: terminus-2 speaks chat text; the exact tokens come from the session server (or
`context.rollout_details` with `collect_rollout_details`).
"""

from __future__ import annotations

import time
from typing import Any

from grpoflow.offline import apply_offline_env

apply_offline_env()  # before Harbor imports LiteLLM: ours is unknown to its price map anyway (terminus-2 gets `model_info`)

from harbor.agents.terminus_2 import Terminus2  # noqa: E402
from harbor.environments.base import BaseEnvironment  # noqa: E402
from harbor.llms.base import ContextLengthExceededError, OutputLengthExceededError  # noqa: E402
from harbor.models.agent.context import AgentContext  # noqa: E402

from grpoflow.rollout.harnesses import SESSION_TOKEN_VAR  # noqa: E402
from grpoflow.rollout.record import END_DONE, END_MAX_TURNS, END_TOKEN_BUDGET, END_TRUNCATED, TrialRecord  # noqa: E402


class TurnTruncated(BaseException):
    """A policy reply was cut off at max_tokens: the episode ends here (see module doc)."""


class GrpoTerminus2(Terminus2):
    """terminus-2 (same name, prompts, parser, tmux loop) with the early truncation exit and grpoflow metadata."""

    def __init__(
        self,
        *args: Any,
        early_truncation_exit: bool = True,
        extra_env: dict[str, str] | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        # The session token arrives in the agent env (Harbor redacts it where it writes the trial's config) and
        # goes to the LLM client alone: terminus-2 exports its agent env into the sandbox's terminal, and writes
        # its options (llm_kwargs among them) into the trial's trajectory.json.
        env = dict(extra_env or {})
        token = env.pop(SESSION_TOKEN_VAR, None)
        super().__init__(*args, extra_env=env, llm_kwargs=llm_kwargs, **kwargs)
        if token is not None:
            self._llm._llm_kwargs["api_key"] = token
        self.early_truncation_exit = early_truncation_exit
        self._rec = TrialRecord()
        inner_call = self._llm.call

        async def call(*call_args: Any, **call_kwargs: Any) -> Any:
            # Every policy call of terminus-2 (turns, summaries, fallbacks) goes through the LLM's `call`.
            if self._rec.truncated and self.early_truncation_exit:
                raise TurnTruncated("a previous reply was cut off at max_tokens: no further policy call")
            t0 = time.perf_counter()
            try:
                return await inner_call(*call_args, **call_kwargs)
            except OutputLengthExceededError as err:
                self._rec.truncated = True
                if self.early_truncation_exit:
                    raise TurnTruncated(str(err)) from err
                raise  # benchmarks only: terminus-2's own recovery
            finally:
                self._rec.policy_calls += 1
                self._rec.generation_time_s += time.perf_counter() - t0

        self._llm.call = call  # type: ignore[method-assign]  # an instance attribute shadows the method

    async def _execute_commands(self, commands: list[Any], session: Any) -> tuple[bool, str]:
        t0 = time.perf_counter()
        try:
            return await super()._execute_commands(commands, session)
        finally:
            self._rec.tool_time_s += time.perf_counter() - t0
            self._rec.commands_run += len(commands)

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        self._rec = TrialRecord()
        try:
            await super().run(instruction, environment, context)
            end = END_MAX_TURNS if self._n_episodes >= self._max_episodes else END_DONE
        except TurnTruncated:
            end = END_TRUNCATED
        except ContextLengthExceededError:
            end = END_TOKEN_BUDGET
        finally:
            self._rec.turns = self._n_episodes
            self.record(context)
        self._rec.end_reason = END_TRUNCATED if self._rec.truncated else end
        self.record(context)

    def record(self, context: AgentContext) -> None:
        """Put what evaluate reads into `context.metadata["grpoflow"]` (kept on errors and timeouts too)."""
        self._rec.write(context)
