"""A chat episode kept as the exact tokens the policy saw and produced.

Re-rendering the conversation text and tokenising it again does not reproduce the generated tokens (a generated
token run need not be the tokenizer's canonical split of its text, BPE merges differ across turn boundaries,
decoding drops special tokens), so the trajectory is built incrementally: the prompt is tokenised once, each
turn's output ids are appended as the engine returned them (loss mask 1), and only the template text after a
turn (the end of the assistant message, the new messages, the generation prompt) is tokenised, on its own (loss
mask 0): `suffix_ids`. The shell agent's `TokenTrajectory` and the session server (`grpoflow.rollout.sessions`) share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=8)
def load_tokenizer(path: str):
    """One tokenizer per model dir per process: trials in the same rollout share it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class TemplateError(ValueError):
    """The chat template cannot be extended token-exactly (it does not close assistant turns with a special
    token, or renders earlier turns differently once new ones follow)."""


_PROBE = "grpoflow-probe-reply"


@lru_cache(maxsize=8)
def turn_end(tokenizer: Any) -> tuple[str, int]:
    """The special token the chat template closes an assistant turn with, and its id: found by rendering a probe
    conversation, not assumed to be the tokenizer's EOS (ChatML on a base model's tokenizer closes turns with
    `<|im_end|>` while its EOS is `<|endoftext|>`)."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}]
    text = render(tokenizer, messages, None, generation_prompt=False)
    at = text.rfind(_PROBE)
    if at < 0:
        raise TemplateError("the chat template does not render the assistant's reply as given")
    after = text[at + len(_PROBE) :]
    specials = {
        *tokenizer.all_special_tokens,
        *(t.content for t in tokenizer.added_tokens_decoder.values() if t.special),
    }
    for token in sorted(specials, key=len, reverse=True):
        if token and after.startswith(token):
            return token, tokenizer.convert_tokens_to_ids(token)
    raise TemplateError(
        f"the chat template does not close assistant turns with a special token (it writes {after[:20]!r})"
    )


def stop_ids(tokenizer: Any) -> frozenset[int]:
    """Token ids that end a turn by themselves: the template's turn end, the tokenizer's EOS, and every EOS the
    model's `generation_config.json` lists beside it (Llama-3.1's `<|eom_id|>` after a tool call): a turn that
    ends on one ended by itself, it was not cut off."""
    ids = {turn_end(tokenizer)[1], tokenizer.eos_token_id, *generation_eos_ids(tokenizer.name_or_path)}
    return frozenset(i for i in ids if i is not None)


def generation_eos_ids(model_dir: str | Path) -> list[int]:
    """`eos_token_id` of the model dir's generation_config.json (an id or a list of them); [] without one."""
    path = Path(model_dir) / "generation_config.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return []  # unreadable: the template's turn end and the tokenizer's EOS still stop a turn
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def check_chat_template(tokenizer: Any) -> None:
    """Raise `TemplateError` unless the template extends a conversation token-exactly turn after turn, as
    multi-turn training needs (a template that cannot would fail every multi-turn trial of a run)."""
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": _PROBE},
        {"role": "user", "content": "r"},
    ]
    suffix_ids(tokenizer, messages, 2, _PROBE, [], None, render(tokenizer, messages, None, generation_prompt=True))


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
    the assistant message (reply + the template's turn end, `turn_end`); everything after that is tokenised on
    its own. An output that stopped without it (a stop string, the EOS) gets the turn end the template writes
    there (a prompt token, not trained). Raises `TemplateError` when the template does not end assistant turns
    with a special token or renders the earlier turns differently once new messages follow.
    """
    end_token, end_id = turn_end(tokenizer)
    prefix_text = render(tokenizer, messages[:n_prefix], tools, generation_prompt=False)
    for text in dict.fromkeys((reply, reply.strip())):  # templates that trim the content
        marker = text + end_token
        at = prefix_text.rfind(marker)
        if at >= 0:
            break
    else:
        raise TemplateError(f"the chat template does not end assistant turns with {end_token}")
    end = at + len(marker)
    if full_text[:end] != prefix_text[:end]:
        raise TemplateError("the chat template renders earlier turns differently once new messages follow")
    ids = encode(tokenizer, full_text[end:])
    if not output_ids or output_ids[-1] != end_id:
        ids = [end_id] + ids
    return ids


@dataclass
class TokenTrajectory:
    tokenizer: Any
    messages: list[dict[str, str]]
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0

    @classmethod
    def start(cls, tokenizer: Any, messages: list[dict[str, str]]) -> TokenTrajectory:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        traj = cls(tokenizer, list(messages))
        traj._extend(ids, 0)
        traj.prompt_len = len(ids)
        return traj

    def add_generated(self, output_ids: list[int], logprobs: list[float]) -> str:
        """Append a policy turn exactly as generated; returns its text (special tokens dropped)."""
        if len(output_ids) != len(logprobs):
            raise ValueError(f"{len(output_ids)} output ids but {len(logprobs)} logprobs")
        self.tokens += output_ids
        self.loss_mask += [1] * len(output_ids)
        self.logprobs += list(logprobs)
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def add_user(self, content: str) -> int:
        """Close the last assistant turn, add a user message and the generation prompt. Returns tokens added."""
        n_prefix, reply = len(self.messages), self.messages[-1]["content"]
        self.messages.append({"role": "user", "content": content})
        full = render(self.tokenizer, self.messages, None, generation_prompt=True)
        ids = suffix_ids(self.tokenizer, self.messages, n_prefix, reply, self.tokens, None, full)
        self._extend(ids, 0)
        return len(ids)

    def _extend(self, ids: list[int], mask: int) -> None:
        self.tokens += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += [0.0] * len(ids)

    @property
    def n_generated(self) -> int:
        return sum(self.loss_mask)


def is_cut_off(finish_reason: str, output_ids: list[int], stop: frozenset[int]) -> bool:
    """Was a turn cut off at its token limit? SGLang reports `length` even when the last allowed token was a stop
    token (`stop_ids`): that turn ended by itself."""
    ended = bool(output_ids) and output_ids[-1] in stop
    return finish_reason == "length" and not ended
