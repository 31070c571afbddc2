"""grpoflow's one engine client against SGLang's API: the SGLang stand-in and the embedded engine, same cases.

Each case runs twice: against the stand-in's scripted model, and against the embedded engine (tiny model) with
the stand-in relaying in front of it, so scripted faults hit both the same way. Cases that inject no fault talk
to the embedded engine directly. Then the `sglang-launch` backend: a fake SGLang interpreter that runs the
stand-in as `python -m sglang.launch_server`, started, used and stopped through `open_engine`.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from grpoflow.config import SglangLaunch, parse_run_config
from grpoflow.engine.backends import open_engine
from grpoflow.engine.launch import start_embedded_engine
from grpoflow.engine.protocol import SamplingParams
from grpoflow.engine.sglang_launch import launch_settings, sglang_command, start_sglang_server
from grpoflow.errors import ConfigError, EngineError
from tests.fakes.chat_client import ChatClient
from tests.fakes.proc import alive
from tests.fakes.sglang_standin import StandinServer

STANDIN = Path(__file__).resolve().parents[2] / "fakes" / "sglang_standin.py"
TIMEOUT_S = 1.5  # client timeout in fault cases; a `slow` fault answers after twice that
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


@dataclass
class Target:
    name: str
    front: StandinServer  # faults are injected here
    direct_url: str  # the backend itself (== front.url for the stand-in)
    model_dir: Path

    def client(
        self, *, direct: bool = False, retries: int = 2, timeout: float = 30.0, min_decode_tok_s: float = 0.0
    ) -> ChatClient:
        url = self.direct_url if direct else self.front.url
        return ChatClient(url, timeout=timeout, retries=retries, backoff_s=0.01, min_decode_tok_s=min_decode_tok_s)


@pytest.fixture(scope="module")
def embedded_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # Its own engine process (not the session's shared scheduler): these cases change its weight version.
    log = tmp_path_factory.mktemp("embedded") / "engine.log"
    with start_embedded_engine(tiny_model_dir, threads=1, max_batch_size=4, log_path=log) as engine:
        yield engine.url


@pytest.fixture(params=["standin", "embedded"])
def target(request, tiny_model_dir: Path) -> Iterator[Target]:
    if request.param == "standin":
        with StandinServer(str(tiny_model_dir), served_model_name="tiny") as front:
            yield Target("standin", front, front.url, tiny_model_dir)
    else:
        url = request.getfixturevalue("embedded_url")
        with StandinServer(str(tiny_model_dir), upstream=url) as front:
            yield Target("embedded", front, url, tiny_model_dir)


# --- the API, no faults -----------------------------------------------------------------------------------------


def test_generate_answers_in_sglang_shape(target: Target):
    with target.client(direct=True) as c:
        resp = c.generate([5, 6, 7, 8], GREEDY)
    meta = resp.meta_info
    assert len(resp.output_ids) == 6 and meta.completion_tokens == 6 and meta.prompt_tokens == 4
    assert meta.finish_reason.type == "length" and meta.finish_reason.length == 6
    assert [t for _, t, _ in meta.output_token_logprobs] == resp.output_ids
    assert len(resp.logprobs) == 6 and all(lp <= 0 for lp in resp.logprobs)


def test_greedy_and_seeded_requests_repeat(target: Target):
    seeded = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=11, ignore_eos=True)
    with target.client(direct=True) as c:
        assert c.generate([9, 10], GREEDY).output_ids == c.generate([9, 10], GREEDY).output_ids
        assert c.generate([9, 10], seeded).output_ids == c.generate([9, 10], seeded).output_ids


def test_stop_token_ends_generation_and_is_kept(target: Target):
    with target.client(direct=True) as c:
        full = c.generate([3, 4, 5], GREEDY).output_ids
        stop = full[2]
        # without ignore_eos: SGLang's ignore_eos switches stop_token_ids off too
        cut = c.generate([3, 4, 5], GREEDY.model_copy(update={"stop_token_ids": [stop], "ignore_eos": False}))
    k = full.index(stop)
    assert cut.output_ids == full[: k + 1]
    assert cut.meta_info.finish_reason.type == "stop" and cut.meta_info.finish_reason.matched == stop


def test_weight_update_from_disk_sets_the_version(target: Target, tmp_path: Path):
    version = f"v-{target.name}-{time.monotonic_ns()}"
    with target.client(direct=True) as c:
        resp = c.update_weights_from_disk(str(target.model_dir), weight_version=version)
        assert resp.success
        assert c.model_info().weight_version == version
        assert c.generate([1, 2], GREEDY).meta_info.weight_version == version
        with pytest.raises(EngineError, match="update_weights_from_disk: failed: .*"):
            c.update_weights_from_disk(str(tmp_path / "no-such-checkpoint"))


def test_health_and_model_info(target: Target):
    with target.client(direct=True) as c:
        assert c.health()
        info = c.model_info()
    assert info.model_path == str(target.model_dir) and info.is_generation


def test_chat_completion_returns_token_ids_and_logprobs(target: Target):
    with target.client(direct=True) as c:
        resp = c.chat_completions(
            [{"role": "user", "content": "list files"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            return_token_ids=True,
        )
    choice = resp.choices[0]
    assert 1 <= len(choice.token_ids) <= 4 and choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens == len(choice.token_ids)
    assert len(resp.prompt_token_ids) == resp.usage.prompt_tokens
    assert len(choice.logprobs.content) == len(choice.token_ids)


def test_v1_models_lists_one_model_card(target: Target):
    body = httpx.get(target.direct_url + "/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["object"] == "model" and card["id"] and card["max_model_len"] > 0


def test_bad_request_is_a_4xx_and_not_retried(target: Target):
    with target.client() as c, pytest.raises(EngineError, match="/v1/chat/completions: HTTP 400"):
        c.chat_completions([{"role": "user", "content": "hi"}], n=0)
    assert target.front.count("/v1/chat/completions") == 1


# --- faults -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["5xx", "drop"])
def test_transient_fault_is_retried_then_succeeds(target: Target, kind: str):
    target.front.faults.inject(kind, times=2, delay_s=2 * TIMEOUT_S)
    with target.client(retries=2, timeout=TIMEOUT_S) as c:
        resp = c.generate([1, 2, 3], GREEDY)
    assert len(resp.output_ids) == 6
    assert target.front.count("/generate") == 3  # two faulted attempts, then the answer


@pytest.mark.parametrize("kind, error", [("5xx", r"_Retryable: HTTP 503"), ("drop", "RemoteProtocolError")])
def test_persistent_fault_fails_naming_url_attempts_and_cause(target: Target, kind: str, error: str):
    target.front.faults.inject(kind, times=None, delay_s=2 * TIMEOUT_S)
    url = target.front.url
    with target.client(retries=2, timeout=TIMEOUT_S) as c:
        with pytest.raises(EngineError, match=rf"^POST {url}/generate failed after 3 attempts: {error}"):
            c.generate([1, 2, 3], GREEDY)
    assert target.front.count("/generate") == 3


def test_a_generation_slower_than_the_request_timeout_gets_time_for_its_tokens(target: Target):
    """The answer comes after twice `request_timeout_s`, within the allowance for its 6 tokens: one request."""
    target.front.faults.inject("slow", times=1, delay_s=2 * TIMEOUT_S)
    with target.client(retries=2, timeout=TIMEOUT_S, min_decode_tok_s=6 / (2 * TIMEOUT_S)) as c:
        assert c.generation_timeout(6) == 3 * TIMEOUT_S
        resp = c.generate([1, 2, 3], GREEDY)
    assert len(resp.output_ids) == 6 and target.front.count("/generate") == 1

    # a trial's async request tells its caller, while it waits, that the engine is slow (an agent whose time ran
    # out meanwhile ran out on the engine), and that it answered in the end
    target.front.faults.inject("slow", times=1, delay_s=2 * TIMEOUT_S)
    faults: list[str] = []

    async def run():
        client = target.client(retries=2, timeout=TIMEOUT_S, min_decode_tok_s=6 / (2 * TIMEOUT_S))
        try:
            return await client.agenerate([1, 2, 3], GREEDY, on_fault=faults.append), client.outage
        finally:
            await client.aclose()

    resp, outage = asyncio.run(run())
    assert len(resp.output_ids) == 6 and target.front.count("/generate") == 2 and outage is None
    assert faults == [f"POST {target.front.url}/generate: no answer after 2 s (still waiting)"]


def test_a_generation_past_its_timeout_is_not_re_sent(target: Target):
    """The engine held it the whole time: another try would decode it again, so it fails at once (a trial
    records it as an infrastructure fault)."""
    target.front.faults.inject("slow", times=None, delay_s=2 * TIMEOUT_S)
    with target.client(retries=2, timeout=TIMEOUT_S) as c, pytest.raises(EngineError) as raised:
        c.generate([1, 2, 3], GREEDY)
    assert type(raised.value).__name__ == "EngineUnavailableError"
    assert "/generate: a generation got no answer within its 2 s (ReadTimeout" in str(raised.value)
    assert "not re-sent" in str(raised.value) and target.front.count("/generate") == 1

    async def run():  # a trial's async request, which otherwise waits an outage out
        client = ChatClient(target.front.url, timeout=TIMEOUT_S, retries=2, backoff_s=0.01, outage_s=60)
        try:
            return await client.agenerate([1, 2, 3], GREEDY)
        finally:
            await client.aclose()

    with pytest.raises(EngineError, match="not re-sent"):
        asyncio.run(run())
    assert target.front.count("/generate") == 2


def test_malformed_json_fails_at_once_naming_the_endpoint(target: Target):
    target.front.faults.inject("malformed_json", times=None)
    with target.client() as c, pytest.raises(EngineError, match=r"^/generate: malformed response \(not JSON"):
        c.generate([1, 2, 3], GREEDY)
    assert target.front.count("/generate") == 1  # a malformed answer is a bug to see, not a fault to retry


@pytest.mark.parametrize(
    "path, field", [("/generate", "meta_info.finish_reason"), ("/v1/chat/completions", "choices.0.finish_reason")]
)
def test_missing_finish_reason_names_the_field(target: Target, path: str, field: str):
    target.front.faults.inject("missing_finish_reason", times=None, path=path)
    expected = rf"^{path}: malformed response: {field}: Field required"
    with target.client() as c, pytest.raises(EngineError, match=expected):
        if path == "/generate":
            c.generate([1, 2, 3], GREEDY)
        else:
            c.chat_completions([{"role": "user", "content": "hi"}], max_tokens=2)


def test_async_client_retries_the_same_faults(target: Target):
    target.front.faults.inject("5xx", times=1, status=502)
    target.front.faults.inject("drop", times=1)

    async def run():
        client = target.client(retries=2, timeout=TIMEOUT_S)
        try:
            return await client.agenerate([1, 2, 3], GREEDY)
        finally:
            await client.aclose()

    assert len(asyncio.run(run()).output_ids) == 6
    assert target.front.count("/generate") == 3


# --- backend `sglang-launch` with a fake SGLang interpreter ------------------------------------------------------


@pytest.fixture
def fake_sglang_python(tmp_path: Path) -> str:
    """An executable that behaves like an SGLang venv's python for `-m sglang.launch_server ARGS` only."""
    py = tmp_path / "sglang-venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ]; then\n'
        "  shift 2\n"
        f'  exec {shlex.quote(sys.executable)} {shlex.quote(str(STANDIN))} "$@"\n'
        "fi\n"
        'echo "fake SGLang python: only -m sglang.launch_server is supported, got: $*" >&2\n'
        "exit 2\n"
    )
    py.chmod(0o755)
    return str(py)


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):  # a zombie waiting for its reaper counts as gone
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_launch_health_generate_stop(fake_sglang_python, tiny_model_dir, tmp_path, monkeypatch):
    # Refused connections while "loading", then 503 from /health while "starting": the wait must ride both out.
    monkeypatch.setenv("STANDIN_LOAD_S", "0.5")
    monkeypatch.setenv("STANDIN_WARMUP_S", "1.0")
    cfg = SglangLaunch.model_validate(
        {
            "backend": "sglang-launch",
            "sglang": {"python": fake_sglang_python, "args": ["--context-length", "1024"]},
            "tp_size": 2,
            "launch": {"mem_fraction_static": 0.55, "startup_timeout_s": 60},
        }
    )
    log = tmp_path / "run" / "engine.log"
    with open_engine(cfg, str(tiny_model_dir), seed=0, log_path=log) as engine:
        assert engine.url.startswith("http://127.0.0.1:")
        resp = engine.client.generate([1, 2, 3], GREEDY)
        assert len(resp.output_ids) == 6
        assert engine.client.update_weights_from_disk(str(tiny_model_dir), weight_version="1").success
        info = httpx.get(engine.url + "/get_server_info").json()
        assert (info["tp_size"], info["mem_fraction_static"], info["context_length"]) == (2, 0.55, 1024)
        assert info["host"] == "127.0.0.1" and engine.url.endswith(f":{info['port']}")
        pid, child = info["standin_pid"], info["standin_child_pid"]
        # one group, led by the lifeline the server runs behind, the "scheduler" in it
        lead = os.getpgid(pid)
        assert os.getpgid(child) == lead != pid and b"lifeline.py" in Path(f"/proc/{lead}/cmdline").read_bytes()
    # Zombies count as gone: the orphaned child is reaped by whoever is init here, maybe not at once.
    assert _wait_gone(pid) and _wait_gone(child), "the server or its child outlived the block"
    text = log.read_text()
    assert "grpoflow: starting " in text and "-m sglang.launch_server --model-path" in text
    assert "The server is fired up and ready to roll!" in text


