"""OpenAI chat completions on top of the scheduler: chat template in, OpenAI-shaped JSON out.

Token ids follow SGLang / vLLM's `return_token_ids`: `prompt_token_ids` on the response and `token_ids` on each
choice. Harbor 0.25's LiteLLM wrapper (`harbor/llms/lite_llm.py::_extract_token_ids`, used by terminus-2 with
`collect_rollout_details`) reads exactly these: litellm copies unknown choice keys into
`choice.provider_specific_fields["token_ids"]` and unknown top-level keys onto the response object
(`response.prompt_token_ids`); logprobs are read from `choices[0].logprobs.content[*].logprob`.
`top_logprobs` is accepted but each token's list is left empty.
"""

from __future__ import annotations

import time
import uuid

from grpoflow.embedded.engine.scheduler import GenerationResult, InvalidRequest
from grpoflow.engine.protocol import ChatCompletionRequest, SamplingParams


def chat_prompt_ids(tokenizer, req: ChatCompletionRequest) -> list[int]:
    """Render the conversation with the tokenizer's chat template plus the assistant header; return its ids."""
    if req.stream:
        raise InvalidRequest("stream=true is not supported by the embedded engine")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("the model's tokenizer has no chat_template; use /generate with input_ids")
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already wrote any BOS/special tokens as text.
    return tokenizer.encode(text, add_special_tokens=False)


def chat_sampling_params(
    req: ChatCompletionRequest, prompt_len: int, context_length: int, index: int
) -> SamplingParams:
    """Sampling params of choice `index`; without max_tokens the completion may fill the context (as SGLang)."""
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_new is None:
        max_new = max(context_length - prompt_len, 0)
    try:
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            sampling_seed=None if req.seed is None else req.seed + index,
        )
    except ValueError as e:
        raise InvalidRequest(f"invalid sampling parameters: {e}") from e


def chat_response(
    tokenizer, req: ChatCompletionRequest, model_name: str, prompt_ids: list[int], results: list[GenerationResult]
) -> dict:
    choices = []
    for i, r in enumerate(results):
        choice: dict = {
            "index": i,
            "message": {"role": "assistant", "content": r.text},
            "finish_reason": r.finish_reason["type"],
            "logprobs": {"content": _logprob_content(tokenizer, r)} if req.logprobs else None,
        }
        if req.return_token_ids:
            choice["token_ids"] = r.output_ids
        choices.append(choice)
    completion_tokens = sum(len(r.output_ids) for r in results)
    body: dict = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
        "weight_version": results[0].weight_version,
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def _logprob_content(tokenizer, r: GenerationResult) -> list[dict]:
    content = []
    for tok, lp in zip(r.output_ids, r.output_logprobs, strict=True):
        piece = tokenizer.decode([tok])
        content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")), "top_logprobs": []})
    return content
