"""Sandbox backends through Harbor: config, credentials that are never written anywhere, the retry predicate for
provider capacity errors, and the sandbox-creation gate (a Prefect global concurrency limit in the flows).

Cloud APIs are unreachable here: e2b runs against a local stand-in on 127.0.0.1 (`E2B_API_URL`) that answers
every call with one status, so trials fail at sandbox start exactly as they would against a busy or refusing
provider — enough to test the key's path, the retries and the gate, not a sandbox (tests/system/e2e/ does that).
"""

import asyncio
import importlib
import inspect
import json
import logging
import shutil
import time
from contextlib import asynccontextmanager

import pytest
from harbor.models.environment_type import EnvironmentType
from harbor.models.trial.config import AgentConfig

from grpoflow.config import parse_run_config
from grpoflow.credentials import (
    PROVIDERS,
    CredentialError,
    _e2b_api_base,
    export_sandbox_key,
    read_key_file,
)
from grpoflow.errors import ConfigError
from grpoflow.preflight import missing_extra_packages
from grpoflow.rollout.environments import LOCAL_SANDBOX_IMPORT_PATH, PROVIDER_SANDBOX_FAILURES, is_sandbox_failure_type
from grpoflow.rollout.policy import PolicyAccess
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.step import collect_step
from grpoflow.rollout.trials import plan_group_trials
from tests.fakes.prompts import builtin_prompts
from tests.integration.test_preflight import StandIn

KEY = "e2b_planted_0123456789abcdef"  # what the leak checks look for
# Harbor's e2b environment imports dockerfile-parse (harbor[e2b]) only when a trial builds it.
needs_e2b_extra = pytest.mark.skipif(
    bool(missing_extra_packages("e2b")), reason="harbor[e2b] is not fully installed: pip install 'harbor[e2b]==0.25.0'"
)


