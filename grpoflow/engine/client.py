"""HTTP client for SGLang's API, used unchanged against real SGLang and against the embedded engine; and, with
`api="vllm"`, for vLLM's, behind the same methods and answers (`_VLLM` below), so nothing else in grpoflow knows
which engine it talks to.

Every answer is validated with `grpoflow.engine.protocol` (`/get_server_info`, free-form, only as a JSON
object); anything malformed (not JSON, a missing `finish_reason`, ...) raises `EngineError` with one line naming
the endpoint. Infrastructure faults — 5xx, timeouts, refused or dropped connections — are retried with jittered
exponential backoff, at least `retries` times after the first try and for as long as `outage_s` allows (an
engine restarting or overloaded is waited out), then raise `EngineUnavailableError` naming the URL. A 4xx is the
caller's fault and is never retried. An aborted generation (`finish_reason.type == "abort"`, which SGLang sends
when a request is cancelled) raises too: its output is incomplete and must not be scored.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from grpoflow.engine.protocol import (
    BeginWeightUpdateRequest,
    ChatCompletionResponse,
    EndWeightUpdateRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    LoRAUpdateResponse,
    ModelInfo,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    VLLMCompletionResponse,
    VLLMModelList,
    VLLMWeightInfo,
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
# vLLM has no weight version before the first /update_weight_version; SGLang's is then "default".
_VLLM_FIRST_VERSION = "default"


class _Retryable(Exception):
    """A failure worth another try (5xx or a transport error)."""


class EngineClient:
    """Sync and async access to one SGLang-compatible server at `base_url` (`api="vllm"`: a vLLM server)."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        lora_path: str | None = None,
        outage_s: float = 0.0,
        api: Literal["sglang", "vllm"] = "sglang",
    ):
        self.base_url = base_url.rstrip("/")
        self.api = api  # the HTTP API the server speaks (`EngineConfig.api`)
        self.timeout = timeout
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

    # --- endpoints ----------------------------------------------------------------------------------------

    def generate(
        self, input_ids: list[int], sampling_params: SamplingParams | None = None, *, return_logprob: bool = True
    ) -> GenerateResponse:
        if self.api == "vllm":
            version = self._call("GET", "/weight_info", None, VLLMWeightInfo).weight_version
            body = _vllm_completion_body(input_ids, sampling_params, return_logprob)
            resp = self._call("POST", "/v1/completions", body, VLLMCompletionResponse)
            return _checked_generate(_from_vllm(resp, version, return_logprob))
        body = _generate_body(input_ids, sampling_params, return_logprob, self.lora_path)
        return _checked_generate(self._call("POST", "/generate", body, GenerateResponse))

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
        if self.api == "vllm":
            info = await self._acall("GET", "/weight_info", None, VLLMWeightInfo, on_fault)
            body = _vllm_completion_body(input_ids, sampling_params, return_logprob)
            resp = await self._acall("POST", "/v1/completions", body, VLLMCompletionResponse, on_fault)
            return _checked_generate(_from_vllm(resp, info.weight_version, return_logprob))
        body = _generate_body(input_ids, sampling_params, return_logprob, self.lora_path)
        return _checked_generate(await self._acall("POST", "/generate", body, GenerateResponse, on_fault))

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> UpdateWeightsFromDiskResponse:
        if self.api == "vllm":
            return self._vllm_reload(model_path, weight_version)
        body = _update_body(model_path, weight_version, flush_cache)
        return _checked_update(self._call("POST", "/update_weights_from_disk", body, UpdateWeightsFromDiskResponse))

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> WeightsUpdateGroupResponse:
        if self.api == "vllm":  # the workers join through grpoflow's extension (`grpoflow.engine.vllm_worker`)
            kwargs = {
                "master_address": master_address,
                "master_port": str(master_port),
                "rank_offset": str(rank_offset),
                "world_size": str(world_size),
                "group_name": group_name,
                "backend": backend,
            }
            return self._vllm_worker_call("grpoflow_join_update_group", kwargs, "/init_weights_update_group")
        body = InitWeightsUpdateGroupRequest(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        ).model_dump()
        path = "/init_weights_update_group"
        return _checked_update(self._call("POST", path, body, WeightsUpdateGroupResponse, retries=0), path)

    # SGLang takes in-memory updates only inside a weight-update session (`grpoflow.train.sync.update_session`).
    # Neither call is retried: a re-sent begin that had gone through is refused as "already open", an end as
    # "no session open".
    def begin_weight_update(self) -> WeightsUpdateGroupResponse:
        """vLLM: `/pause?mode=wait` (requests in flight finish on the old weights, new ones wait)."""
        if self.api == "vllm":
            self._call("POST", "/pause?mode=wait", None, dict, retries=0)
            return WeightsUpdateGroupResponse(success=True, message="paused")
        path = "/begin_weight_update"
        body = BeginWeightUpdateRequest().model_dump()
        return _checked_update(self._call("POST", path, body, WeightsUpdateGroupResponse, retries=0), path)

    def end_weight_update(self) -> WeightsUpdateGroupResponse:
        """vLLM: `/resume`."""
        if self.api == "vllm":
            self._call("POST", "/resume", None, dict)
            return WeightsUpdateGroupResponse(success=True, message="resumed")
        path = "/end_weight_update"
        body = EndWeightUpdateRequest().model_dump()
        return _checked_update(self._call("POST", path, body, WeightsUpdateGroupResponse, retries=0), path)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> WeightsUpdateGroupResponse:
        if self.api == "vllm":
            kwargs = {"names": json.dumps(names), "dtypes": json.dumps(dtypes), "shapes": json.dumps(shapes)}
            resp = self._vllm_worker_call("grpoflow_receive_weights", kwargs, "/update_weights_from_distributed")
            if weight_version is not None:
                self.update_weight_version(weight_version)
            return resp
        body = UpdateWeightsFromDistributedRequest(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
        ).model_dump(exclude_none=True)
        path = "/update_weights_from_distributed"
        return _checked_update(self._call("POST", path, body, WeightsUpdateGroupResponse, retries=0), path)

    def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], weight_version: str | None = None, flush_cache: bool = True
    ) -> WeightsUpdateGroupResponse:
        """Not retried: the tensors it points at change with the trainer's next step."""
        body = UpdateWeightsFromTensorRequest(
            serialized_named_tensors=serialized_named_tensors, weight_version=weight_version, flush_cache=flush_cache
        ).model_dump(exclude_none=True)
        path = "/update_weights_from_tensor"
        return _checked_update(self._call("POST", path, body, WeightsUpdateGroupResponse, retries=0), path)

    def load_lora_adapter(self, name: str, path: str) -> LoRAUpdateResponse:
        body = LoadLoRAAdapterRequest(lora_name=name, lora_path=path).model_dump()
        resp = self._call("POST", "/load_lora_adapter", body, LoRAUpdateResponse)
        return _checked_update(resp, "/load_lora_adapter")

    def unload_lora_adapter(self, name: str) -> LoRAUpdateResponse:
        body = UnloadLoRAAdapterRequest(lora_name=name).model_dump()
        resp = self._call("POST", "/unload_lora_adapter", body, LoRAUpdateResponse)
        return _checked_update(resp, "/unload_lora_adapter")

    def update_weight_version(self, version: str) -> None:
        body = UpdateWeightVersionRequest(new_version=version).model_dump()
        if self.api == "vllm":
            body = {"new_version": version}  # vLLM's route takes no other field
        self._call("POST", "/update_weight_version", body, dict)

    def model_info(self) -> ModelInfo:
        """vLLM: `model_path` is the model it was started with (it does not follow weight loads, unlike SGLang's)."""
        if self.api == "vllm":
            card = self._call("GET", "/v1/models", None, VLLMModelList).data[0]
            version = self._call("GET", "/weight_info", None, VLLMWeightInfo).weight_version
            return ModelInfo(
                model_path=card.root or card.id,
                tokenizer_path=None,
                is_generation=True,
                weight_version=version or _VLLM_FIRST_VERSION,
            )
        return self._call("GET", "/model_info", None, ModelInfo)

    def _vllm_reload(self, model_path: str, weight_version: str | None) -> UpdateWeightsFromDiskResponse:
        """vLLM's disk load: hold generation (requests in flight finish on the old weights, new ones wait), have
        every worker read `model_path`'s safetensors, label them, go on. Not retried: a reload cut off midway may
        have left the model half loaded, and only a whole new one mends that. Generation resumes however the load
        ended."""
        if not any(Path(model_path).glob("*.safetensors")):
            # vLLM's reload_weights of a dir it cannot read takes its whole engine down (EngineDeadError)
            raise EngineError(f"/update_weights_from_disk: failed: no *.safetensors in {model_path}")
        start = time.monotonic()
        self._call("POST", "/pause?mode=wait", None, dict, retries=0)
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
            try:
                self._call("POST", "/collective_rpc", rpc, dict, retries=0)
            except EngineError as e:  # vLLM answers a failed reload with 500: it is no outage
                raise EngineError(f"/update_weights_from_disk: failed: vLLM reload_weights({model_path}): {e}") from e
            if weight_version is not None:
                self.update_weight_version(weight_version)
        finally:
            self._call("POST", "/resume", None, dict)
        return UpdateWeightsFromDiskResponse(
            success=True, message=f"vLLM reloaded {model_path} in {time.monotonic() - start:.2f}s"
        )

    def _vllm_worker_call(self, method: str, kwargs: dict[str, str], what: str) -> WeightsUpdateGroupResponse:
        """`method` of grpoflow's worker extension on every vLLM worker (`/collective_rpc`), not retried (each is one
        end of a collective); EngineError naming `what` (the SGLang route it stands for) with vLLM's reason."""
        try:
            out = self._call("POST", "/collective_rpc", {"method": method, "kwargs": kwargs}, dict, retries=0)
        except EngineError as e:
            raise EngineError(f"{what}: failed: vLLM worker extension {method}: {e}") from e
        return WeightsUpdateGroupResponse(success=True, message=json.dumps(out.get("results")))

    def busy_seconds(self) -> float | None:
        """Seconds the engine has spent computing (prefill, decode) since it started: the embedded engine's
        `busy_time_s` in /get_server_info; None from an engine that does not report it (SGLang, vLLM)."""
        if self.api == "vllm":
            return None  # no /get_server_info
        states = self.server_info().get("internal_states") or [{}]
        busy = states[0].get("busy_time_s")
        return float(busy) if isinstance(busy, int | float) else None

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

    def chat_completions(self, messages: list[dict], **params: Any) -> ChatCompletionResponse:
        """OpenAI chat completion; `params` go into the body as given (max_tokens, temperature, seed, ...)."""
        return self._call("POST", "/v1/chat/completions", {"messages": messages, **params}, ChatCompletionResponse)

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
        self, method: str, path: str, body: dict | None, model: type[M] | type[dict], retries: int | None = None
    ) -> M:
        url = self.base_url + path
        retries = self.retries if retries is None else retries
        last: BaseException | None = None
        start, attempt = time.monotonic(), 0
        while True:
            try:
                resp = self._sync_client().request(method, url, json=body)
                return _parse(resp, path, model)
            except (_Retryable, httpx.TransportError) as e:
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
    ) -> M:
        url = self.base_url + path
        last: BaseException | None = None
        start, attempt = time.monotonic(), 0
        while True:
            try:
                resp = await self._async_client().request(method, url, json=body)
                parsed = _parse(resp, path, model)
                self.outage = None
                return parsed
            except (_Retryable, httpx.TransportError) as e:
                last = e
                self.outage = f"{method} {url}: {_describe(e)}"
                if on_fault is not None:
                    on_fault(self.outage)
            if not self._again(attempt, self.retries, start):
                raise EngineUnavailableError(f"{method} {url} failed after {attempt + 1} attempts: {_describe(last)}")
            await asyncio.sleep(self._delay(attempt))
            attempt += 1

    def _again(self, attempt: int, retries: int, start: float) -> bool:
        """Another try after `attempt` failed ones (from 0): within `retries`, or within the outage budget."""
        return attempt < retries or time.monotonic() - start + self._delay_cap(attempt) <= self.outage_s

    def _delay_cap(self, attempt: int) -> float:
        return min(_BACKOFF_CAP_S, self.backoff_s * 2**attempt)

    def _delay(self, attempt: int) -> float:
        return min(_BACKOFF_CAP_S, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.5)


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


