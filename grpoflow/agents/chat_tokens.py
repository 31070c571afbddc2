"""A chat episode kept as the exact tokens the policy saw and produced.

Re-rendering the conversation text and tokenising it again does not reproduce the generated tokens (BPE merges
differ across turn boundaries, decoding drops special tokens), so the trajectory is built incrementally:
the prompt is tokenised once, each turn's output ids are appended as the engine returned them (loss mask 1), and
only the template text between turns (tool output wrapped as a user message, then the generation prompt) is
tokenised, on its own (loss mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=8)
def load_tokenizer(path: str):
    """One tokenizer per model dir per process: trials in the same rollout share it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class TemplateError(ValueError):
    """The chat template cannot be extended token-exactly (it does not close assistant turns with EOS)."""


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
        eos = self.tokenizer.eos_token
        eos_id = self.tokenizer.eos_token_id
        last = self.messages[-1]["content"]
        self.messages.append({"role": "user", "content": content})
        full = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
        marker = last + eos
        at = full.rfind(marker, 0, len(full) - len(content))
        if at < 0:
            raise TemplateError("chat template does not end assistant turns with the EOS token")
        ids = self.tokenizer.encode(full[at + len(marker) :], add_special_tokens=False)
        if not self.tokens or self.tokens[-1] != eos_id:  # the turn stopped without EOS (e.g. a stop string)
            ids = [eos_id] + ids
        self._extend(ids, 0)
        return len(ids)

    def _extend(self, ids: list[int], mask: int) -> None:
        self.tokens += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += [0.0] * len(ids)

    @property
    def n_generated(self) -> int:
        return sum(self.loss_mask)
