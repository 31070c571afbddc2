"""Pydantic models of the SGLang HTTP API subset grpoflow uses, with SGLang's own field names.

The same client code talks to real SGLang (GPU) and to the embedded engine (CPU), so these models are the
contract. Requests forbid unknown fields (the embedded engine rejects what it would otherwise ignore);
responses allow extra fields (real SGLang sends more) but require the ones grpoflow reads.

Where each name comes from (sgl-project/sglang, read at commits 001067ff / 00c17caf / 9c0549b7):
- `python/sglang/srt/managers/io_struct.py`
  - `GenerateReqInput`: `input_ids`, `sampling_params` (a dict), `return_logprob`, `rid`, `stream`.
  - `UpdateWeightFromDiskReqInput`: `model_path`, `weight_version: Optional[str]`, `flush_cache: bool = True`
    (also load_format, abort_all_requests, is_async, ..., which we do not send).
  - `UpdateWeightFromDiskReqOutput`: `success`, `message`, `num_paused_requests: int = 0`.
  - `InitWeightsUpdateGroupReqInput`: `master_address`, `master_port`, `rank_offset`, `world_size`,
    `group_name` ("weight_update_group"), `backend` ("nccl"); `UpdateWeightsFromDistributedReqInput`: `names`,
    `dtypes`, `shapes`, `group_name`, `flush_cache`, `weight_version` (and more we do not send); both answer
    `{"success", "message"}`, 200 or 400. The engine joins the trainer's group with a TCP store at
    `master_address:master_port`, keys under `<group_name>/` (`init_custom_process_group`), and receives each
    named tensor by a broadcast from rank 0, in the order of `names`.
  - `BeginWeightUpdateReqInput` (`selector`: "all") and `EndWeightUpdateReqInput` (no fields), `POST
    /begin_weight_update` and `/end_weight_update`, answer `{"success", "message"}`, 200 or 400. The scheduler
    (`managers/scheduler_components/weight_updater.py`) refuses `update_weights_from_distributed` and
    `update_weights_from_tensor` outside a session with 400 "<route name> must run between begin_weight_update()
    and end_weight_update()", a second begin with "a weight-update session is already open; call
    end_weight_update() first", an end without a begin with "no weight-update session is open; call
    begin_weight_update() first" (`WEIGHT_SESSION_*` below).
  - `LoadLoRAAdapterReqInput`: `lora_name`, `lora_path`, `pinned`; `UnloadLoRAAdapterReqInput`: `lora_name`; both
    answer `LoRAUpdateOutput` `{"success", "error_message", "loaded_adapters"}` (400 on failure). A request names
    its adapter in `GenerateReqInput.lora_path`. `UpdateWeightVersionReqInput`: `new_version`,
    `abort_all_requests` (`POST /update_weight_version`).
- `python/sglang/srt/sampling/sampling_params.py` `SamplingParams`: `max_new_tokens` (default 128),
  `temperature` (default 1.0; below 1e-6 means greedy), `top_p` (1.0), `top_k` (default all; -1 = disabled),
  `stop` (str | list[str]), `stop_token_ids`, `ignore_eos`, `sampling_seed` (per-request seed).
- `python/sglang/srt/managers/tokenizer_manager.py` `_handle_batch_output`: `meta_info` holds `id`,
  `finish_reason` (a dict from `FINISH_*.to_json()` in `managers/schedule_batch.py`: `{"type": "stop",
  "matched": int|str}`, `{"type": "length", "length": int}`, `{"type": "abort", "message": str}`),
  `prompt_tokens`, `completion_tokens`, `weight_version` (server_args.weight_version, default "default"),
  and with `return_logprob` `output_token_logprobs` as `[logprob, token_id, text_or_null]` triples (text only
  when `return_text_in_logprobs`). The `/generate` body is `{"text", "output_ids", "meta_info"}`.
- `python/sglang/srt/entrypoints/http_server.py`: `POST /generate`; `POST /update_weights_from_disk` answers
  `{"success", "message", "num_paused_requests"}` with 200, or 400 when `success` is false; `GET /model_info`
  answers `model_path`, `tokenizer_path`, `is_generation`, `weight_version` (and more); `GET /health` is 200.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# SGLang's refusals around its weight-update session, word for word (see the module doc).
WEIGHT_SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
WEIGHT_SESSION_NOT_OPEN = "no weight-update session is open; call begin_weight_update() first"


def outside_weight_session(route: str) -> str:
    """SGLang's refusal of `route` (`update_weights_from_distributed`, `update_weights_from_tensor`) outside a
    weight-update session."""
    return f"{route} must run between begin_weight_update() and end_weight_update()"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class SamplingParams(_Request):
    """The `sampling_params` of a `/generate` request (SGLang `SamplingParams` names and defaults)."""

    max_new_tokens: int = Field(128, ge=0, description="Most tokens to generate; the prompt is not counted.")
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 (below 1e-6) means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Keep the k most likely tokens; -1 keeps the whole vocabulary.")
    stop: str | list[str] | None = Field(None, description="Stop strings; the text is cut before the match.")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation (kept in output_ids).")
    ignore_eos: bool = Field(
        False, description="Stop at no token: neither EOS nor `stop_token_ids` (SGLang's rule); stop strings apply."
    )
    sampling_seed: int | None = Field(None, ge=0, description="Per-request seed; same seed, same tokens.")

    @field_validator("top_k")
    @classmethod
    def _top_k_legal(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {v}")
        return v

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def is_greedy(self) -> bool:
        # SGLang: 0 <= temperature < 1e-6 becomes top_k = 1.
        return self.temperature < 1e-6


# Fields sglang-router (`sglang_router.launch_router`) adds to every `/generate` it forwards, with the values it
# sends when the client did not set them. An engine behind the router must take them: those whose value cannot
# change the reply are accepted with any value, the others only at the value that asks for nothing more.
ROUTER_ADDED_ANY_VALUE = ("model", "log_metrics", "no_logs")
ROUTER_ADDED_OFF = ("return_text_in_logprobs", "return_hidden_states", "background", "return_bytes", "return_entropy")


class GenerateRequest(_Request):
    """Body of `POST /generate` (token ids in; SGLang also accepts `text`, which grpoflow never sends)."""

    input_ids: list[int] = Field(..., min_length=1, description="Prompt token ids.")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = Field(False, description="Return `output_token_logprobs` in meta_info.")
    rid: str | None = Field(None, description="Request id, echoed as meta_info.id.")
    stream: Literal[False] = Field(False, description="Streaming is not used by grpoflow.")
    lora_path: str | None = Field(None, description="The loaded LoRA adapter (its name) to generate with.")

    @model_validator(mode="before")
    @classmethod
    def _router_fields(cls, data: Any) -> Any:
        """Take the fields sglang-router adds (see ROUTER_ADDED_*); one asking for more than this model
        returns is refused, naming it."""
        if not isinstance(data, dict):
            return data
        asked = [k for k in ROUTER_ADDED_OFF if data.get(k)]
        if asked:
            raise ValueError(f"{', '.join(asked)}: not supported (only false)")
        return {k: v for k, v in data.items() if k not in ROUTER_ADDED_ANY_VALUE + ROUTER_ADDED_OFF}


class FinishReason(_Response):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class MetaInfo(_Response):
    id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None


class GenerateResponse(_Response):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo

    @property
    def logprobs(self) -> list[float]:
        """Per-output-token logprobs; empty when the request did not ask for them."""
        return [lp for lp, _, _ in self.meta_info.output_token_logprobs or []]


class UpdateWeightsFromDiskRequest(_Request):
    model_path: str = Field(..., min_length=1, description="Folder of *.safetensors with the new weights.")
    weight_version: str | None = Field(None, description="Version label to report from now on.")
    flush_cache: bool = Field(True, description="Drop the prefix cache (the embedded engine keeps none).")


class UpdateWeightsFromDiskResponse(_Response):
    success: bool
    message: str
    num_paused_requests: int = 0


class InitWeightsUpdateGroupRequest(_Request):
    """Join the trainer's weight-update process group: the trainer is rank 0, the engine's workers are ranks
    `rank_offset` .. `rank_offset + workers - 1` of `world_size`."""

    master_address: str = Field(..., min_length=1, description="The trainer's address (it hosts the group's store).")
    master_port: int = Field(..., ge=1, le=65535)
    rank_offset: int = Field(..., ge=1)
    world_size: int = Field(..., ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: str = Field("nccl", description="`nccl` between GPUs, `gloo` on CPU.")


class UpdateWeightsFromDistributedRequest(_Request):
    """Receive the named tensors the trainer broadcasts (rank 0) over the group, in this order, then serve them."""

    names: list[str] = Field(..., min_length=1)
    dtypes: list[str] = Field(..., description="torch dtype names without `torch.`: `bfloat16`, `float32`, ...")
    shapes: list[list[int]]
    group_name: str = Field("weight_update_group", min_length=1)
    flush_cache: bool = True
    weight_version: str | None = Field(None, description="Version label to report from now on.")


class UpdateWeightsFromTensorRequest(_Request):
    """Serve the named tensors the request points at (`grpoflow.engine.shared_tensors`): one entry per
    tensor-parallel rank, each naming tensors in memory the engine can map (same host or same GPU)."""

    serialized_named_tensors: list[str] = Field(..., min_length=1)
    load_format: str | None = Field(None, description="None: a list of (name, tensor) pairs.")
    flush_cache: bool = True
    weight_version: str | None = Field(None, description="Version label to report from now on.")


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(..., min_length=1, description="The name requests give as `lora_path`.")
    lora_path: str = Field(..., min_length=1, description="PEFT's adapter dir (adapter_config.json, weights).")
    pinned: bool = False


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(..., min_length=1)


class LoRAUpdateResponse(_Response):
    success: bool
    error_message: str | None = None


class UpdateWeightVersionRequest(_Request):
    new_version: str = Field(..., min_length=1)
    abort_all_requests: bool = False


class BeginWeightUpdateRequest(_Request):
    """Open SGLang's weight-update session: `/update_weights_from_distributed` and `/update_weights_from_tensor`
    are refused outside one (`/update_weights_from_disk` needs none)."""

    selector: Literal["target", "draft", "all"] = Field("all", description="Which model runners (speculative).")


class EndWeightUpdateRequest(_Request):
    """Close the session `/begin_weight_update` opened (SGLang finalizes the loaded weights here)."""


class PauseGenerationRequest(_Request):
    """Hold generation (`/pause_generation`): new requests wait until `/continue_generation`; the control routes
    (weight updates, versions, /health) still answer. SGLang's modes: `abort` the requests in flight, pause them
    `in_place`, or `retract` them to its queue. The embedded engine holds new requests only and lets those in
    flight finish: it takes `in_place` and `retract`, and `abort` only with nothing in flight to abort."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(_Request):
    """Release what `/pause_generation` held."""

    torch_empty_cache: bool = True