def _files_containing(root, needle: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


@pytest.fixture
def e2b_stand_in(monkeypatch):
    """A stand-in e2b API (status set per test via `.default`), the key in a file, no key in the environment."""
    api = StandIn(default=(429, {"code": 429, "message": "rate limit (stand-in)"}))
    monkeypatch.setenv("E2B_API_URL", api.url)
    monkeypatch.delenv("E2B_API_KEY", raising=False)  # also makes monkeypatch undo what export_sandbox_key sets
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    yield api
    api.close()


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(logging.Formatter("%(name)s %(levelname)s %(message)s").format(record))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def all_logs():
    """Every log record at DEBUG of the loggers a run writes to. Attached to each logger itself, not only the root:
    Prefect's logging config stops some from propagating (pytest's caplog sees nothing inside a flow)."""
    names = [
        None,
        "prefect",
        "prefect.flow_runs",
        "prefect.task_runs",
        "harbor",
        "harbor.utils.logger",
        "e2b",
        "httpx",
        "httpcore",
        "grpoflow",
        "test-gate",
    ]
    handler = _Collect()
    saved = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    yield handler
    for logger, level in saved:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "secrets" / "e2b_key"
    path.parent.mkdir()
    path.write_text(KEY + "\n")
    return path


# ---- config -----------------------------------------------------------------------------------------------------


def test_every_harbor_environment_type_is_a_sandbox_choice():
    for t in EnvironmentType:
        assert parse_run_config({"rollout": {"sandbox": {"backend": t.value}}}).rollout.sandbox.backend == t.value
    assert parse_run_config({}).rollout.sandbox.backend == "local"


def test_unknown_sandbox_names_the_field_and_lists_the_choices():
    with pytest.raises(ConfigError) as info:
        parse_run_config({"rollout": {"sandbox": {"backend": "e2c"}}})
    msg = str(info.value)
    assert "field `rollout.sandbox.backend`" in msg and '(got "e2c")' in msg
    choices = msg.split("one of ", 1)[1].split(" (got")[0].split(", ")
    assert {"local", "e2b", "daytona", "modal", "docker"} <= set(choices), msg


@pytest.mark.parametrize(
    "rollout",
    [
        {"sandbox_api_key": KEY},
        {"e2b_api_key": KEY},
        {"sandbox": "e2b", "sandbox_kwargs": {"api_key": KEY}},
        {"sandbox": "daytona", "sandbox_kwargs": {"secrets": {"TOKEN": KEY}}},
    ],
)
def test_credentials_in_the_config_are_refused_without_echoing_them(rollout):
    with pytest.raises(ConfigError) as info:
        parse_run_config({"rollout": rollout})
    msg = str(info.value)
    assert KEY not in msg and "credential" in msg and "rollout.sandbox.api_key_file" in msg


@pytest.mark.parametrize(
    "sandbox, why",
    [
        ("local", "field `rollout.sandbox.api_key_file`: not a setting of rollout.sandbox.backend `local`"),
        ("modal", "does not know which variable sandbox `modal`"),
    ],
)
def test_key_file_only_for_providers_with_a_known_key_variable(sandbox, why):
    with pytest.raises(ConfigError, match=why):
        parse_run_config({"rollout": {"sandbox": {"backend": sandbox, "api_key_file": "/k"}}})


def test_sandbox_config_local_and_harbor_types():
    local = sandbox_config(
        parse_run_config({"rollout": {"sandbox": {"kwargs": {"memory_mb": 512}}}}).rollout, work_dir="/tmp/x"
    )
    assert (local.import_path, local.type, local.kwargs) == (
        LOCAL_SANDBOX_IMPORT_PATH,
        None,
        {"memory_mb": 512, "work_dir": "/tmp/x", "base_images": {}},
    )
    rollout = parse_run_config(
        {"rollout": {"sandbox": {"backend": "e2b", "kwargs": {"sandbox_timeout_secs": 600}}}}
    ).rollout
    e2b = sandbox_config(rollout)
    assert (e2b.type, e2b.import_path, e2b.kwargs) == (EnvironmentType.E2B, None, {"sandbox_timeout_secs": 600})
    assert sandbox_config(rollout, sandbox_timeout_secs=60).kwargs == {"sandbox_timeout_secs": 60}  # call site wins


# ---- credentials --------------------------------------------------------------------------------------------------


def test_export_puts_the_file_key_into_the_environment(key_file):
    env = {"E2B_API_KEY": "older"}
    assert export_sandbox_key("e2b", str(key_file), env) == "E2B_API_KEY"
    assert env == {"E2B_API_KEY": KEY}  # stripped; the run's explicit key file wins over the variable
    env = {"E2B_API_KEY": "from-env"}
    assert export_sandbox_key("e2b", None, env) is None and env == {"E2B_API_KEY": "from-env"}


def test_export_refuses_an_empty_key_file(tmp_path):
    (tmp_path / "k").write_text("  \n")
    env: dict[str, str] = {}
    with pytest.raises(CredentialError, match="is empty: put the E2B_API_KEY value in it"):
        export_sandbox_key("e2b", str(tmp_path / "k"), env)
    assert env == {}
    with pytest.raises(CredentialError, match="no such file"):
        read_key_file(tmp_path / "missing", "E2B_API_KEY")
    with pytest.raises(CredentialError, match="does not know which variable"):
        export_sandbox_key("modal", str(tmp_path / "k"), env)


def test_provider_key_variables_match_harbor():
    # grpoflow's table was read off each environment's preflight(); fail when a Harbor upgrade renames one.
    from harbor.environments.factory import _ENVIRONMENT_REGISTRY

    for sandbox, provider in PROVIDERS.items():
        entry = _ENVIRONMENT_REGISTRY[EnvironmentType(sandbox)]
        try:
            cls = getattr(importlib.import_module(entry.module), entry.class_name)
        except ImportError:  # the provider's SDK is not installed here: its module cannot be read
            continue
        source = inspect.getsource(inspect.getmodule(cls))
        assert provider.key_var in source, f"{sandbox}: {provider.key_var} not in {cls.__module__}"


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"E2B_DOMAIN": "example.org"},
        {"E2B_API_URL": "http://127.0.0.1:9/"},
        {"E2B_DEBUG": "true"},
        {"E2B_DOMAIN": "x.dev", "E2B_API_URL": "http://h:1"},
    ],
)
def test_e2b_api_base_resolves_like_the_sdk(env, monkeypatch):
    from e2b.connection_config import ConnectionConfig

    for var in ("E2B_DOMAIN", "E2B_API_URL", "E2B_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert _e2b_api_base(env)[0] == ConnectionConfig().api_url.rstrip("/")


# ---- the retry predicate -------------------------------------------------------------------------------------------


def test_provider_capacity_and_dead_sandbox_errors_are_sandbox_failures():
    import e2b.exceptions

    for name in PROVIDER_SANDBOX_FAILURES:
        cls = getattr(e2b.exceptions, name)  # the names exist in the installed e2b
        assert is_sandbox_failure_type(name) and is_sandbox_failure_type(type(cls("x")).__name__)
    # Bad credentials or arguments do not heal on retry.
    for name in ("AuthenticationException", "InvalidArgumentException", "SandboxException", "TimeoutException"):
        assert not is_sandbox_failure_type(name)


# ---- e2b through Harbor against the stand-in: retries and the key's path ------------------------------------------


def _e2b_rollout(tmp_path, key_file, retries=1, n=2):
    return parse_run_config(
        {
            "rollout": {
                "n_samples_per_prompt": n,
                "concurrency": 4,
                "sandbox": {
                    "backend": "e2b",
                    "api_key_file": str(key_file),
                    "retries": retries,
                    "retry_backoff_s": 0.01,
                },
            }
        }
    ).rollout


def _collect(tmp_path, rollout):
    export_sandbox_key(rollout.sandbox.backend, rollout.sandbox.api_key_file)
    return asyncio.run(
        collect_step(
            "leak",
            0,
            plan_group_trials(builtin_prompts("hello-file"), 0, rollout.n_samples_per_prompt, 0),
            rollout,
            PolicyAccess(lambda spec: AgentConfig(name="oracle")),
            sandbox_config(rollout),
            tmp_path / "run" / "trials",
            tmp_path / "run" / "details",
        )
    )


@needs_e2b_extra
def test_rate_limited_starts_are_retried_and_the_key_goes_only_to_the_provider(
    tmp_path, key_file, e2b_stand_in, all_logs, capfd
):
    res = _collect(tmp_path, _e2b_rollout(tmp_path, key_file, retries=1))
    for s in res.samples:
        assert (s.status, s.exit_status, s.reward) == ("FAILED", "SandboxError", None)
        assert "RateLimitException" in s.exit_reason and "after 1 retries" in s.exit_reason
    assert res.figures.computed["retries"] == 2  # each of the 2 trials ran again in a fresh sandbox
    assert len(list((tmp_path / "run" / "trials").iterdir())) == 4
    # The key reached the provider (through the process environment, where e2b's SDK reads it) ...
    assert e2b_stand_in.requests and all(h.get("x-api-key") == KEY for _, _, h in e2b_stand_in.requests)
    # ... and nothing else: no trial file (Harbor's config.json/result.json carry the environment kwargs), no trace,
    # no log line, no output.
    assert _files_containing(tmp_path / "run", KEY) == []
    out = capfd.readouterr()
    assert "RateLimitException" in all_logs.text  # the capture works: it saw the retries
    assert KEY not in all_logs.text and KEY not in out.out and KEY not in out.err


@needs_e2b_extra
def test_refused_credentials_are_final_not_retried(tmp_path, key_file, e2b_stand_in):
    e2b_stand_in.default = (401, {"code": 401, "message": "Invalid API key"})
    res = _collect(tmp_path, _e2b_rollout(tmp_path, key_file, retries=3, n=1))
    [s] = res.samples
    assert s.status == "FAILED" and s.exit_reason.startswith("AuthenticationException")
    assert res.figures.computed["retries"] == 0 and len(e2b_stand_in.requests) == 1


# ---- the sandbox-creation gate ---------------------------------------------------------------------------------------


class CountingGate:
    """A `SandboxGate` of `limit` slots that records how many are held."""

    def __init__(self, limit: int):
        self.limit, self.held, self.max_held, self.entered = limit, 0, 0, 0
        self._sem: asyncio.Semaphore | None = None

    def __call__(self):
        @asynccontextmanager
        async def slot():
            self._sem = self._sem or asyncio.Semaphore(self.limit)
            async with self._sem:
                self.held += 1
                self.entered += 1
                self.max_held = max(self.max_held, self.held)
                try:
                    yield
                finally:
                    self.held -= 1

        return slot()


def _overlap(intervals) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_gate_bounds_sandbox_starts_but_not_the_trials(tmp_path):
    gate = CountingGate(limit=1)
    cfg = parse_run_config({"rollout": {"n_samples_per_prompt": 2, "concurrency": 4}})
    res = asyncio.run(
        collect_step(
            "g",
            0,
            plan_group_trials(builtin_prompts("hello-file", "make-dir"), 0, cfg.rollout.n_samples_per_prompt, 0),
            cfg.rollout,
            PolicyAccess(
                lambda spec: AgentConfig(
                    import_path="tests.integration.sandbox.sandbox_test_agents:SleepAgent", kwargs={"marker": "2"}
                )
            ),
            sandbox_config(cfg.rollout, work_dir=str(tmp_path)),
            tmp_path / "trials",
            tmp_path / "details",
            sandbox_gate=gate,
        )
    )
    assert all(s.exit_status == "Submitted" for s in res.samples)
    assert (gate.entered, gate.max_held, gate.held) == (4, 1, 0)  # one start at a time; every slot given back
    # The slot is given back when the agent starts: agents (2 s each) of different trials ran side by side.
    results = [json.loads(p.read_text()) for p in (tmp_path / "trials").glob("*/result.json")]
    runs = [(r["agent_execution"]["started_at"], r["agent_execution"]["finished_at"]) for r in results]
    assert len(runs) == 4 and _overlap(runs) >= 2


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_a_failing_gate_fails_the_trial_without_retry(tmp_path):
    def broken_gate():
        @asynccontextmanager
        async def slot():
            raise RuntimeError("concurrency service down")
            yield

        return slot()

    cfg = parse_run_config({"rollout": {"n_samples_per_prompt": 1, "sandbox": {"retries": 2}}})
    res = asyncio.run(
        collect_step(
            "g",
            0,
            plan_group_trials(builtin_prompts("hello-file"), 0, cfg.rollout.n_samples_per_prompt, 0),
            cfg.rollout,
            PolicyAccess(lambda spec: AgentConfig(name="oracle")),
            sandbox_config(cfg.rollout, work_dir=str(tmp_path)),
            tmp_path / "trials",
            tmp_path / "details",
            sandbox_gate=broken_gate,
        )
    )
    [s] = res.samples
    assert s.status == "FAILED" and "RuntimeError: concurrency service down" in s.exit_reason
    assert res.figures.computed["retries"] == 0


# ---- Prefect: the global concurrency limit, and the flows end to end ------------------------------------------------


@pytest.fixture(scope="module")
def prefect_server():
    from tests.fakes.prefect_server import temporary_prefect_server

    with temporary_prefect_server():
        yield


async def _limit(name):
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return await client.read_global_concurrency_limit_by_name(name)


async def _create_limit(name, limit):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    async with get_client() as client:
        await client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))


