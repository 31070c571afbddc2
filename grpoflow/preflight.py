"""Checks that fail a run in seconds, with one line naming what to set, instead of failing every trial later.

Each check is a function returning a list of problems (one line each; empty: fine). They only look: no run dir
is made, no key exported, no sandbox created. `check_run` picks what a flow's stage needs (the run dir, Harbor,
the harness, the sandbox and its key, an attached engine); `check_engine` checks an engine the run started
itself once it is up. `tasks/preflight.py` runs them as each flow's first task. The table: docs/preflight.md.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import httpx

from grpoflow.config import AttachedEngine, LaunchedEngine, RolloutConfig, RunConfig
from grpoflow.credentials import (
    PROVIDERS,
    policy_key_problems,
    sandbox_key_problems,
)
from grpoflow.engine.clients import engine_client
from grpoflow.engine.launch import server_env
from grpoflow.errors import ConfigError, GrpoflowError, one_line
from grpoflow.paths import run_dir_problems
from grpoflow.placement import machine_gpus, plan_gpus
from grpoflow.rollout.environments import LOCAL_SANDBOX_IMPORT_PATH
from grpoflow.rollout.harnesses import harness_problems

Stage = Literal["prepare", "train", "evaluate", "resume"]  # resume: a train run whose dir exists

DEFAULT_TIMEOUT_S = 5.0
log = logging.getLogger(__name__)


class PreflightError(GrpoflowError):
    """A run cannot start: its message lists every problem preflight found, one per line."""


def check_run(
    cfg: RunConfig, stage: Stage, environ: Mapping[str, str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[str]:
    """Everything `stage` needs before its first real step (see the module doc)."""
    env = os.environ if environ is None else environ
    harbor = check_harbor()
    problems = (check_run_dir(cfg) if stage != "resume" else []) + harbor
    if stage == "prepare" or harbor:  # prepare needs no sandbox or engine; without harbor the sandbox checks can't run
        return problems
    problems += harness_problems(cfg.rollout) + policy_key_problems(cfg.rollout.harness.policy_key_file())
    if stage in ("train", "resume"):
        problems += sampling_problems(cfg.rollout)
    if notice := toy_values_notice(cfg):
        log.warning(notice)
    problems += check_sandbox(cfg.rollout, env, timeout_s) + gpu_problems(cfg) + nccl_problems(cfg)
    if isinstance(cfg.engine, AttachedEngine):
        # each server behind a router (which has no /model_info of its own), or the one server
        with engine_client(cfg.engine.api, cfg.engine.url) as client:
            urls = client.replicas(timeout_s)
        for url in urls:
            problems += check_engine(url, cfg.model.source, "model.source", timeout_s)
    return problems


_NCCL_PROBE = (
    "import torch; v = torch.version.cuda and torch.cuda.nccl.version(); "
    "print(torch.__version__, '.'.join(map(str, v)) if v else '-')"
)


def nccl_problems(cfg: RunConfig) -> list[str]:
    """A `distributed` sync on GPUs joins the trainer and a launched engine in one NCCL communicator, across two
    environments (the engine pins its own torch): their NCCL versions must agree, or the first sync fails after a
    whole rollout and update. Over gloo (the CPU) torch versions may differ."""
    e = cfg.engine
    if not isinstance(e, LaunchedEngine) or e.launch.device != "cuda" or cfg.weight_sync_mode() != "distributed":
        return []
    python = e.python
    ours = subprocess.run([sys.executable, "-c", _NCCL_PROBE], capture_output=True, text=True, timeout=120)
    try:
        theirs = subprocess.run(
            [python, "-c", _NCCL_PROBE], capture_output=True, text=True, timeout=120, env=server_env(), check=True
        )
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        detail = getattr(err, "stderr", None) or err
        return [f"engine.{e.api}.python {python}: cannot report its torch ({one_line(detail, 200)})"]
    (t_ours, n_ours), (t_theirs, n_theirs) = ours.stdout.split()[:2], theirs.stdout.split()[:2]
    if n_ours != n_theirs:
        return [
            f"engine.weight_sync.mode=distributed: the engine's torch {t_theirs} has NCCL {n_theirs}, the trainer's torch "
            f"{t_ours} NCCL {n_ours}: one communicator needs one NCCL (or set engine.weight_sync.mode=disk)"
        ]
    return []


def gpu_problems(cfg: RunConfig, gpus: int | None = None) -> list[str]:
    """The run's GPU plan (`grpoflow.placement`) on this machine, or why there is none."""
    try:
        plan_gpus(cfg, machine_gpus() if gpus is None else gpus)
    except ConfigError as err:
        return [str(err)]
    return []