def test_a_cpu_launch_passes_sglangs_cpu_flags_and_environment(fake_sglang_python, tiny_model_dir, tmp_path):
    cfg = SglangLaunch.model_validate(
        {
            "backend": "sglang-launch",
            "sglang": {"python": fake_sglang_python},
            "launch": {"device": "cpu", "startup_timeout_s": 60},
        }
    )
    with open_engine(cfg, str(tiny_model_dir), seed=7, log_path=tmp_path / "engine.log") as engine:
        info = httpx.get(engine.url + "/get_server_info").json()
    assert {k: info[k] for k in ("device", "attention_backend", "max_total_tokens", "random_seed")} == {
        "device": "cpu",
        "attention_backend": "torch_native",
        "max_total_tokens": 16384,
        "random_seed": 7,
    }
    assert info["sleep_on_idle"] and info["use_cpu_engine"] == "1" and not info["enable_deterministic_inference"]
    gpu = SglangLaunch.model_validate(
        {"backend": "sglang-launch", "sglang": {"python": "/p", "max_total_tokens": 4096, "args": ["--x"]}}
    )
    assert launch_settings(gpu, seed=3) == (["--random-seed", "3", "--max-total-tokens", "4096", "--x"], {})


def test_launch_command_uses_sglang_flag_names():
    cmd = sglang_command(
        "/opt/sglang/bin/python",
        "/m",
        31000,
        tp_size=4,
        mem_fraction_static=0.7,
        extra_args=["--context-length", "32768"],
    )
    assert cmd == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tp-size",
        "4",
        "--mem-fraction-static",
        "0.7",
        "--context-length",
        "32768",
    ]