def _vllm_completion_body(input_ids: list[int], params: SamplingParams | None, return_logprob: bool) -> dict:
    """`POST /v1/completions` for a `/generate` request: token ids in, token ids (and with `return_logprob` the
    sampled tokens' logprobs: `logprobs: 0`) out."""
    p = params or SamplingParams()
    body: dict[str, Any] = {
        "prompt": input_ids,
        "max_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "ignore_eos": p.ignore_eos,
        "return_token_ids": True,
        "skip_special_tokens": True,
    }
    optional = {
        "top_k": p.top_k if p.top_k != -1 else None,
        "stop": p.stop_strings or None,
        # SGLang's ignore_eos switches off every token stop; vLLM's only the EOS
        "stop_token_ids": None if p.ignore_eos else p.stop_token_ids,
        "seed": p.sampling_seed,
        "logprobs": 0 if return_logprob else None,
    }
    return body | {k: v for k, v in optional.items() if v is not None}


def _from_vllm(resp: VLLMCompletionResponse, version: str | None, return_logprob: bool) -> GenerateResponse:
    """vLLM's completion as SGLang's `/generate` answer. `version`: the weight version read just before the
    request (vLLM's answer carries none); a sync in between makes it one older than the weights used, never
    newer. Finish reasons as SGLang gives them: "stop" with the stop string or token id matched (EOS: its id),
    "length" with the reply's length."""
    choice = resp.choices[0]
    ids = choice.token_ids
    if choice.finish_reason == "length":
        finish: dict[str, Any] = {"type": "length", "length": len(ids)}
    elif choice.finish_reason == "stop":
        matched = choice.stop_reason if choice.stop_reason is not None else (ids[-1] if ids else None)
        finish = {"type": "stop", "matched": matched}
    elif choice.finish_reason == "abort":
        finish = {"type": "abort", "message": "aborted by vLLM"}
    else:
        raise EngineError(f"/v1/completions: malformed response: finish_reason {choice.finish_reason!r}")
    logprobs = None
    if return_logprob:
        lps = choice.logprobs.token_logprobs if choice.logprobs is not None else []
        if len(lps) != len(ids) or any(lp is None for lp in lps):
            raise EngineError(f"/v1/completions: malformed response: {len(lps)} logprobs for {len(ids)} tokens")
        logprobs = [(lp, t, None) for lp, t in zip(lps, ids, strict=True)]
    meta = {
        "id": resp.id,
        "finish_reason": finish,
        "prompt_tokens": resp.usage.prompt_tokens,
        "completion_tokens": resp.usage.completion_tokens,
        "weight_version": version or _VLLM_FIRST_VERSION,
        "output_token_logprobs": logprobs,
    }
    return GenerateResponse.model_validate({"text": choice.text, "output_ids": ids, "meta_info": meta})


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


def _checked_generate(resp: GenerateResponse) -> GenerateResponse:
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


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
