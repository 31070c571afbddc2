"""HTTP clients for the engines: `EngineClient` is what every caller holds (transport, retries, the answers as
SGLang's models), `SglangClient` speaks SGLang's API (real SGLang, its router, and the embedded engine), and
`grpoflow.engine.vllm_client.VllmClient` vLLM's behind the same methods and answers, so nothing else in grpoflow
knows which engine it talks to (`grpoflow.engine.clients` picks the class from the API's name, once).

Every answer is validated with `grpoflow.engine.protocol` (`/get_server_info`, free-form, only as a JSON
object); anything malformed (not JSON, a missing `finish_reason`, ...) raises `EngineError` with one line naming
the endpoint. Infrastructure faults — 5xx, timeouts, refused or dropped connections — are retried with jittered
exponential backoff, at least `retries` times after the first try and for as long as `outage_s` allows (an
engine restarting or overloaded is waited out), then raise `EngineUnavailableError` naming the URL. A 4xx is the
caller's fault and is never retried. An aborted generation (`finish_reason.type == "abort"`, which SGLang sends
when a request is cancelled) raises too: its output is incomplete and must not be scored.

A generation's read timeout grows with the tokens it asks for (`generation_timeout`), so a long generation is never
cut off for its length. One that still gets no answer in that time is not re-sent: the engine held it all along,
and a re-sent request would decode it again from its first token; it fails at once as an infrastructure fault.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from grpoflow.config.engine import generation_timeout_s
from grpoflow.engine.protocol import (
    BeginWeightUpdateRequest,
    ContinueGenerationRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    LoRAUpdateResponse,
    ModelInfo,
    PauseGenerationRequest,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsUpdateGroupResponse,
)
from grpoflow.errors import EngineError, EngineUnavailableError, one_line

M = TypeVar("M", bound=BaseModel)
U = TypeVar("U", UpdateWeightsFromDiskResponse, WeightsUpdateGroupResponse, LoRAUpdateResponse)
# Endpoints that answer a failure with 400 and a {"success": false, "message"} body
_WEIGHT_UPDATES = (
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/begin_weight_update",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/end_weight_update",
    "/load_lora_adapter",
    "/unload_lora_adapter",
)

_BACKOFF_CAP_S = 10.0


class _Retryable(Exception):
    """A failure worth another try (5xx or a transport error)."""


class EngineClient(ABC):
    """Sync and async access to one engine server at `base_url`, whatever API it speaks: the endpoints every
    engine answers (as SGLang's models), the transport and its retries."""

    name: ClassVar[str]  # the engine's name in messages

    def __init__(
        self,
        base_url: str,
        timeout: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        lora_path: str | None = None,
        outage_s: float = 0.0,
        min_decode_tok_s: float = 0.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        # The slowest decode of one generation that is still progress (0: a generation gets `timeout` alone)
        self.min_decode_tok_s = min_decode_tok_s
        self.retries = retries
        self.outage_s = outage_s  # how long a request keeps retrying an engine that does not answer
        self.backoff_s = backoff_s
        self.lora_path = lora_path  # the LoRA adapter every generation names (a LoRA run's served adapter)
        # While an async request retries an engine that does not answer: what its last try got (else None), so an
        # agent cut off by its time limit meanwhile can tell the outage, not the policy, ended its episode.
        self.outage: str | None = None
        self._client: httpx.Client | None = None
        self._aclient: httpx.AsyncClient | None = None
        self._aclient_loop: asyncio.AbstractEventLoop | None = None

    # --- what every engine answers, each API its own way ------------------------------------------------

    @abstractmethod
    def generate(
        self, input_ids: list[int], sampling_params: SamplingParams | None = None, *, return_logprob: bool = True
    ) -> GenerateResponse: ...

    @abstractmethod
    async def agenerate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        on_fault: Callable[[str], None] | None = None,
    ) -> GenerateResponse:
        """`on_fault`: told what each failed try got, while the request waits an outage out (a client shared by
        many callers cannot say whose request `outage` is)."""

    @abstractmethod
    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> UpdateWeightsFromDiskResponse: ...

    @abstractmethod
    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> WeightsUpdateGroupResponse: ...

    # In-memory updates happen inside a weight-update session (`grpoflow.train.sync.update_session`). Neither
    # call is retried: a re-sent begin that had gone through is refused as "already open", an end as "no session
    # open".
    @abstractmethod
    def begin_weight_update(self) -> WeightsUpdateGroupResponse: ...

    @abstractmethod
    def end_weight_update(self) -> WeightsUpdateGroupResponse: ...

    @abstractmethod
    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> WeightsUpdateGroupResponse: ...

    @abstractmethod
    def update_weight_version(self, version: str) -> None: ...

    @abstractmethod
    def hold_generation(self) -> None:
        """New generation requests wait (those in flight finish) until `release_generation`; weight updates go on."""

    @abstractmethod
    def release_generation(self) -> None: ...

    @abstractmethod
    def model_info(self) -> ModelInfo: ...

    @abstractmethod
    def busy_seconds(self) -> float | None:
        """Seconds the engine has spent computing (prefill, decode) since it started: the embedded engine's
        `busy_time_s` in /get_server_info; None from an engine that does not report it (SGLang, vLLM)."""

    @abstractmethod
    def replicas(self, timeout: float = 10.0) -> list[str]:
        """The engines behind `base_url` (weight syncs and probes go to each): a router's workers, or the one."""

    @abstractmethod
    def weight_update_ranks(self) -> int:
        """How many of the engine's workers join a weight-update group (each receives every broadcast): the
        server's own layout, not the run's config, since an attached server may run another."""

    # --- what every engine answers alike -------------------------------------------------------------------

    def server_info(self) -> dict[str, Any]:
        """GET /get_server_info as a plain dict (SGLang's and the embedded engine's keys differ; see the server)."""
        return self._call("GET", "/get_server_info", None, dict)

    async def aserver_info(self) -> dict[str, Any]:
        return await self._acall("GET", "/get_server_info", None, dict)

    async def acontext_length(self) -> int | None:
        """The model's context length as the engine enforces it: `max_model_len` of `/v1/models` (SGLang's
        `model_config.context_len`), else `context_length` of `/get_server_info` (SGLang's is the
        `--context-length` flag, None unless given); None when neither says."""
        for path, read in (
            ("/v1/models", lambda body: (body.get("data") or [{}])[0].get("max_model_len")),
            ("/get_server_info", lambda body: body.get("context_length")),
        ):
            try:
                value = read(await self._acall("GET", path, None, dict))
            except EngineError:
                continue
            if isinstance(value, int) and value > 0:
                return value
        return None

    def health(self, timeout: float = 5.0) -> bool:
        """One probe of `/health`, no retries: True on 200, False if unreachable or unhealthy."""
        try:
            return self._sync_client().get(self.base_url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    # --- lifecycle ----------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    async def aclose(self) -> None:
        if self._aclient is not None:
            await self._aclient.aclose()
            self._aclient = None

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generation_timeout(self, max_new_tokens: int) -> float:
        """How long a generation of up to `max_new_tokens` may take (`generation_timeout_s` of this client's)."""
        return generation_timeout_s(self.timeout, self.min_decode_tok_s, max_new_tokens)

    # --- transport ----------------------------------------------------------------------------------------

    def _sync_client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout)
        return self._client

    def _async_client(self) -> httpx.AsyncClient:
        # An AsyncClient is bound to the loop that first used it; callers (Prefect tasks, asyncio.run) may
        # bring a new loop each time, so keep one client per loop.
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aclient_loop is not loop:
            self._aclient = httpx.AsyncClient(timeout=self.timeout)
            self._aclient_loop = loop
        return self._aclient

    def _call(
        self,
        method: str,
        path: str,
        body: dict | None,
        model: type[M] | type[dict],
        retries: int | None = None,
        generation_s: float | None = None,
    ) -> M:
        """`generation_s`: the request is a generation with this read timeout, never re-sent once it ran out."""
        url = self.base_url + path
        retries = self.retries if retries is None else retries
        timeout = self._timeout(generation_s)
        last: BaseException | None = None
        start, attempt = time.monotonic(), 0
        while True:
            try:
                resp = self._sync_client().request(method, url, json=body, timeout=timeout)
                return _parse(resp, path, model)
            except (_Retryable, httpx.TransportError) as e:
                _not_resent(e, method, url, generation_s)
                last = e
            if not self._again(attempt, retries, start):
                raise EngineUnavailableError(f"{method} {url} failed after {attempt + 1} attempts: {_describe(last)}")
            time.sleep(self._delay(attempt))
            attempt += 1

    async def _acall(
        self,
        method: str,
        path: str,
        body: dict | None,
        model: type[M] | type[dict],
        on_fault: Callable[[str], None] | None = None,
        generation_s: float | None = None,
    ) -> M:
        url = self.base_url + path
        timeout = self._timeout(generation_s)
        last: BaseException | None = None
        start, attempt = time.monotonic(), 0
        while True:
            try:
                request = self._async_client().request(method, url, json=body, timeout=timeout)
                resp = await self._watched(request, f"{method} {url}", generation_s, on_fault)
                parsed = _parse(resp, path, model)
                self.outage = None
                return parsed
            except (_Retryable, httpx.TransportError) as e:
                last = e
                self._fault(f"{method} {url}: {_describe(e)}", on_fault)
                _not_resent(e, method, url, generation_s)
            if not self._again(attempt, self.retries, start):
                raise EngineUnavailableError(f"{method} {url} failed after {attempt + 1} attempts: {_describe(last)}")
            await asyncio.sleep(self._delay(attempt))
            attempt += 1

    def _fault(self, what: str, on_fault: Callable[[str], None] | None) -> None:
        self.outage = what
        if on_fault is not None:
            on_fault(what)

    async def _watched(
        self,
        request: Coroutine[Any, Any, httpx.Response],
        what: str,
        generation_s: float | None,
        on_fault: Callable[[str], None] | None,
    ) -> httpx.Response:
        """`request`'s answer. A generation without one after `timeout` is told as a fault while it goes on
        waiting (up to `generation_s`): an agent whose time runs out meanwhile ran out on a slow or hung engine,
        not on its policy."""
        if generation_s is None or generation_s <= self.timeout:
            return await request
        task = asyncio.ensure_future(request)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout)
            if not done:
                self._fault(f"{what}: no answer after {self.timeout:.0f} s (still waiting)", on_fault)
            return await task
        finally:
            task.cancel()  # a caller cancelled (its time ran out) takes its request with it

    def _timeout(self, generation_s: float | None) -> httpx.Timeout:
        """Every phase of a request gets `timeout`; a generation's answer (the read) `generation_s`."""
        return httpx.Timeout(self.timeout, read=generation_s or self.timeout)

    def _again(self, attempt: int, retries: int, start: float) -> bool:
        """Another try after `attempt` failed ones (from 0): within `retries`, or within the outage budget."""
        return attempt < retries or time.monotonic() - start + self._delay_cap(attempt) <= self.outage_s

    def _delay_cap(self, attempt: int) -> float:
        return min(_BACKOFF_CAP_S, self.backoff_s * 2**attempt)

    def _delay(self, attempt: int) -> float:
        return min(_BACKOFF_CAP_S, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.5)


