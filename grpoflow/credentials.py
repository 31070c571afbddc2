"""Sandbox provider credentials: which variable a provider reads its key from, where the key comes from, and how it
reaches the provider's SDK without being written anywhere.

Harbor writes each trial's whole `TrialConfig` (including `EnvironmentConfig.kwargs` and `.env`) to
`trials/*/config.json` and `result.json`, so a key never travels in kwargs or config. It comes from this process's
environment (e.g. `E2B_API_KEY`) or from a key file (`rollout.sandbox.api_key_file`) that the rollout task reads
and exports into this process's environment, where the provider SDK looks for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from grpoflow.errors import GrpoflowError


class CredentialError(GrpoflowError):
    """A sandbox key is missing, empty or unreadable."""


def _e2b_api_base(environ: Mapping[str, str]) -> tuple[str, str]:
    """e2b's control-plane URL, resolved as `e2b.ConnectionConfig` does, and the setting it came from."""
    if environ.get("E2B_API_URL"):
        return environ["E2B_API_URL"].rstrip("/"), "E2B_API_URL"
    if environ.get("E2B_DEBUG", "false").lower() == "true":
        return "http://localhost:3000", "E2B_DEBUG"
    domain = environ.get("E2B_DOMAIN") or "e2b.app"
    return f"https://api.{domain}", "E2B_DOMAIN" if environ.get("E2B_DOMAIN") else "the default E2B_DOMAIN"


@dataclass(frozen=True)
class Provider:
    """What grpoflow knows about one Harbor environment type's credentials."""

    key_var: str  # the environment variable the provider's SDK (and Harbor's own preflight) reads the key from
    # (base URL, the setting it came from), for the reachability probe; None: no probe for this provider
    api_base: Callable[[Mapping[str, str]], tuple[str, str]] | None = None
    probe_path: str = ""  # an endpoint of the API that answers without a key (401 counts as reachable)


# Providers whose key is one variable, read from each Harbor environment's `preflight()` in harbor 0.25 (a test
# checks every name still appears in its Harbor module). Types not listed here (modal, docker, gke, ...) take
# their credentials from the environment as Harbor documents, and preflight runs Harbor's own check for them.
PROVIDERS: dict[str, Provider] = {
    # GET /sandboxes lists the team's sandboxes: 401 without a key, so it proves the API answers.
    "e2b": Provider("E2B_API_KEY", _e2b_api_base, "/sandboxes"),
    "runloop": Provider("RUNLOOP_API_KEY"),
    "novita": Provider("NOVITA_API_KEY"),
    "tensorlake": Provider("TENSORLAKE_API_KEY"),
    "hyperbrowser": Provider("HYPERBROWSER_API_KEY"),
    "use-computer": Provider("USE_COMPUTER_API_KEY"),
    "kernel": Provider("KERNEL_API_KEY"),
    "vercel": Provider("VERCEL_TOKEN"),
    "beam": Provider("BEAM_TOKEN"),
}


def sandbox_key_var(sandbox: str) -> str | None:
    """The variable a sandbox type's key lives in, or None when grpoflow does not know one (incl. `local`)."""
    provider = PROVIDERS.get(sandbox)
    return provider.key_var if provider else None


def read_key_file(path: str | Path, key_var: str, field: str = "rollout.sandbox.api_key_file") -> str:
    """The key in `path`, stripped. Raises `CredentialError` naming the field and file when it is missing,
    unreadable or empty (an empty placeholder file must fail here, not as an authentication error in every trial)."""
    p = Path(path).expanduser()
    try:
        key = p.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise CredentialError(f"{field} {p}: no such file (it should hold the {key_var} value)") from None
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
        raise CredentialError(f"{field} {p}: cannot be read ({why})") from None
    if not key:
        raise CredentialError(f"{field} {p} is empty: put the {key_var} value in it")
    return key


def sandbox_key_problems(sandbox: str, key_file: str | None, environ: Mapping[str, str]) -> list[str]:
    """Preflight of the key for providers in `PROVIDERS`: the key file (if set) holds a key, else the variable is
    set and non-blank. Other types: nothing here (preflight asks Harbor)."""
    key_var = sandbox_key_var(sandbox)
    if key_var is None:
        return []
    if key_file:
        try:
            read_key_file(key_file, key_var)
        except CredentialError as err:
            return [str(err)]
        return []
    if not environ.get(key_var, "").strip():
        return [
            f"rollout.sandbox.backend={sandbox} needs an API key: set {key_var} in the environment, or set "
            f"rollout.sandbox.api_key_file to a file holding it"
        ]
    return []


def export_sandbox_key(
    sandbox: str, key_file: str | None, environ: MutableMapping[str, str] | None = None
) -> str | None:
    """Put the key from `key_file` into the process environment under the provider's variable, where its SDK
    reads it. The file wins over a value already there (it is the explicit choice of this run). Returns the
    variable's name when one was set. Without a key file nothing changes: the key is already in the environment."""
    if not key_file:
        return None
    key_var = sandbox_key_var(sandbox)
    if key_var is None:  # refused by RolloutConfig's validator; kept for callers that build configs by hand
        raise CredentialError(
            f"rollout.sandbox.api_key_file: grpoflow does not know which variable sandbox `{sandbox}` reads its "
            "key from; give its credentials in the environment"
        )
    env = os.environ if environ is None else environ
    env[key_var] = read_key_file(key_file, key_var)
    return key_var


# The variable the policy endpoint's key is handed to harnesses in (by name: see grpoflow.rollout.harnesses).
POLICY_KEY_VAR = "GRPOFLOW_POLICY_API_KEY"


def export_policy_key(key_file: str | None, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Put the policy endpoint's key from `rollout.harness.policy_api_key_file` into the process environment as
    `POLICY_KEY_VAR`, where Harbor resolves the harness's reference to it. Returns the variable's name when set."""
    if not key_file:
        return None
    env = os.environ if environ is None else environ
    env[POLICY_KEY_VAR] = read_key_file(key_file, POLICY_KEY_VAR, field="rollout.harness.policy_api_key_file")
    return POLICY_KEY_VAR


def policy_key_problems(key_file: str | None) -> list[str]:
    """Preflight of `rollout.harness.policy_api_key_file`: when set, the file holds a key."""
    if not key_file:
        return []
    try:
        read_key_file(key_file, POLICY_KEY_VAR, field="rollout.harness.policy_api_key_file")
    except CredentialError as err:
        return [str(err)]
    return []
