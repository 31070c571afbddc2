"""A stand-in for an SGLang server: SGLang's HTTP endpoints and answer shapes over a scripted model, plus faults
on demand. Tests run grpoflow's one engine client against it, because SGLang itself needs CUDA and its own
environment (no CPU install from the registry).

    python tests/fakes/sglang_standin.py --model-path DIR [--host 127.0.0.1] [--port 30000] [--tp-size N]
        [--mem-fraction-static F] [--served-model-name NAME] [--context-length N] [--log-level LEVEL]

The command line takes `python -m sglang.launch_server`'s names (python/sglang/srt/server_args.py
`ServerArgs.add_cli_args`: `--model-path`/`--model`, `--tensor-parallel-size`/`--tp-size` (`--tp` reaches it by
argparse's prefix matching), host default 127.0.0.1, port default 30000) and, like SGLang's argparse, refuses flags it does not know (exit 2). As SGLang
does, it starts a child process (SGLang's scheduler/detokenizer run as subprocesses), so a launcher that stops only
the parent leaves it behind. Env knobs for launch tests: `STANDIN_LOAD_S` (seconds before the port is bound, as
while SGLang loads weights) and `STANDIN_WARMUP_S` (seconds `/health` answers 503, as SGLang's `ServerStatus.Starting`).

Endpoints and shapes, from sgl-project/sglang `python/sglang/srt/entrypoints/http_server.py` (read at commits
9c0549b7 and 0025436e, and a later annotated copy):
- `GET /health` (and `/health_generate`): 200 with an empty body, 503 while starting.
- `GET /model_info` (older `/get_model_info`, kept by SGLang as a deprecated alias): model_path, tokenizer_path,
  is_generation, preferred_sampling_params, weight_version, has_image_understanding, has_audio_understanding,
  model_type, architectures.
- `GET /get_server_info` (newer `/server_info`): `dataclasses.asdict(server_args)` plus scheduler info,
  `internal_states` and `version`; here only a few of those keys.
- `POST /generate`: `{"text", "output_ids", "meta_info"}`; meta_info as in `managers/tokenizer_manager.py`
  `_handle_batch_output`, finish_reason as `FINISH_*.to_json()` in `managers/schedule_batch.py`. A ValueError is
  answered by `_create_error_response`: 400 `{"error": {"message"}}`.
- `POST /update_weights_from_disk`: `{"success", "message", "num_paused_requests"}`, 200 or 400; with a
  `weight_version` the message gains " Weight version updated to V." and the server reports V from then on.
- `POST /begin_weight_update`, `/end_weight_update`: the weight-update session; `/update_weights_from_distributed`
  and `/update_weights_from_tensor` are refused outside one with SGLang's 400 `{"success": false, "message"}`
  (`managers/scheduler_components/weight_updater.py`, 0.5.23); inside one the scripted model has no weights to take.
- `GET /v1/models`: `ModelList` of `ModelCard(id, object="model", created, owned_by="sglang", root, max_model_len)`
  (`entrypoints/openai/protocol.py`).
- `POST /v1/chat/completions`: OpenAI chat completion; token ids with `return_token_ids` in the vLLM/SGLang shape
  Harbor reads (`prompt_token_ids` on the response, `token_ids` per choice).
- A body that fails validation gets 400 `ErrorResponse(object="error", message, type="Bad Request", code=400)`
  (`validation_exception_handler`).

Faults (`StandinServer.faults.inject`), each for the next N matching requests (or every one): `5xx` (an error
status with an SGLang error body), `slow` (answer after `delay_s`, past a client's timeout), `drop` (close the
connection without an answer), `malformed_json` (a cut-off body), `missing_finish_reason` (a well-formed answer
without `finish_reason`), `ignore_version` (a weight update applied without its `weight_version`, as an engine
that acknowledges the label but keeps its old one). With `upstream=URL` the server relays every request it does not fault to that URL, so
the same faults apply in front of the embedded engine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

# Run as a script: this checkout's root first, for `tests.` and for its own `grpoflow` (not an installed one).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from grpoflow.engine.protocol import (  # noqa: E402
    WEIGHT_SESSION_ALREADY_OPEN,
    WEIGHT_SESSION_NOT_OPEN,
    ChatCompletionRequest,
    outside_weight_session,
)
from tests.fakes.sglang_fields import SGLANG_GENERATE_REQ_INPUT, SGLANG_SAMPLING_PARAMS  # noqa: E402

FAULT_KINDS = ("5xx", "slow", "drop", "malformed_json", "missing_finish_reason", "ignore_version")
STANDIN_VERSION = "0.0.0-standin"


# --- faults ---------------------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    path: str | None  # None: any path
    remaining: int | None  # None: every matching request from now on
    status: int = 503
    delay_s: float = 2.0


class FaultPlan:
    """Faults waiting for requests, first match wins; thread-safe (the server answers on many threads)."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    def inject(
        self, kind: str, times: int | None = 1, path: str | None = "/generate", status: int = 503, delay_s: float = 2.0
    ) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        if kind == "5xx" and not 500 <= status <= 599:
            raise ValueError(f"a 5xx fault needs a status in 500..599, got {status}")
        with self._lock:
            self._faults.append(Fault(kind, path, times, status, delay_s))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def take(self, path: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.path is None or f.path == path:
                    if f.remaining is not None:
                        f.remaining -= 1
                        if f.remaining == 0:
                            self._faults.remove(f)
                    return f
        return None


# --- the scripted model ---------------------------------------------------------------------------------------


class BadRequest(ValueError):
    """Answered with 400 and SGLang's error body."""


@dataclass
class ScriptedModel:
    """Deterministic fake generation: each token is a hash of (recent context, position, seed key).

    Greedy requests (temperature < 1e-6, SGLang's rule) and requests with a `sampling_seed` repeat exactly;
    unseeded sampled requests differ from call to call, as on SGLang.
    """

    model_path: str
    served_model_name: str
    vocab_size: int = 32000
    context_length: int = 4096
    eos_token_id: int | None = None
    model_type: str | None = None
    architectures: list[str] | None = None
    weight_version: str = "default"
    weight_session: bool = False  # between /begin_weight_update and /end_weight_update
    _rng: random.Random = field(default_factory=random.Random)

    @classmethod
    def from_path(cls, model_path: str, served_model_name: str | None, context_length: int | None) -> ScriptedModel:
        cfg: dict[str, Any] = {}
        cfg_file = Path(model_path) / "config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        eos = cfg.get("eos_token_id")
        return cls(
            model_path=model_path,
            served_model_name=served_model_name or model_path,
            vocab_size=int(cfg.get("vocab_size", 32000)),
            context_length=int(context_length or cfg.get("max_position_embeddings", 4096)),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            model_type=cfg.get("model_type"),
            architectures=cfg.get("architectures"),
        )

    def generate(self, input_ids: list[int], sp: dict[str, Any], return_logprob: bool, rid: str | None) -> dict:
        if len(input_ids) >= self.context_length:
            raise BadRequest(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        max_new = int(sp.get("max_new_tokens", 128))
        if max_new + len(input_ids) >= self.context_length:  # TokenizerManager._validate_one_request: no clamp
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                f"tokens. You requested a total of {max_new + len(input_ids)} tokens: {len(input_ids)} tokens "
                f"from the input messages and {max_new} tokens for the completion. Please reduce the number of "
                "tokens in the input messages or the completion to fit within the limit."
            )
        max_req_input_len = self.context_length - 1 - 5  # Scheduler: max_req_len - 5, max_req_len = context - 1
        if len(input_ids) >= max_req_input_len:  # Scheduler validate_input_length: the request is aborted
            message = (
                f"Input length ({len(input_ids)} tokens) exceeds the maximum allowed length ({max_req_input_len} "
                "tokens). Use a shorter input or enable --allow-auto-truncate."
            )
            meta = {"id": rid or uuid.uuid4().hex, "finish_reason": {"type": "abort", "message": message}}
            return {"text": "", "output_ids": [], "meta_info": meta | {"prompt_tokens": len(input_ids)}}
        temperature = float(sp.get("temperature", 1.0))
        seed_key: Any = "greedy" if temperature < 1e-6 else sp.get("sampling_seed")
        if seed_key is None:
            seed_key = self._rng.getrandbits(64)
        stop_ids = set(sp.get("stop_token_ids") or [])
        if self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        if sp.get("ignore_eos", False):  # schedule_batch.py _check_token_based_finish: no token ends the reply
            stop_ids = set()
        stop = sp.get("stop") or []
        stop_strs = [stop] if isinstance(stop, str) else [s for s in stop if s]

        context, out_ids, logprobs, text = list(input_ids), [], [], ""
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        for _ in range(max_new):
            tok, lp = self._next(context, seed_key)
            context.append(tok)
            out_ids.append(tok)
            logprobs.append(lp)
            if tok in stop_ids:  # the stop token stays in output_ids, its text is not shown
                finish = {"type": "stop", "matched": tok}
                break
            text += _piece(tok)
            hit = next((s for s in stop_strs if s in text), None)
            if hit is not None:  # SGLang trims the text at the stop string (no_stop_trim off)
                text = text[: text.index(hit)]
                finish = {"type": "stop", "matched": hit}
                break
        meta: dict[str, Any] = {
            "id": rid or uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "weight_version": self.weight_version,
            "total_retractions": 0,
            "completion_tokens": len(out_ids),
            "cached_tokens": 0,
            "e2e_latency": 0.001,
        }
        if return_logprob:
            # SGLang: [logprob, token_id, text-or-null]; the first prompt token has no logprob.
            meta["input_token_logprobs"] = [[None, input_ids[0], None]] + [[-1.0, t, None] for t in input_ids[1:]]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, out_ids, strict=True)]
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    def _next(self, context: list[int], seed_key: Any) -> tuple[int, float]:
        digest = hashlib.blake2b(repr((context[-16:], len(context), seed_key)).encode(), digest_size=8).digest()
        x = int.from_bytes(digest, "little")
        return 3 + x % (self.vocab_size - 3), -0.05 - (x >> 40) % 1000 / 200.0