class SglangClient(EngineClient):
    """SGLang's HTTP API: real SGLang, sglang-router in front of several, and the embedded engine."""

    name = "SGLang"

    def generate(
        self, input_ids: list[int], sampling_params: SamplingParams | None = None, *, return_logprob: bool = True
    ) -> GenerateResponse:
        body = _generate_body(input_ids, sampling_params, return_logprob, self.lora_path)
        wait = self.generation_timeout(body["sampling_params"]["max_new_tokens"])
        return checked_generate(self._call("POST", "/generate", body, GenerateResponse, generation_s=wait))

    async def agenerate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        on_fault: Callable[[str], None] | None = None,
    ) -> GenerateResponse:
        body = _generate_body(input_ids, sampling_params, return_logprob, self.lora_path)
        wait = self.generation_timeout(body["sampling_params"]["max_new_tokens"])
        resp = await self._acall("POST", "/generate", body, GenerateResponse, on_fault, generation_s=wait)
        return checked_generate(resp)

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> UpdateWeightsFromDiskResponse:
        body = _update_body(model_path, weight_version, flush_cache)
        return _checked_update(self._call("POST", "/update_weights_from_disk", body, UpdateWeightsFromDiskResponse))

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> WeightsUpdateGroupResponse:
        body = InitWeightsUpdateGroupRequest(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        ).model_dump()
        return self._unretried_update("/init_weights_update_group", body)

    def begin_weight_update(self) -> WeightsUpdateGroupResponse:
        return self._unretried_update("/begin_weight_update", BeginWeightUpdateRequest().model_dump())

    def end_weight_update(self) -> WeightsUpdateGroupResponse:
        return self._unretried_update("/end_weight_update", EndWeightUpdateRequest().model_dump())

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> WeightsUpdateGroupResponse:
        body = UpdateWeightsFromDistributedRequest(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
        ).model_dump(exclude_none=True)
        return self._unretried_update("/update_weights_from_distributed", body)

    def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], weight_version: str | None = None, flush_cache: bool = True
    ) -> WeightsUpdateGroupResponse:
        """Not retried: the tensors it points at change with the trainer's next step."""
        body = UpdateWeightsFromTensorRequest(
            serialized_named_tensors=serialized_named_tensors, weight_version=weight_version, flush_cache=flush_cache
        ).model_dump(exclude_none=True)
        return self._unretried_update("/update_weights_from_tensor", body)

    def load_lora_adapter(self, name: str, path: str) -> LoRAUpdateResponse:
        body = LoadLoRAAdapterRequest(lora_name=name, lora_path=path).model_dump()
        resp = self._call("POST", "/load_lora_adapter", body, LoRAUpdateResponse)
        return _checked_update(resp, "/load_lora_adapter")

    def unload_lora_adapter(self, name: str) -> LoRAUpdateResponse:
        body = UnloadLoRAAdapterRequest(lora_name=name).model_dump()
        resp = self._call("POST", "/unload_lora_adapter", body, LoRAUpdateResponse)
        return _checked_update(resp, "/unload_lora_adapter")

    def update_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", UpdateWeightVersionRequest(new_version=version).model_dump(), dict)

    def hold_generation(self) -> None:
        # abort: a request that reached a just-restarted engine before the hold must not run on its start weights
        # (in_place would keep it in the batch, and the weight update's cache flush fails with it there)
        self._call("POST", "/pause_generation", PauseGenerationRequest(mode="abort").model_dump(), dict)

    def release_generation(self) -> None:
        self._call("POST", "/continue_generation", ContinueGenerationRequest().model_dump(), dict)

    def model_info(self) -> ModelInfo:
        return self._call("GET", "/model_info", None, ModelInfo)

    def busy_seconds(self) -> float | None:
        states = self.server_info().get("internal_states") or [{}]
        busy = states[0].get("busy_time_s")
        return float(busy) if isinstance(busy, int | float) else None

    def replicas(self, timeout: float = 10.0) -> list[str]:
        return replica_urls(self.base_url, timeout)

    def weight_update_ranks(self) -> int:
        """`tp_size` of /get_server_info: SGLang's workers join as rank_offset + their tensor-parallel rank, so
        pipeline or data parallelism inside one server would give two workers one rank."""
        info = self.server_info()
        layout = {k: info.get(k, 1) for k in ("tp_size", "pp_size", "dp_size")}
        if not all(isinstance(v, int) and v >= 1 for v in layout.values()):
            raise EngineError(f"/get_server_info: malformed response: {layout}")
        if layout["pp_size"] > 1 or layout["dp_size"] > 1:
            raise EngineError(
                f"engine {self.base_url} runs pp_size {layout['pp_size']} and dp_size {layout['dp_size']}: an "
                "in-memory weight sync reaches tensor-parallel workers only; set engine.weight_sync.mode=disk"
            )
        return layout["tp_size"]

    def _unretried_update(self, path: str, body: dict) -> WeightsUpdateGroupResponse:
        return _checked_update(self._call("POST", path, body, WeightsUpdateGroupResponse, retries=0), path)


