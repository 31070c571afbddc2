"""Sandboxes for Harbor trials: `LocalSandbox` (bubblewrap on this machine) and the errors that decide retries."""

from grpoflow.sandbox.errors import (
    SandboxDiedError,
    SandboxError,
    SandboxStartError,
    SandboxUnavailableError,
    is_sandbox_failure,
    is_sandbox_failure_type,
)

LOCAL_SANDBOX_IMPORT_PATH = "grpoflow.sandbox.local:LocalSandbox"

__all__ = [
    "LOCAL_SANDBOX_IMPORT_PATH",
    "SandboxDiedError",
    "SandboxError",
    "SandboxStartError",
    "SandboxUnavailableError",
    "is_sandbox_failure",
    "is_sandbox_failure_type",
]