def _piece(tok: int) -> str:
    return f"<{tok}>"


# --- endpoint handlers: (status, JSON body) -------------------------------------------------------------------


def _bad_request(message: str) -> tuple[int, dict]:
    # http_server.py validation_exception_handler: ErrorResponse with type "Bad Request", code 400
    return 400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def _handle_generate(model: ScriptedModel, body: Any) -> tuple[int, dict]:
    if not isinstance(body, dict):
        return _bad_request("/generate: body must be a JSON object")
    unknown = set(body) - SGLANG_GENERATE_REQ_INPUT
    if unknown:
        return _bad_request(f"/generate: unexpected keyword arguments {sorted(unknown)}")
    sp = body.get("sampling_params") or {}
    unknown_sp = set(sp) - SGLANG_SAMPLING_PARAMS
    if unknown_sp:  # SamplingParams(**dict) raises TypeError on an unknown name
        return _bad_request(f"/generate: SamplingParams got unexpected keyword arguments {sorted(unknown_sp)}")
    ids = body.get("input_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
        return _bad_request("/generate: the stand-in needs `input_ids`, a non-empty list of token ids")
    if body.get("stream"):
        return _bad_request("/generate: the stand-in does not stream")
    try:
        return 200, model.generate(ids, sp, bool(body.get("return_logprob", False)), body.get("rid"))
    except BadRequest as e:
        return 400, {"error": {"message": str(e)}}  # http_server.py _create_error_response


def _handle_update_weights(model: ScriptedModel, body: Any) -> tuple[int, dict]:
    if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
        return _bad_request("/update_weights_from_disk: `model_path` is required")
    path = body["model_path"]
    if not Path(path).is_dir():
        msg = f"Failed to get weights iterator: {path} (repo id: {path}) not found"
        return 400, {"success": False, "message": msg, "num_paused_requests": 0}
    model.model_path = path
    message = "Succeeded to update model weights."
    if body.get("weight_version") is not None:
        model.weight_version = str(body["weight_version"])
        message += f" Weight version updated to {model.weight_version}."
    return 200, {"success": True, "message": message, "num_paused_requests": 0}


def _handle_begin_weight_update(model: ScriptedModel, body: Any) -> tuple[int, dict]:
    # managers/scheduler_components/weight_updater.py begin_weight_update / end_weight_update (0.5.23)
    if model.weight_session:
        return 400, {"success": False, "message": WEIGHT_SESSION_ALREADY_OPEN}
    model.weight_session = True
    return 200, {"success": True, "message": "Success"}


def _handle_end_weight_update(model: ScriptedModel, body: Any) -> tuple[int, dict]:
    if not model.weight_session:
        return 400, {"success": False, "message": WEIGHT_SESSION_NOT_OPEN}
    model.weight_session = False
    return 200, {"success": True, "message": "Success"}


def _in_memory_update(route: str):
    """SGLang refuses an in-memory update outside a weight-update session before anything else; inside one the
    scripted model has no weights to take, which it says (a stand-in relaying to an engine passes them on)."""

    def handle(model: ScriptedModel, body: Any) -> tuple[int, dict]:
        if not model.weight_session:
            return 400, {"success": False, "message": outside_weight_session(route)}
        return 400, {"success": False, "message": f"{route}: the stand-in's scripted model has no weights to update"}

    return handle


def _model_info(model: ScriptedModel) -> dict:
    return {
        "model_path": model.model_path,
        "tokenizer_path": model.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": model.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model.model_type,
        "architectures": model.architectures,
    }


def _models(model: ScriptedModel) -> dict:
    card = {
        "id": model.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": model.served_model_name,
        "max_model_len": model.context_length,
    }
    return {"object": "list", "data": [card]}


def _handle_chat(model: ScriptedModel, body: Any) -> tuple[int, dict]:
    try:
        req = ChatCompletionRequest.model_validate(body)
        prompt_text = "".join(f"<|{m.role}|>{m.text()}" for m in req.messages) + "<|assistant|>"
    except (ValidationError, ValueError) as e:
        return _bad_request(f"/v1/chat/completions: {e}".replace("\n", " "))
    if req.stream:
        return _bad_request("/v1/chat/completions: the stand-in does not stream")
    prompt_ids = [3 + b % (model.vocab_size - 3) for b in prompt_text.encode()]  # a byte "tokenizer"
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    choices, completion_tokens = [], 0
    for i in range(req.n):
        sp = {
            "max_new_tokens": 16 if max_new is None else max_new,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "sampling_seed": None if req.seed is None else req.seed + i,
        }
        try:
            out = model.generate(prompt_ids, sp, True, None)
        except BadRequest as e:
            return _bad_request(str(e))
        fr = out["meta_info"]["finish_reason"]
        choice: dict[str, Any] = {
            "index": i,
            "message": {"role": "assistant", "content": out["text"], "reasoning_content": None, "tool_calls": None},
            "logprobs": None,
            "finish_reason": fr["type"],
            "matched_stop": fr.get("matched"),
        }
        if req.logprobs:
            content = [
                {"token": _piece(t), "logprob": lp, "bytes": list(_piece(t).encode()), "top_logprobs": []}
                for lp, t, _ in out["meta_info"]["output_token_logprobs"]
            ]
            choice["logprobs"] = {"content": content}
        if req.return_token_ids:
            choice["token_ids"] = out["output_ids"]
        choices.append(choice)
        completion_tokens += len(out["output_ids"])
    resp: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model or model.served_model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
        "metadata": {"weight_version": model.weight_version},
    }
    if req.return_token_ids:
        resp["prompt_token_ids"] = prompt_ids
    return 200, resp