def replica_urls(url: str, timeout: float = 10.0) -> list[str]:
    """The engines behind `url`: the workers a router lists in `GET /workers`, or `[url]` for a single engine
    (it has no such route)."""
    try:
        resp = httpx.get(url.rstrip("/") + "/workers", timeout=timeout)
    except httpx.HTTPError:
        return [url]
    if resp.status_code != 200:
        return [url]
    try:
        workers = resp.json().get("workers")
    except (ValueError, AttributeError):  # a server with a `/workers` of its own that is not a router's
        return [url]
    if not isinstance(workers, list) or not workers:
        return [url]
    return [w["url"] for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)]


def token_budget(context_length: int) -> int:
    """The most tokens (prompt + output) one request may hold on an engine of `context_length` without SGLang
    refusing it: its TokenizerManager refuses prompt + max_new_tokens reaching the context length (400), and its
    scheduler aborts a prompt of context_length - 6 tokens or more (max_req_len - 5, max_req_len = context - 1).
    So prompt + output <= context - 7 keeps both a prompt and at least one output token within bounds."""
    return max(context_length - 7, 1)


def _generate_body(
    input_ids: list[int], params: SamplingParams | None, return_logprob: bool, lora_path: str | None = None
) -> dict:
    req = GenerateRequest(
        input_ids=input_ids,
        sampling_params=params or SamplingParams(),
        return_logprob=return_logprob,
        lora_path=lora_path,
    )
    # Unset optionals stay off the wire: SGLang reads a missing field as its default.
    return req.model_dump(exclude_none=True)