def test_server_dying_at_startup_reports_code_and_log_tail(fake_sglang_python, tiny_model_dir, tmp_path):
    with pytest.raises(EngineError, match=r"(?s)exited with code 2 during startup.*unrecognized arguments: --bogus"):
        start_sglang_server(
            fake_sglang_python, tiny_model_dir, extra_args=["--bogus"], log_path=tmp_path / "a.log", startup_timeout=60
        )
    with pytest.raises(EngineError, match=r"(?s)exited with code 1 during startup.*no-model is not a local folder"):
        start_sglang_server(fake_sglang_python, tmp_path / "no-model", log_path=tmp_path / "b.log", startup_timeout=60)


def test_server_never_healthy_is_stopped_and_reported(fake_sglang_python, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_WARMUP_S", "600")
    tag = f"never-healthy-{os.getpid()}-{time.monotonic_ns()}"  # finds this server's processes in /proc
    with pytest.raises(EngineError, match=r"(?s)not healthy after 2s; log .*ready to roll"):
        start_sglang_server(
            fake_sglang_python,
            tiny_model_dir,
            extra_args=["--served-model-name", tag],
            log_path=tmp_path / "c.log",
            startup_timeout=2,
        )
    assert all(_wait_gone(pid) for pid in _pids_with(tag)), "the timed-out server was left running"


def _pids_with(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:  # the process ended while we looked
            continue
    return pids


def test_missing_sglang_python_is_a_clear_error(tiny_model_dir, tmp_path):
    with pytest.raises(EngineError, match=r"engine.sglang.python .*/nope/python: no such executable"):
        start_sglang_server(str(tmp_path / "nope" / "python"), tiny_model_dir)


@pytest.mark.parametrize(
    "engine, message",
    [
        ({"backend": "sglang-launch"}, "`engine.sglang.python`: required"),
        (
            {"backend": "sglang-launch", "sglang": {"python": "/p"}, "url": "http://h:1"},
            "`engine.url`: not a setting of engine.backend `sglang-launch`",
        ),
        (
            {"backend": "sglang-launch", "sglang": {"python": "/p", "args": ["--port=9"]}},
            "`engine.sglang.args`: .*--port=9 is set by grpoflow",
        ),
        (
            {"backend": "sglang-launch", "sglang": {"python": "/p", "args": ["--tp", "2"]}},
            "`engine.sglang.args`: .*--tp is set by grpoflow",
        ),
        (
            {"backend": "sglang-launch", "sglang": {"python": "/p", "args": ["--random-seed", "2"]}},
            "`engine.sglang.args`: .*--random-seed is set by",
        ),
        (
            {"backend": "sglang-launch", "sglang": {"python": "/p", "args": ["--device=cpu"]}},
            "`engine.sglang.args`: .*--device=cpu is set by grpoflow",
        ),
        (
            {
                "backend": "sglang-launch",
                "sglang": {"python": "/p"},
                "launch": {"device": "cpu"},
                "deterministic": True,
            },
            "`engine.deterministic`: SGLang's deterministic inference needs a GPU attention backend",
        ),
        ({"retries": -1}, "`engine.retries`"),
    ],
)
def test_engine_config_refuses_bad_launch_settings(engine, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config({"engine": engine})


def test_engine_config_accepts_a_launch_recipe():
    engine = {
        "backend": "sglang-launch",
        "sglang": {"python": "/opt/sglang-venv/bin/python", "args": ["--context-length", "32768"]},
        "tp_size": 2,
        "retries": 5,
    }
    cfg = parse_run_config({"engine": engine})
    assert cfg.engine.retries == 5 and cfg.engine.tp_size == 2
