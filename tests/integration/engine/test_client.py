"""EngineClient against a scripted HTTP server: retries, malformed answers, unreachable servers."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpoflow.engine.client import EngineClient, SglangClient
from grpoflow.engine.vllm_client import VllmClient
from grpoflow.errors import EngineError

GOOD = {
    "text": "hi",
    "output_ids": [5, 6],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "weight_version": "default",
        "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]],
    },
}


class _Script:
    """Answers to hand out in order (status, body bytes); the last one repeats. Records request bodies."""

    def __init__(self, answers: list[tuple[int, bytes]]):
        self.answers = answers
        self.requests: list[dict] = []

    def next(self) -> tuple[int, bytes]:
        return self.answers[min(len(self.requests) - 1, len(self.answers) - 1)]


@contextmanager
def scripted_server(*answers: tuple[int, object]) -> Iterator[tuple[str, _Script]]:
    script = _Script([(s, b if isinstance(b, bytes) else json.dumps(b).encode()) for s, b in answers])

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            script.requests.append({"path": self.path, "body": json.loads(body) if body else None})
            status, payload = script.next()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", script
    finally:
        server.shutdown()
        server.server_close()


def _client(url: str, retries: int = 2) -> EngineClient:
    return SglangClient(url, timeout=5.0, retries=retries, backoff_s=0.01)


def test_retries_5xx_then_succeeds():
    with scripted_server((500, {"message": "boom"}), (503, b"busy"), (200, GOOD)) as (url, script):
        resp = _client(url).generate([1, 2, 3])
    assert len(script.requests) == 3
    assert resp.output_ids == [5, 6] and resp.logprobs == [-0.5, -1.5]


def test_gives_up_after_retries_naming_the_url():
    with scripted_server((500, {"message": "kaputt"})) as (url, script):
        with pytest.raises(EngineError, match=rf"POST {url}/generate failed after 3 attempts: .*500.*kaputt"):
            _client(url, retries=2).generate([1])
    assert len(script.requests) == 3


def test_4xx_is_not_retried():
    with scripted_server((400, {"object": "error", "message": "top_p too big"})) as (url, script):
        with pytest.raises(EngineError, match="/generate: HTTP 400 .*top_p too big"):
            _client(url).generate([1])
    assert len(script.requests) == 1


def test_malformed_json_names_the_endpoint():
    with scripted_server((200, b"{not json")) as (url, _):
        with pytest.raises(EngineError, match=r"^/generate: malformed response \(not JSON"):
            _client(url).generate([1])


def test_missing_finish_reason_names_the_field():
    bad = json.loads(json.dumps(GOOD))
    del bad["meta_info"]["finish_reason"]
    with scripted_server((200, bad)) as (url, _):
        with pytest.raises(
            EngineError, match="^/generate: malformed response: meta_info.finish_reason: Field required"
        ):
            _client(url).generate([1])


def test_aborted_generation_raises():
    aborted = json.loads(json.dumps(GOOD))
    aborted["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort before prefill"}
    with scripted_server((200, aborted)) as (url, _):
        with pytest.raises(EngineError, match="aborted: Abort before prefill"):
            _client(url).generate([1])


def test_connection_refused_is_retried_then_raises():
    with socket.socket() as s:  # a port that was free a moment ago, with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(EngineError, match=rf"GET {url}/model_info failed after 2 attempts: ConnectError"):
        _client(url, retries=1).model_info()
    assert _client(url).health() is False


def test_failed_weight_update_raises_with_server_message():
    body = {"success": False, "message": "Failed to load weights: no such dir", "num_paused_requests": 0}
    with scripted_server((400, body)) as (url, script):
        with pytest.raises(EngineError, match="update_weights_from_disk: failed: Failed to load weights"):
            _client(url).update_weights_from_disk("/x", weight_version="3")
    assert script.requests[0]["body"] == {"model_path": "/x", "weight_version": "3", "flush_cache": True}


def test_request_body_has_sglang_shape():
    from grpoflow.engine.protocol import SamplingParams

    with scripted_server((200, GOOD)) as (url, script):
        _client(url).generate([1, 2], SamplingParams(max_new_tokens=4, temperature=0.5, sampling_seed=9))
    assert script.requests[0] == {
        "path": "/generate",
        "body": {
            "input_ids": [1, 2],
            "sampling_params": {
                "max_new_tokens": 4,
                "temperature": 0.5,
                "top_p": 1.0,
                "top_k": -1,
                "ignore_eos": False,
                "sampling_seed": 9,
            },
            "return_logprob": True,
            "stream": False,
        },
    }


def test_async_methods_retry_and_validate():
    async def run() -> None:
        with scripted_server((502, b"bad gateway"), (200, GOOD)) as (url, script):
            client = _client(url)
            resp = await client.agenerate([1])
            await client.aclose()
        assert len(script.requests) == 2 and resp.meta_info.finish_reason.type == "length"
        with scripted_server((200, {"text": "x"})) as (url, _):
            with pytest.raises(EngineError, match="^/generate: malformed response: output_ids: Field required"):
                await _client(url).agenerate([1])

    asyncio.run(run())


# vLLM's answers, in the shapes vLLM 0.32 sends (`grpoflow.engine.protocol`, vLLM section); the live lane
# (tests/engines/) asks the real server.
VLLM_VERSION = {"weight_version": "3"}


def _vllm_completion(finish: str, stop_reason=None, ids=(5, 6)) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "prompt_token_ids": [1, 2],
                "token_ids": list(ids),
                "logprobs": {"token_logprobs": [-0.5, -1.5][: len(ids)], "tokens": ["a", "b"][: len(ids)]},
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": len(ids), "total_tokens": 2 + len(ids)},
    }


def test_a_vllm_generation_is_a_completion_of_token_ids_answered_as_sglang_does():
    from grpoflow.engine.protocol import SamplingParams

    params = SamplingParams(max_new_tokens=4, temperature=0.5, sampling_seed=9, stop=["\n"], stop_token_ids=[7])
    with scripted_server((200, VLLM_VERSION), (200, _vllm_completion("stop", "\n"))) as (url, script):
        resp = VllmClient(url, timeout=5.0, retries=0).generate([1, 2], params)
    assert [r["path"] for r in script.requests] == ["/weight_info", "/v1/completions"]
    assert script.requests[1]["body"] == {
        "prompt": [1, 2],
        "max_tokens": 4,
        "temperature": 0.5,
        "top_p": 1.0,
        "ignore_eos": False,
        "return_token_ids": True,
        "skip_special_tokens": True,
        "stop": ["\n"],
        "stop_token_ids": [7],
        "seed": 9,
        "logprobs": 0,
    }
    assert resp.output_ids == [5, 6] and resp.logprobs == [-0.5, -1.5] and resp.text == "hi"
    meta = resp.meta_info
    assert meta.finish_reason.model_dump(exclude_none=True) == {"type": "stop", "matched": "\n"}
    assert meta.weight_version == "3" and meta.prompt_tokens == 2 and meta.completion_tokens == 2


@pytest.mark.parametrize(
    "finish, stop_reason, expected",
    [
        ("length", None, {"type": "length", "length": 2}),
        ("stop", None, {"type": "stop", "matched": 6}),  # EOS: vLLM names none; SGLang names its id
        ("stop", 7, {"type": "stop", "matched": 7}),
    ],
)
def test_vllm_finish_reasons_read_as_sglangs(finish, stop_reason, expected):
    with scripted_server((200, VLLM_VERSION), (200, _vllm_completion(finish, stop_reason))) as (url, _):
        resp = VllmClient(url, timeout=5.0, retries=0).generate([1, 2])
    assert resp.meta_info.finish_reason.model_dump(exclude_none=True) == expected


def test_vllm_ignore_eos_switches_off_the_stop_tokens_too_and_an_abort_raises():
    """SGLang's ignore_eos switches off every token stop; vLLM's only the EOS, so the client leaves them out."""
    from grpoflow.engine.protocol import SamplingParams

    params = SamplingParams(ignore_eos=True, stop_token_ids=[7])
    with scripted_server((200, VLLM_VERSION), (200, _vllm_completion("abort"))) as (url, script):
        with pytest.raises(EngineError, match="was aborted"):
            VllmClient(url, timeout=5.0, retries=0).generate([1, 2], params, return_logprob=False)
    body = script.requests[1]["body"]
    assert "stop_token_ids" not in body and body["ignore_eos"] is True and "logprobs" not in body


def test_a_vllm_disk_load_pauses_reloads_labels_and_resumes(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with scripted_server((200, {"status": "ok"})) as (url, script):
        VllmClient(url, timeout=5.0, retries=0).update_weights_from_disk(str(tmp_path), "4")
    assert [(r["path"], r["body"]) for r in script.requests] == [
        ("/pause?mode=wait", None),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}),
        ("/update_weight_version", {"new_version": "4"}),
        ("/resume", None),
    ]


def test_a_failed_vllm_reload_resumes_generation_and_raises_with_vllms_reason(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    answers = [(200, {}), (500, {"error": "Worker failed with error 'bad shape'"}), (200, {})]
    with scripted_server(*answers) as (url, script):
        with pytest.raises(EngineError, match=r"/update_weights_from_disk: failed: vLLM reload_weights.*bad shape"):
            VllmClient(url, timeout=5.0, retries=0).update_weights_from_disk(str(tmp_path), "4")
    assert [r["path"] for r in script.requests] == ["/pause?mode=wait", "/collective_rpc", "/resume"]