@pytest.mark.flow
def test_prefect_gate_takes_a_slot_of_the_named_limit(prefect_server, all_logs):
    from tasks.rollout import sandbox_create_gate

    log = logging.getLogger("test-gate")

    async def go():
        assert await sandbox_create_gate(None, log) is None
        assert await sandbox_create_gate("no-such-limit", log) is None
        n_said = all_logs.text.count("no global concurrency limit `no-such-limit`")
        assert await sandbox_create_gate("no-such-limit", log) is None  # the next step: not said again
        assert all_logs.text.count("no global concurrency limit `no-such-limit`") == n_said >= 1
        await _create_limit("gate-test", 2)
        gate = await sandbox_create_gate("gate-test", log)
        async with gate():
            held = (await _limit("gate-test")).active_slots
        return held, (await _limit("gate-test")).active_slots

    assert asyncio.run(go()) == (1, 0)
    assert "no global concurrency limit `no-such-limit`" in all_logs.text


@pytest.mark.flow
def test_cli_preflight_fails_first_listing_what_to_set(prefect_server, tmp_path, capfd, e2b_stand_in):
    from flows.cli import main

    rc = main(["train", "--output-dir", str(tmp_path), "--run-id", "pf-1", "--set", "rollout.sandbox.backend=e2b"])
    err = capfd.readouterr().err
    assert rc == 2 and "preflight found 1 problem:" in err
    assert "rollout.sandbox.backend=e2b needs an API key: set E2B_API_KEY" in err
    assert not (tmp_path / "pf-1").exists()  # failed before anything was prepared