def sampling_problems(rollout: RolloutConfig) -> list[str]:
    """A train run samples its trials from the distribution the trainer scores: engine and trainer both score
    tokens under the unfiltered softmax(logits / temperature), so a nucleus or top-k filter would train another
    objective than the one sampled (and the start-of-run probe would not see it)."""
    filters = [f"top_p={rollout.sampling.top_p}"] * (rollout.sampling.top_p < 1.0) + [
        f"top_k={rollout.sampling.top_k}"
    ] * (rollout.sampling.top_k > 0)
    if not filters:
        return []
    return [
        f"rollout.{' and rollout.'.join(filters)}: a train run samples from the distribution the trainer scores "
        "(the unfiltered softmax at rollout.sampling.temperature); leave top_p at 1 and top_k at -1 (an evaluate run may "
        "filter)"
    ]


# Settings whose defaults are the embedded recipe's, sized for a 135M model on a CPU.
_TOY_SETTINGS = (
    "rollout.sampling.max_new_tokens",
    "rollout.sampling.temperature",
    "rollout.episode.max_context_tokens",
)


def toy_values_notice(cfg: RunConfig) -> str | None:
    """One line when a run on a GPU engine (launched on CUDA, or attached) leaves sampling at the defaults, which
    are the embedded CPU recipe's; None otherwise. A value the config sets, even to the default, is not named."""
    e = cfg.engine
    on_gpu = isinstance(e, AttachedEngine) or (isinstance(e, LaunchedEngine) and e.launch.device == "cuda")
    kept = [f"{name}={value}" for name in _TOY_SETTINGS if (value := _default_kept(cfg, name)) is not None]
    if not on_gpu or not kept:
        return None
    return (
        f"engine.backend={e.backend} keeps the embedded CPU recipe's {', '.join(kept)}, sized for a 135M model; "
        "the preset tb2-qwen3-8b-8xh100 shows production values"
    )


def _default_kept(cfg: RunConfig, dotted: str) -> object | None:
    """The value of `dotted` (rollout.sampling.temperature) when the config did not give it (its default), else
    None."""
    node: Any = cfg
    given = True
    for part in dotted.split("."):
        given = given and part in node.model_fields_set
        node = getattr(node, part)
    return None if given else node


def check_run_dir(cfg: RunConfig) -> list[str]:
    """The run dir does not exist yet, and the output dir can hold it (a writable dir, or one that can be made)."""
    return run_dir_problems(cfg.output_dir, cfg.run_id) if cfg.run_id else []


def check_harbor(import_module: Callable[[str], object] = importlib.import_module) -> list[str]:
    try:
        import_module("harbor.trial.trial")
    except ImportError as err:
        return [f"harbor is not importable ({err}): pip install 'harbor==0.25.0' into this environment"]
    return []


