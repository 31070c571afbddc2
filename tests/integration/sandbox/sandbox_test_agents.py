"""Harbor agents for the sandbox tests (loaded by import path `tests.integration.sandbox.sandbox_test_agents:<Class>`)."""

from __future__ import annotations

from typing import Any

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext


class SleepAgent(BaseAgent):
    """Starts `sleep <marker>` in the background and in the foreground, with no exec timeout of its own, so only
    Harbor's agent timeout (which cancels the exec) can end it."""

    def __init__(self, *args: Any, marker: str = "1000", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.marker = marker

    @staticmethod
    def name() -> str:
        return "sleep-agent"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        await environment.exec(f"setsid sleep {self.marker} >/dev/null 2>&1 & sleep {self.marker}")
