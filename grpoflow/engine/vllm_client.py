"""vLLM's HTTP API behind `EngineClient`'s methods, answering as SGLang does (`grpoflow.engine.protocol`'s vLLM
models on the wire, SGLang's to the caller): generation as `/v1/completions` of token ids, disk loads as vLLM's
`reload_weights`, and the in-memory syncs through grpoflow's worker extension (`grpoflow.engine.vllm_worker`) over
`/collective_rpc`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpoflow.engine.client import EngineClient, checked_generate
from grpoflow.engine.protocol import (
    GenerateResponse,
    ModelInfo,
    SamplingParams,
    UpdateWeightsFromDiskResponse,
    VLLMCompletionResponse,
    VLLMModelList,
    VLLMWeightInfo,
    WeightsUpdateGroupResponse,
)
from grpoflow.errors import EngineError

# vLLM has no weight version before the first /update_weight_version; SGLang's is then "default".
_FIRST_VERSION = "default"


class VllmClient(EngineClient):
    """A vLLM server (`vllm serve`, as `engine.backend` vllm or vllm-launch runs it)."""

    name = "vLLM"

    def generate(
        self, input_ids: list[int], sampling_params: SamplingParams | None = None, *, return_logprob: bool = True
    ) -> GenerateResponse:
        version = self._call("GET", "/weight_info", None, VLLMWeightInfo).weight_version
        body = _completion_body(input_ids, sampling_params, return_logprob)
        wait = self.generation_timeout(body["max_tokens"])
        resp = self._call("POST", "/v1/completions", body, VLLMCompletionResponse, generation_s=wait)
        return checked_generate(_as_generate(resp, version, return_logprob))

    async def agenerate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        on_fault: Callable[[str], None] | None = None,
    ) -> GenerateResponse:
        info = await self._acall("GET", "/weight_info", None, VLLMWeightInfo, on_fault)
        body = _completion_body(input_ids, sampling_params, return_logprob)
        wait = self.generation_timeout(body["max_tokens"])
        resp = await self._acall("POST", "/v1/completions", body, VLLMCompletionResponse, on_fault, generation_s=wait)
        return checked_generate(_as_generate(resp, info.weight_version, return_logprob))

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> UpdateWeightsFromDiskResponse:
        """Hold generation (requests in flight finish on the old weights, new ones wait), have every worker read
        `model_path`'s safetensors, label them, go on. Not retried: a reload cut off midway may have left the
        model half loaded, and only a whole new one mends that. Generation resumes however the load ended."""
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

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> WeightsUpdateGroupResponse:
        kwargs = {
            "master_address": master_address,
            "master_port": str(master_port),
            "rank_offset": str(rank_offset),
            "world_size": str(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        return self._worker_call("grpoflow_join_update_group", kwargs, "/init_weights_update_group")

    def begin_weight_update(self) -> WeightsUpdateGroupResponse:
        """`/pause?mode=wait` (requests in flight finish on the old weights, new ones wait), then each worker
        opens its in-place reload for the buckets to come."""
        self._call("POST", "/pause?mode=wait", None, dict, retries=0)
        return self._worker_call("grpoflow_begin_weights", {}, "/begin_weight_update")

    def end_weight_update(self) -> WeightsUpdateGroupResponse:
        """Each worker serves what it received; then `/resume`."""
        self._worker_call("grpoflow_end_weights", {}, "/end_weight_update")
        self._call("POST", "/resume", None, dict)
        return WeightsUpdateGroupResponse(success=True, message="resumed")

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> WeightsUpdateGroupResponse:
        kwargs = {"names": json.dumps(names), "dtypes": json.dumps(dtypes), "shapes": json.dumps(shapes)}
        resp = self._worker_call("grpoflow_receive_weights", kwargs, "/update_weights_from_distributed")
        if weight_version is not None:
            self.update_weight_version(weight_version)
        return resp

    def update_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", {"new_version": version}, dict)  # the route's one field

    def hold_generation(self) -> None:
        self._call("POST", "/pause?mode=wait", None, dict)

    def release_generation(self) -> None:
        self._call("POST", "/resume", None, dict)

    def model_info(self) -> ModelInfo:
        """`model_path` is the model vLLM was started with (it does not follow weight loads, unlike SGLang's)."""
        card = self._call("GET", "/v1/models", None, VLLMModelList).data[0]
        version = self._call("GET", "/weight_info", None, VLLMWeightInfo).weight_version
        return ModelInfo(
            model_path=card.root or card.id,
            tokenizer_path=None,
            is_generation=True,
            weight_version=version or _FIRST_VERSION,
        )

    def busy_seconds(self) -> float | None:
        return None  # no /get_server_info

    def replicas(self, timeout: float = 10.0) -> list[str]:
        return [self.base_url]  # no router in front of vLLM here

    def weight_update_ranks(self) -> int:
        """The workers that answer a `/collective_rpc` (every rank of vLLM's tensor and pipeline parallel world)."""
        return len(self._worker_results("grpoflow_rank", {}, "/get_server_info"))

    def _worker_call(self, method: str, kwargs: dict[str, str], what: str) -> WeightsUpdateGroupResponse:
        """`_worker_results` as SGLang's answer to the route it stands for."""
        return WeightsUpdateGroupResponse(success=True, message=json.dumps(self._worker_results(method, kwargs, what)))

    def _worker_results(self, method: str, kwargs: dict[str, str], what: str) -> list[Any]:
        """`method` of grpoflow's worker extension on every vLLM worker (`/collective_rpc`), not retried (each is one
        end of a collective): one result per worker. EngineError naming `what` (the SGLang route it stands for)
        with vLLM's reason."""
        try:
            out = self._call("POST", "/collective_rpc", {"method": method, "kwargs": kwargs}, dict, retries=0)
        except EngineError as e:
            raise EngineError(f"{what}: failed: vLLM worker extension {method}: {e}") from e
        results = out.get("results")
        if not isinstance(results, list):
            raise EngineError(f"{what}: malformed response of /collective_rpc {method}: results {results!r}")
        return results


def _completion_body(input_ids: list[int], params: SamplingParams | None, return_logprob: bool) -> dict:
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


def _as_generate(resp: VLLMCompletionResponse, version: str | None, return_logprob: bool) -> GenerateResponse:
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
        "weight_version": version or _FIRST_VERSION,
        "output_token_logprobs": logprobs,
    }
    return GenerateResponse.model_validate({"text": choice.text, "output_ids": ids, "meta_info": meta})