@needs_e2b_extra
@pytest.mark.flow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")  # not for trials: prompts' tools
def test_train_flow_on_e2b_writes_the_key_nowhere(
    prefect_server, tmp_path, tiny_model_dir, key_file, e2b_stand_in, all_logs, capfd
):
    from flows.train import train_flow

    asyncio.run(_create_limit("sandbox-create", 1))
    cfg = parse_run_config(
        {
            "run_id": "leak-1",
            "output_dir": str(tmp_path / "runs"),
            "model": {"source": str(tiny_model_dir)},
            "dataset": {"path": "builtin-fixed"},
            "rollout": {
                "prompts_per_step": 1,
                "n_samples_per_prompt": 2,
                "sandbox": {"backend": "e2b", "api_key_file": str(key_file), "retries": 1, "retry_backoff_s": 0.01},
            },
            "train": {"steps": 1, "eval": {"samples_per_prompt": 0}},
        }
    )
    t0 = time.perf_counter()
    record = train_flow(cfg)
    root = tmp_path / "runs" / "leak-1"
    assert record["rollout/trials"] == 2 and record["rollout/retries"] == 2 and record["rollout/scored"] == 0
    assert e2b_stand_in.requests and all(
        h.get("x-api-key") == KEY for _, _, h in e2b_stand_in.requests if h.get("x-api-key")
    )  # (preflight's probe sends none)
    assert asyncio.run(_limit("sandbox-create")).active_slots == 0  # every slot given back
    assert "key_file" in (root / "config.json").read_text()  # the path is recorded; the key is not
    assert _files_containing(root, KEY) == []
    out = capfd.readouterr()
    # The capture works: it holds the task's retry warnings (which name the provider's error) and Harbor's logs.
    assert "prefect.task_runs WARNING sandbox failure in" in all_logs.text and "RateLimitException" in all_logs.text
    assert "harbor.utils.logger" in all_logs.text
    assert KEY not in all_logs.text and KEY not in out.out and KEY not in out.err
    assert time.perf_counter() - t0 < 300