def _update_body(model_path: str, weight_version: str | None, flush_cache: bool) -> dict:
    req = UpdateWeightsFromDiskRequest(model_path=model_path, weight_version=weight_version, flush_cache=flush_cache)
    return req.model_dump(exclude_none=True)


def _parse(resp: httpx.Response, path: str, model: type[M] | type[dict]) -> M:
    if resp.status_code >= 500:
        raise _Retryable(f"HTTP {resp.status_code}: {_error_text(resp)}")
    # SGLang answers a failed weight update with 400 and a normal {"success": false, ...} body: parse it and
    # let _checked_update raise with the server's message.
    failed_update = path in _WEIGHT_UPDATES and resp.status_code == 400 and '"success"' in resp.text
    if resp.status_code >= 400 and not failed_update:
        raise EngineError(f"{path}: HTTP {resp.status_code} from {resp.request.url}: {_error_text(resp)}")
    try:
        data = resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{path}: malformed response (not JSON: {e}): {resp.text[:200]!r}") from e
    if model is dict:  # free-form answer: only its top level is checked
        if not isinstance(data, dict):
            raise EngineError(f"{path}: malformed response: expected a JSON object, got {type(data).__name__}")
        return data
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise EngineError(f"{path}: malformed response: {where}: {first['msg']} ({e.error_count()} errors)") from e


