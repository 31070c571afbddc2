"""Chat template rendering for the session server: the whole history, and only the suffix after a known turn.

Rendering the history to text and tokenising it again does not give back the tokens the policy generated (a
generated token run need not be the tokenizer's canonical split of its text, and BPE merges across turn
boundaries), so a request that continues an earlier turn reuses that turn's exact ids and tokenises only what the
template adds after it: the end of that assistant turn, the new messages, and the generation prompt.
"""

from __future__ import annotations

from typing import Any

from grpoflow.agents.chat_tokens import TemplateError


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool) -> str:
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)


def encode(tokenizer: Any, text: str) -> list[int]:
    # The template already wrote BOS and the other special tokens as text.
    return tokenizer.encode(text, add_special_tokens=False)


def suffix_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    n_prefix: int,
    reply: str,
    output_ids: list[int],
    tools: list[dict] | None,
    full_text: str,
) -> list[int]:
    """Ids to append to an earlier turn's prompt + output ids so they equal the prompt of `messages`.

    `messages[:n_prefix]` is the earlier turn's history ending with its assistant reply `reply`; `full_text` is
    `messages` rendered with the generation prompt. The earlier turn's output ends at the template's end of
    the assistant message (reply + EOS); everything after that is tokenised on its own. An output that stopped
    without EOS (a stop string or stop token) gets the EOS the template writes there (a prompt token, not
    trained). Raises `TemplateError` when the template does not end assistant turns with EOS or renders the
    earlier turns differently once new messages follow.
    """
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if eos is None or eos_id is None:
        raise TemplateError("the tokenizer has no EOS token to end assistant turns with")
    prefix_text = render(tokenizer, messages[:n_prefix], tools, generation_prompt=False)
    for text in dict.fromkeys((reply, reply.strip())):  # templates that trim the content
        marker = text + eos
        at = prefix_text.rfind(marker)
        if at >= 0:
            break
    else:
        raise TemplateError("the chat template does not end assistant turns with the EOS token")
    end = at + len(marker)
    if full_text[:end] != prefix_text[:end]:
        raise TemplateError("the chat template renders earlier turns differently once new messages follow")
    ids = encode(tokenizer, full_text[end:])
    if not output_ids or output_ids[-1] != eos_id:
        ids = [eos_id] + ids
    return ids


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (or the shorter length), None when equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
