"""Sandbox errors and the one predicate that decides whether a failed trial is retried in a fresh sandbox.

A sandbox failure is an infrastructure fault: the trial says nothing about the policy, so the rollout layer runs
it again. Everything else (the agent or model failed, the verifier crashed, the agent ran out of time) is final
and is never retried. Harbor records a failed trial as `TrialResult.exception_info` with the exception's class
name only, so the predicate works on names.
"""

from __future__ import annotations

from pathlib import Path

from harbor.models.trial.error_policy import ERROR_POLICIES, FailureCause

from grpoflow.errors import GrpoflowError
from grpoflow.rollout.record import END_ENGINE_DOWN

# The local sandbox (`grpoflow.embedded.sandbox`), as the rollout reaches it: by Harbor's `import_path`, never by
# import. What a trial's harness needs to know of it lives here too.
LOCAL_SANDBOX_IMPORT_PATH = "grpoflow.embedded.sandbox.local:LocalSandbox"
BRIDGE_HOST = "127.0.0.1"  # where the bridge to the session server listens inside the local sandbox
SANDBOX_PYTHON = "/usr/bin/python3"  # the host's, which the local sandbox sees: it runs the bridge's forwarder


class SandboxError(GrpoflowError):
    """The sandbox itself failed (not the command run in it). Transient: retry the trial in a fresh sandbox."""


class SandboxStartError(SandboxError):
    """The sandbox could not be started (including injected start faults)."""


class SandboxDiedError(SandboxError):
    """The sandbox died or could not run a command (bubblewrap failed to set it up, an injected fault, or used
    after stop())."""


class ImageBuildError(SandboxStartError):
    """The task's image could not be built from its Dockerfile (or unpacked): a sandbox failure of that task, with
    the builder's last lines, never a reward. `log`: the builder's full output, when the build ran."""

    def __init__(self, message: str, log: Path | None = None):
        super().__init__(message)
        self.log = log


class SandboxUnavailableError(GrpoflowError):
    """This machine cannot run the sandbox at all (bubblewrap or util-linux missing).

    Not a `SandboxError`: retrying cannot help, so the predicate below says False and the run fails fast.
    """


# Our transient types, by name: Harbor stores only the class name of the exception that ended a trial.
OUR_SANDBOX_FAILURES: frozenset[str] = frozenset(
    {SandboxError.__name__, SandboxStartError.__name__, SandboxDiedError.__name__, ImageBuildError.__name__}
)
# Harbor's own table of what counts as a sandbox fault (environment start timeout, healthcheck, build failure,
# agent-setup timeout, tests upload / verifier download failures, provider exec-stream errors...). Read from
# Harbor so the two never disagree.
HARBOR_SANDBOX_FAILURES: frozenset[str] = frozenset(
    name for name, policy in ERROR_POLICIES.items() if policy.cause == FailureCause.SANDBOX_FAILED
)
# Cloud sandbox providers' own errors, which Harbor's environments raise unwrapped (so `exception_type` carries
# these names). From `e2b.exceptions` (e2b 2.x; a test checks each name still exists there):
PROVIDER_SANDBOX_FAILURES: frozenset[str] = frozenset(
    {
        # Capacity and rate limits: HTTP 429 and 503 ("no capacity to place a sandbox right now"). Nothing was
        # created and the same request succeeds later, so the trial is retried after our jittered backoff.
        "RateLimitException",
        "ServiceBusyException",
        # The sandbox died under the trial (killed, timed out, network down): the next sandbox may well be fine.
        "SandboxNotRunningException",
        "SandboxUnreachableException",
    }
)
SANDBOX_FAILURE_TYPES: frozenset[str] = OUR_SANDBOX_FAILURES | HARBOR_SANDBOX_FAILURES | PROVIDER_SANDBOX_FAILURES


def is_sandbox_failure_type(exception_type: str | None) -> bool:
    """Should a trial that ended with this exception (its class name, as Harbor's `ExceptionInfo.exception_type`
    keeps it) be retried in a fresh sandbox?

    True: our `SandboxError` family, Harbor's sandbox faults (`EnvironmentStartTimeoutError`, `HealthcheckError`,
    `AgentSetupTimeoutError`, ...), and cloud providers' capacity, rate-limit and dead-sandbox errors. False:
    None, agent/model errors, timeouts of the agent or verifier, reward errors, and `SandboxUnavailableError` (a
    missing tool does not heal on retry)."""
    return exception_type is not None and exception_type in SANDBOX_FAILURE_TYPES


# The engine did not answer for longer than a request waits it out (`engine.outage_wait_s`): the trial says nothing
# about the policy either. By name, as Harbor keeps it.
ENGINE_FAILURE_TYPES: frozenset[str] = frozenset({"EngineUnavailableError"})


def is_engine_outage(exception_type: str | None, end_reason: str | None = None) -> bool:
    """Did the trial end because the engine did not answer? Its request gave up (`EngineUnavailableError`), or
    the agent's time ran out while the request was still waiting the outage out (`AgentTimeoutError` with the
    agent's end reason `END_ENGINE_DOWN`): Harbor verifies a timed-out trial, but that reward would score an
    episode the policy never got to finish."""
    return exception_type in ENGINE_FAILURE_TYPES or (
        exception_type == "AgentTimeoutError" and end_reason == END_ENGINE_DOWN
    )


def is_infrastructure_failure(exception_type: str | None, end_reason: str | None = None) -> bool:
    """Should a trial that ended with this exception (and the agent's `end_reason`) be run again, in a fresh
    sandbox? A sandbox failure (`is_sandbox_failure_type`) or an engine outage (`is_engine_outage`); never the
    policy's, the agent's or the verifier's doing."""
    return is_sandbox_failure_type(exception_type) or is_engine_outage(exception_type, end_reason)