def _drop_finish_reason(path: str, payload: bytes) -> bytes:
    data = json.loads(payload)
    if path == "/generate":
        data["meta_info"].pop("finish_reason", None)
    elif path == "/v1/chat/completions":
        for choice in data["choices"]:
            choice.pop("finish_reason", None)
    return json.dumps(data).encode()


# --- the HTTP server ------------------------------------------------------------------------------------------


class StandinServer:
    """The stand-in on a free 127.0.0.1 port in a background thread: `.url`, `.faults`, `.requests` (paths seen).

    With `upstream`, requests that are not faulted are relayed to that URL instead of the scripted model.
    """

    def __init__(
        self,
        model_path: str = "standin-model",
        *,
        served_model_name: str | None = None,
        context_length: int | None = None,
        upstream: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        server_args: dict[str, Any] | None = None,
        warmup_s: float = 0.0,
    ):
        self.model = ScriptedModel.from_path(model_path, served_model_name, context_length)
        self.upstream = upstream.rstrip("/") if upstream else None
        self.faults = FaultPlan()
        self.requests: list[str] = []
        self.server_args = server_args or {}
        self._ready_at = time.monotonic() + warmup_s
        self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True  # a handler sleeping through a `slow` fault must not block shutdown
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StandinServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever(poll_interval=0.2)

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> StandinServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def count(self, path: str) -> int:
        return sum(p == path for p in self.requests)

    # Local answers: (status, body bytes); `None` means "no such endpoint".
    def answer_locally(self, method: str, path: str, body: Any) -> tuple[int, bytes] | None:
        m = self.model
        if method == "GET" and path in ("/health", "/health_generate"):
            return (200 if time.monotonic() >= self._ready_at else 503), b""
        if method == "GET" and path in ("/model_info", "/get_model_info"):
            return 200, json.dumps(_model_info(m)).encode()
        if method == "GET" and path in ("/get_server_info", "/server_info"):
            info = {
                "model_path": m.model_path,
                "tokenizer_path": m.model_path,
                "served_model_name": m.served_model_name,
                "context_length": None,  # ServerArgs.context_length: the --context-length flag, None unless given
                **self.server_args,
                "weight_version": m.weight_version,
                "internal_states": [{"last_gen_throughput": 0.0}],
                "version": STANDIN_VERSION,
            }
            return 200, json.dumps(info).encode()
        if method == "GET" and path == "/v1/models":
            return 200, json.dumps(_models(m)).encode()
        handlers = {
            "/generate": _handle_generate,
            "/update_weights_from_disk": _handle_update_weights,
            "/begin_weight_update": _handle_begin_weight_update,
            "/end_weight_update": _handle_end_weight_update,
            "/update_weights_from_distributed": _in_memory_update("update_weights_from_distributed"),
            "/update_weights_from_tensor": _in_memory_update("update_weights_from_tensor"),
            "/v1/chat/completions": _handle_chat,
        }
        if method == "POST" and path in handlers:
            status, data = handlers[path](m, body)
            return status, json.dumps(data).encode()
        return None

    def relay(self, method: str, path: str, raw: bytes) -> tuple[int, bytes]:
        assert self.upstream is not None
        headers = {"content-type": "application/json"} if raw else {}
        try:
            with httpx.Client(timeout=120.0) as c:
                r = c.request(method, self.upstream + path, content=raw or None, headers=headers)
        except httpx.HTTPError as e:
            # The upstream itself failed: answer as a gateway would, so the client sees an infrastructure fault.
            return 502, json.dumps(
                {
                    "object": "error",
                    "message": f"stand-in relay: {type(e).__name__}: {e}",
                    "type": "Bad Gateway",
                    "param": None,
                    "code": 502,
                }
            ).encode()
        return r.status_code, r.content