def checked_generate(resp: GenerateResponse) -> GenerateResponse:
    fr = resp.meta_info.finish_reason
    if fr.type == "abort":
        raise EngineError(f"/generate: request {resp.meta_info.id} was aborted: {fr.message or 'no message'}")
    return resp


def _checked_update(resp: U, path: str = "/update_weights_from_disk") -> U:
    """`resp`, or EngineError with the server's reason when it says it failed (`message`; LoRA's
    `error_message`)."""
    if not resp.success:
        raise EngineError(f"{path}: failed: {getattr(resp, 'message', None) or getattr(resp, 'error_message', None)}")
    return resp


def _error_text(resp: httpx.Response) -> str:
    """The server's error message on one line (SGLang: {"message"} or {"error": {"message"}}; else raw text)."""
    try:
        data = resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return one_line(resp.text)
    if isinstance(data, dict):
        err = data.get("error")
        msg = data.get("message") or (err.get("message") if isinstance(err, dict) else err) or data.get("detail")
        if msg:
            return one_line(msg)
    return one_line(json.dumps(data))


def _not_resent(e: BaseException, method: str, url: str, generation_s: float | None) -> None:
    """Raise for a generation that got no answer within its timeout (`generation_s`): the engine took it and
    decoded all that time, so another try would decode it again from scratch."""
    if generation_s is not None and isinstance(e, httpx.ReadTimeout):
        raise EngineUnavailableError(
            f"{method} {url}: a generation got no answer within its {generation_s:.0f} s ({_describe(e)}); not "
            "re-sent, since the engine would decode it again from its first token"
        ) from e


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