def check_sandbox(
    rollout: RolloutConfig, environ: Mapping[str, str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[str]:
    if rollout.sandbox.local:
        return check_local_sandbox()
    loaded = check_harbor_environment(rollout.sandbox.backend)
    if loaded:  # nothing more can be asked of an environment Harbor cannot load
        return loaded
    if rollout.sandbox.backend in PROVIDERS:
        problems = sandbox_key_problems(rollout.sandbox.backend, rollout.sandbox.key_file(), environ)
    else:
        problems = check_harbor_preflight(rollout.sandbox.backend)
        if rollout.sandbox.backend == "docker" and not problems:
            problems = check_docker_compose()
    return problems + check_sandbox_api(rollout.sandbox.backend, environ, timeout_s)


def check_local_sandbox() -> list[str]:
    """The local sandbox's own preflight (Harbor's `preflight()` of the class the rollout loads by import path):
    the host tools it runs, one line per missing one. Where it can give a trial no cgroup, a warning says so (a
    run can go on: memory is then capped per process as address space)."""
    module, name = LOCAL_SANDBOX_IMPORT_PATH.split(":")
    cls = getattr(importlib.import_module(module), name)
    try:
        cls.preflight()
    except SystemExit as err:
        return [
            f"rollout.sandbox.backend=local: {line}, or set rollout.sandbox.backend to a Harbor environment type (e.g. e2b)"
            for line in str(err.code).splitlines()
        ]
    if notice := cls.limits_notice():
        log.warning("rollout.sandbox.backend=local: %s", notice)
    return []


def check_harbor_environment(sandbox: str) -> list[str]:
    """Harbor can import the environment class of `sandbox`, and every package of its pip extra is installed
    (some are imported only when a trial starts: e2b's environment needs `dockerfile-parse` in its constructor)."""
    from harbor.environments.factory import _ENVIRONMENT_REGISTRY, EnvironmentFactory
    from harbor.models.environment_type import EnvironmentType

    env_type = EnvironmentType(sandbox)
    try:
        # Public and side-effect free; it imports the environment's module, which is what can fail.
        EnvironmentFactory.resource_capabilities(env_type)
    except ImportError as err:
        return [f"rollout.sandbox.backend={sandbox}: Harbor cannot load this environment: {one_line(str(err), 400)}"]
    entry = _ENVIRONMENT_REGISTRY.get(env_type)
    missing = missing_extra_packages(entry.pip_extra) if entry and entry.pip_extra else []
    if missing:
        return [
            f"rollout.sandbox.backend={sandbox}: Harbor's `{entry.pip_extra}` extra is not fully installed (missing "
            f"{', '.join(missing)}): pip install 'harbor[{entry.pip_extra}]=={_harbor_version()}'"
        ]
    return []


def missing_extra_packages(extra: str, dist: str = "harbor") -> list[str]:
    """Packages `dist[extra]` requires that are not installed (nested extras of `dist` itself not followed)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    missing = []
    for spec in metadata.requires(dist) or []:
        req = Requirement(spec)
        if req.name == dist or req.marker is None or not req.marker.evaluate({"extra": extra}):
            continue
        try:
            metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(req.name)
    return missing


def _harbor_version() -> str:
    from importlib import metadata

    return metadata.version("harbor")


def check_docker_compose(docker: str = "docker") -> list[str]:
    """Harbor's docker environment runs every trial with `docker compose` (v2, the CLI plugin), which its own
    preflight does not ask for: without it every trial fails at its start."""
    try:
        subprocess.run([docker, "compose", "version"], capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        return [
            "rollout.sandbox.backend=docker: Harbor's docker environment needs `docker compose` (v2, the CLI plugin), "
            f"which `docker compose version` does not answer ({one_line(err, 120)}); install it, or use "
            "rollout.sandbox.backend=local"
        ]
    return []


def check_harbor_preflight(sandbox: str) -> list[str]:
    """Harbor's own credential/tool check of an environment type (e.g. `docker info`, Modal's token)."""
    from harbor.environments.factory import EnvironmentFactory
    from harbor.models.environment_type import EnvironmentType

    try:
        EnvironmentFactory.run_preflight(EnvironmentType(sandbox))
    except SystemExit as err:  # Harbor's preflights exit with the message meant for the user
        return [f"rollout.sandbox.backend={sandbox}: {one_line(str(err.code), 400)}"]
    except Exception as err:  # a provider's check may fail in its own way; report it, don't crash the check
        return [
            f"rollout.sandbox.backend={sandbox}: Harbor's preflight failed: {type(err).__name__}: {one_line(str(err), 400)}"
        ]
    return []


def check_sandbox_api(sandbox: str, environ: Mapping[str, str], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """One GET to the provider's control plane, without credentials: any answer below 500 (401/403 included)
    proves there is a route to a working API; 5xx, a refused connection or a timeout fail."""
    provider = PROVIDERS.get(sandbox)
    if provider is None or provider.api_base is None:
        return []
    base, source = provider.api_base(environ)
    url = base + provider.probe_path
    where = f"the {sandbox} API at {base} (from {source})"
    try:
        status = httpx.get(url, timeout=timeout_s).status_code
    except httpx.TimeoutException:
        return [f"{where} did not answer within {timeout_s:g}s: check this machine's route to it, or the URL setting"]
    except httpx.HTTPError as err:
        return [
            f"{where} is unreachable ({type(err).__name__}: {one_line(str(err), 400)}): check this machine's route "
            "to it, or the URL setting"
        ]
    if status >= 500:
        return [
            f"{where} answered HTTP {status} to GET {provider.probe_path}: the service is failing; retry later "
            "or check the URL setting"
        ]
    return []


def check_engine(
    url: str, expected_model: str, expected_from: str, timeout_s: float = DEFAULT_TIMEOUT_S, remedy: str | None = None
) -> list[str]:
    """The engine at `url` is healthy and serves `expected_model` (`/model_info`'s `model_path`, compared as a
    string and as a local path; or the `model_path` it was started with, `/get_server_info`'s: SGLang's
    `/model_info` names the dir it last loaded weights from, a run's checkpoint after a disk sync).
    `expected_from` names the setting the expectation came from and `remedy` what to do about a mismatch
    (default: for an SGLang server the user started)."""
    base = url.rstrip("/")
    try:
        health = httpx.get(base + "/health", timeout=timeout_s)
    except httpx.HTTPError as err:
        return [
            f"engine at {base}: no SGLang server answers GET /health ({type(err).__name__}: "
            f"{one_line(str(err), 400) or 'timed out'}): start it (README, Production) or fix engine.url"
        ]
    if health.status_code != 200:
        return [
            f"engine at {base}: GET /health answered HTTP {health.status_code}: the server is not ready; wait "
            "for it to finish loading, restart it, or fix engine.url"
        ]
    try:
        served = _served_model(base, timeout_s)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as err:
        return [
            f"engine at {base}: neither GET /model_info (SGLang) nor GET /v1/models (vLLM) gave the model path "
            f"({type(err).__name__}: {one_line(str(err), 400)}): is engine.url an SGLang or vLLM server?"
        ]
    if not (_same_model(str(served), expected_model) or _same_model(_started_on(base, timeout_s), expected_model)):
        remedy = remedy or (
            f"start SGLang with --model-path {expected_model}, or set {expected_from} to the served model's directory"
        )
        return [
            f"engine at {base} serves `{served}` (GET /model_info model_path), but {expected_from} is "
            f"`{expected_model}`: {remedy}"
        ]
    return []


def _served_model(base: str, timeout_s: float) -> str:
    """SGLang's `/model_info` `model_path`; from a server without that route (vLLM: 404), `/v1/models`' first
    model's `root` (the --model it was started with)."""
    info = httpx.get(base + "/model_info", timeout=timeout_s)
    if info.status_code == 404:
        try:
            models = httpx.get(base + "/v1/models", timeout=timeout_s)
            models.raise_for_status()
            return str(models.json()["data"][0]["root"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
            pass  # no vLLM either: /model_info's 404 says what is wrong
    info.raise_for_status()
    return info.json()["model_path"]


def _started_on(base: str, timeout_s: float) -> str:
    """The `model_path` the engine was started with (`/get_server_info`), or "" when it does not say."""
    try:
        info = httpx.get(base + "/get_server_info", timeout=timeout_s)
        info.raise_for_status()
        return str(info.json().get("model_path") or "")
    except (httpx.HTTPError, ValueError, AttributeError):
        return ""


def _same_model(served: str, expected: str) -> bool:
    if not served:
        return False
    if served == expected:
        return True
    # A relative and an absolute spelling of one directory, or a symlink to it, are the same model.
    return os.path.realpath(Path(served).expanduser()) == os.path.realpath(Path(expected).expanduser())


def engine_preflight(url: str, model_path: str) -> None:
    """An engine the run started itself answers and serves the prepared model; else `PreflightError`."""
    problems = check_engine(
        url, model_path, "the prepared model", remedy="the engine was started on other weights than this run prepared"
    )
    if problems:
        raise PreflightError(format_problems(problems))


def format_problems(problems: list[str]) -> str:
    noun = "problem" if len(problems) == 1 else "problems"
    return f"preflight found {len(problems)} {noun}:\n" + "\n".join(f"  - {p}" for p in problems)
