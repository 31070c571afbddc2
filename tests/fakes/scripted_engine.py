"""A scripted policy behind SGLang's `/generate`: replies come from a function, tokens from the real tokenizer.

A fake at the GPU-server boundary, answering with our protocol models (which the contract tests pin to SGLang's
field names), so agents are tested on exact scripted behaviour: truncated turns, given commands, engine faults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from grpoflow.engine.protocol import GenerateRequest
from grpoflow.tokens import load_tokenizer
from tests.fakes.app_thread import AppThread


@dataclass
class Reply:
    """One scripted generation: `text` (tokenised, EOS appended on `stop`), or the exact output `ids` (the
    engine's own, e.g. a non-canonical split of their text; nothing appended)."""

    text: str = ""
    finish: str = "stop"  # "stop" | "length"
    status: int = 200  # an HTTP error status makes the engine fail this call
    ids: list[int] | None = None
    logprobs: list[float] | None = None  # default: -0.1 * (position + 1), so misaligned logprobs show
    weight_version: str = "7"  # what meta_info says the engine served the turn with

    def output_ids(self, tokenizer) -> list[int]:
        if self.ids is not None:
            return list(self.ids)
        ids = tokenizer.encode(self.text, add_special_tokens=False)
        return ids + [tokenizer.eos_token_id] if self.finish == "stop" else ids


@dataclass
class ScriptedEngine:
    tokenizer_path: str
    script: Callable[[list[int], int], Reply]  # (input_ids, call index) -> reply
    calls: list[GenerateRequest] = field(default_factory=list)  # every request, in order
    url: str = ""

    def __post_init__(self):
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request):
            req = GenerateRequest.model_validate(await request.json())
            reply = self.script(req.input_ids, len(self.calls))
            self.calls.append(req)
            if reply.status != 200:
                return JSONResponse({"error": "scripted failure"}, status_code=reply.status)
            ids = reply.output_ids(self.tokenizer)
            lps = reply.logprobs or [-0.1 * (i + 1) for i in range(len(ids))]
            return {
                "text": self.tokenizer.decode(ids, skip_special_tokens=True),
                "output_ids": ids,
                "meta_info": {
                    "id": str(len(self.calls)),
                    "finish_reason": {"type": reply.finish},
                    "prompt_tokens": len(req.input_ids),
                    "completion_tokens": len(ids),
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
                    "weight_version": reply.weight_version,
                },
            }

        @app.get("/health")
        async def health():
            return {}

        self._app = AppThread(app)
        self.url = self._app.url

    def stop(self):
        self._app.stop()
