"""Harbor's claude-code and opencode agents, unchanged but for their install step: when the sandbox already has the
pinned CLI (the local sandbox shows prepare's npm install read-only, `grpoflow.prepare.clis`), nothing is installed;
otherwise (a cloud sandbox) Harbor's own install runs, at the pinned version.

Everything else is Harbor's: the command line, the stream-json / json logs and their trajectory conversion. The
policy is reached through the session server (`grpoflow.rollout.harnesses` sets the URL and the session's token),
which keeps the exact tokens and ends an episode whose turn was cut off (`truncation_ends_episode`).
"""

from __future__ import annotations

from typing import Any

from grpoflow.errors import one_line
from grpoflow.offline import apply_offline_env

apply_offline_env()  # before Harbor imports LiteLLM

import litellm  # noqa: E402
from harbor.agents.installed.claude_code import ClaudeCode  # noqa: E402
from harbor.agents.installed.opencode import OpenCode  # noqa: E402
from harbor.environments.base import BaseEnvironment  # noqa: E402

from grpoflow.prepare.clis import CLI_PACKAGES  # noqa: E402

# Harbor prices each claude-code step with LiteLLM, which prints (not logs) a provider list for a model it does not
# know, ours, into every flow log.
litellm.suppress_debug_info = True


async def _has_pinned_cli(agent: Any, harness: str, environment: BaseEnvironment) -> bool:
    pkg = CLI_PACKAGES[harness]
    found = await environment.exec(command=f"{pkg.bin} --version")
    if found.return_code == 0 and pkg.version in (found.stdout or ""):
        agent.logger.debug("%s %s is in the sandbox: nothing to install", pkg.bin, pkg.version)
        return True
    cli_dir = getattr(environment, "cli_dir", None)
    if cli_dir is not None:  # the local sandbox showed prepare's install, and it has no network to install another
        out = one_line(f"{found.stdout or ''} {found.stderr or ''}")
        raise RuntimeError(
            f"{pkg.bin} from {cli_dir} does not run in the sandbox as {pkg.spec} (exit {found.return_code}): {out}"
        )
    return False


class GrpoClaudeCode(ClaudeCode):
    async def install(self, environment: BaseEnvironment) -> None:
        if not await _has_pinned_cli(self, "claude-code", environment):
            await super().install(environment)


class GrpoOpenCode(OpenCode):
    async def install(self, environment: BaseEnvironment) -> None:
        if not await _has_pinned_cli(self, "opencode", environment):
            await super().install(environment)
