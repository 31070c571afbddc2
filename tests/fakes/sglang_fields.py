"""SGLang's request field names, copied from sgl-project/sglang (read at commits 001067ff / 00c17caf):
GenerateReqInput and UpdateWeightFromDiskReqInput/Output from python/sglang/srt/managers/io_struct.py,
SamplingParams from python/sglang/srt/sampling/sampling_params.py. The contract tests pin grpoflow's models to
them and the SGLang stand-in accepts exactly them. If SGLang renames a field, update it here from its source."""

# io_struct.py: GenerateReqInput (the request fields a client may send; internal-only fields left out)
SGLANG_GENERATE_REQ_INPUT = {
    "rid",
    "session_id",
    "text",
    "input_ids",
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_sampling_mask",
    "return_text_in_logprobs",
    "stream",
    "log_metrics",
    "return_hidden_states",
    "return_routed_experts",
    "modalities",
    "session_params",
    "lora_path",
    "lora_id",
    "custom_logit_processor",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "routed_dp_rank",
    "data_parallel_rank",
    "priority",
    "extra_key",
    "no_logs",
    "custom_labels",
    "return_bytes",
    "return_entropy",
    "return_prompt_token_ids",
}

# sampling_params.py: SamplingParams API parameters ("set by callers")
SGLANG_SAMPLING_PARAMS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}

# io_struct.py: UpdateWeightFromDiskReqInput / UpdateWeightFromDiskReqOutput
SGLANG_UPDATE_WEIGHT_FROM_DISK_REQ_INPUT = {
    "model_path",
    "load_format",
    "abort_all_requests",
    "weight_version",
    "is_async",
    "torch_empty_cache",
    "keep_pause",
    "recapture_cuda_graph",
    "token_step",
    "flush_cache",
    "manifest",
}
SGLANG_UPDATE_WEIGHT_FROM_DISK_REQ_OUTPUT = {"success", "message", "num_paused_requests"}

# io_struct.py: InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput and their outputs
SGLANG_INIT_WEIGHTS_UPDATE_GROUP_REQ_INPUT = {
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "group_name",
    "backend",
}
SGLANG_UPDATE_WEIGHTS_FROM_DISTRIBUTED_REQ_INPUT = {
    "names",
    "dtypes",
    "shapes",
    "group_name",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
    "load_format",
    "selector",
    "torch_empty_cache",
}
SGLANG_WEIGHTS_UPDATE_GROUP_REQ_OUTPUT = {"success", "message"}  # both outputs

# io_struct.py: UpdateWeightsFromTensorReqInput (its output: success, message, as above)
SGLANG_UPDATE_WEIGHTS_FROM_TENSOR_REQ_INPUT = {
    "serialized_named_tensors",
    "load_format",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
    "disable_draft_model",
    "selector",
    "torch_empty_cache",
}

# io_struct.py (0.5.23): BeginWeightUpdateReqInput, EndWeightUpdateReqInput; both answer success, message
SGLANG_BEGIN_WEIGHT_UPDATE_REQ_INPUT = {"selector"}
SGLANG_END_WEIGHT_UPDATE_REQ_INPUT: set[str] = set()

# io_struct.py: LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput, LoRAUpdateOutput (both answers),
# UpdateWeightVersionReqInput
SGLANG_LOAD_LORA_ADAPTER_REQ_INPUT = {"lora_name", "lora_path", "pinned", "lora_id"}
SGLANG_UNLOAD_LORA_ADAPTER_REQ_INPUT = {"lora_name", "lora_id"}
SGLANG_LORA_UPDATE_OUTPUT = {"success", "error_message", "loaded_adapters"}
SGLANG_UPDATE_WEIGHT_VERSION_REQ_INPUT = {"new_version", "abort_all_requests"}

# sampling_params.py defaults (top_k: TOP_K_ALL internally; -1 is its documented "disabled" input)
SGLANG_SAMPLING_DEFAULTS = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": False}

# python/sglang/srt/function_call/function_call_parser.py: FunctionCallParser.ToolCallParserEnum, the
# `--tool-call-parser` names (read in the search tool's copy of sgl-project/sglang; update from its source)
SGLANG_TOOL_CALL_PARSERS = {
    "deepseekv3",
    "deepseekv31",
    "deepseekv32",
    "glm",
    "glm45",
    "glm47",
    "gpt-oss",
    "kimi_k2",
    "llama3",
    "mimo",
    "mistral",
    "pythonic",
    "qwen",
    "qwen25",
    "qwen3_coder",
    "step3",
    "minimax-m2",
    "trinity",
    "interns1",
}