class WeightsUpdateGroupResponse(_Response):
    success: bool
    message: str


class ModelInfo(_Response):
    model_path: str
    tokenizer_path: str | None
    is_generation: bool
    weight_version: str


# --- OpenAI-compatible chat (what litellm / Harbor's terminus-2 send and read) ---------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """Content as plain text; list content keeps its `text` parts (images are refused upstream)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatParams(BaseModel):
    """OpenAI chat-completion parameters, other than the messages, that our servers read (the engine's
    `/v1/chat/completions` and the session server's). Unknown OpenAI fields are ignored, as SGLang and vLLM do."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=64)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    return_token_ids: bool | None = False
    stream: bool | None = False


class ChatCompletionRequest(ChatParams):
    """Body of the engine's `POST /v1/chat/completions`: text messages (see `ChatMessage`)."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    ignore_eos: bool = False


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Response):
    role: str
    content: str | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = (
        None  # with return_token_ids (SGLang / vLLM); litellm files it under provider_specific_fields
    )


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(_Response):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice] = Field(..., min_length=1)
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with return_token_ids; litellm sets it as a response attribute


# --- vLLM (vllm-project/vllm 0.32, `engine.backend` vllm / vllm-launch) -----------------------------------
# `grpoflow.engine.vllm_client.VllmClient` speaks these and hands the rest of grpoflow the SGLang models above.
# - `vllm/entrypoints/openai/completion/protocol.py`: `CompletionRequest` takes `prompt` as a list of token ids,
#   `max_tokens`, `temperature`, `top_p`, `top_k` (-1 or 0: off), `seed`, `stop`, `stop_token_ids`, `ignore_eos`,
#   `logprobs` (0: the sampled token's alone) and `return_token_ids` (then each choice carries `prompt_token_ids`
#   and `token_ids`). A choice's `finish_reason` is "stop" / "length" / "abort", `stop_reason` the stop string or
#   token id matched (None for EOS). Logprobs are of the distribution it samples from only when the server runs
#   with `--logprobs-mode processed_logprobs` (default `raw_logprobs`: before temperature and top-p/top-k).
# - `vllm/entrypoints/rl/online/api_router.py` (mounted under VLLM_SERVER_DEV_MODE=1): `POST /pause?mode=wait`
#   (finish in-flight requests, then hold new ones), `/resume`, `/update_weight_version` `{"new_version"}`,
#   `GET /weight_info` `{"weight_version": str | None}`; `vllm/entrypoints/serve/dev/rpc/api_router.py`: `POST
#   /collective_rpc` `{"method", "kwargs"}` calls the method on every worker (`reload_weights(weights_path=DIR)`
#   reads the safetensors of DIR into the served model).


class VLLMCompletionLogprobs(_Response):
    token_logprobs: list[float | None]


class VLLMCompletionChoice(_Response):
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int]
    logprobs: VLLMCompletionLogprobs | None = None


class VLLMUsage(_Response):
    prompt_tokens: int
    completion_tokens: int


class VLLMCompletionResponse(_Response):
    id: str
    choices: list[VLLMCompletionChoice] = Field(..., min_length=1, max_length=1)
    usage: VLLMUsage


class VLLMWeightInfo(_Response):
    weight_version: str | None = None


class VLLMModelCard(_Response):
    id: str
    root: str | None = None  # the --model it was started with


class VLLMModelList(_Response):
    data: list[VLLMModelCard] = Field(..., min_length=1)