def _make_handler(server: StandinServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        disable_nagle_algorithm = True  # as a real server answers: no ~40 ms delayed-ACK wait per request
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn: the client reuses pooled connections

        def _serve(self) -> None:
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            server.requests.append(path)
            fault = server.faults.take(path)
            if fault is not None and fault.kind == "drop":
                self.close_connection = True  # no status line at all: the client sees a disconnect
                return
            if fault is not None and fault.kind == "5xx":
                body = {
                    "object": "error",
                    "message": f"stand-in fault: HTTP {fault.status}",
                    "type": "InternalServerError",
                    "param": None,
                    "code": fault.status,
                }
                self._send(fault.status, json.dumps(body).encode())
                return
            if fault is not None and fault.kind == "slow":
                time.sleep(fault.delay_s)
            if fault is not None and fault.kind == "ignore_version" and raw:
                raw = json.dumps({k: v for k, v in json.loads(raw).items() if k != "weight_version"}).encode()
            if server.upstream is not None:
                status, payload = server.relay(self.command, path, raw)
            else:
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError as e:
                    status, payload = 400, json.dumps(_bad_request(f"{path}: body is not valid JSON: {e}")[1]).encode()
                else:
                    local = server.answer_locally(self.command, path, body)
                    status, payload = local if local is not None else (404, b'{"detail":"Not Found"}')
            if fault is not None and status == 200:
                if fault.kind == "malformed_json":
                    payload = payload[: max(1, len(payload) // 2)]
                elif fault.kind == "missing_finish_reason":
                    payload = _drop_finish_reason(path, payload)
            self._send(status, payload)

        def _send(self, status: int, payload: bytes) -> None:
            try:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                # The client gave up first (a `slow` fault past its timeout): nobody is left to answer.
                self.close_connection = True

        do_GET = do_POST = do_PUT = _serve

        def log_message(self, fmt: str, *args) -> None:
            if os.environ.get("STANDIN_LOG_REQUESTS"):
                sys.stderr.write(f"standin: {fmt % args}\n")

    return Handler


# --- the `sglang.launch_server`-compatible command line --------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tensor-parallel-size", "--tp-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--sleep-on-idle", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    return p.parse_args(argv)  # unknown flags: exit 2, as SGLang's parser


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if not Path(args.model_path).is_dir():
        # SGLang fails the same way for a local path that is not there (it then tries the Hub, offline here).
        sys.exit(f"stand-in: OSError: model path {args.model_path} is not a local folder and the Hub is unreachable")
    time.sleep(float(os.environ.get("STANDIN_LOAD_S", "0")))
    # A child in the parent's process group, as SGLang's scheduler process: only a group kill ends it.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    server_args = {
        "host": args.host,
        "port": args.port,
        "tp_size": args.tp_size,
        "mem_fraction_static": args.mem_fraction_static,
        "context_length": args.context_length,
        "random_seed": args.random_seed,
        "device": args.device,
        "attention_backend": args.attention_backend,
        "max_total_tokens": args.max_total_tokens,
        "sleep_on_idle": args.sleep_on_idle,
        "enable_deterministic_inference": args.enable_deterministic_inference,
        "use_cpu_engine": os.environ.get("SGLANG_USE_CPU_ENGINE"),
        "standin_pid": os.getpid(),
        "standin_child_pid": child.pid,
    }
    server = StandinServer(
        args.model_path,
        served_model_name=args.served_model_name,
        context_length=args.context_length,
        host=args.host,
        port=args.port,
        server_args=server_args,
        warmup_s=float(os.environ.get("STANDIN_WARMUP_S", "0")),
    )
    print(f"stand-in sglang serving {args.model_path} on {server.url} (tp {args.tp_size})", flush=True)
    print("The server is fired up and ready to roll!", flush=True)  # SGLang's own ready line
    try:
        server.serve_forever()
    finally:
        child.kill()


if __name__ == "__main__":
    main()
