"""A scripted policy behind SGLang's `/generate`: replies come from a function, tokens from the real tokenizer.

A fake at the GPU-server boundary, answering with our protocol models (which the contract tests pin to SGLang's
field names), so agents are tested on exact scripted behaviour: truncated turns, given commands, engine faults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from grpoflow.agents.chat_tokens import load_tokenizer
from grpoflow.engine.protocol import GenerateRequest
from tests.app_thread import AppThread


@dataclass
class Reply:
    text: str
    finish: str = "stop"  # "stop" | "length"
    status: int = 200  # an HTTP error status makes the engine fail this call


@dataclass
class ScriptedEngine:
    tokenizer_path: str
    script: Callable[[list[int], int], Reply]  # (input_ids, call index) -> reply
    calls: list[dict] = field(default_factory=list)
    url: str = ""

    def __post_init__(self):
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request):
            req = GenerateRequest.model_validate(await request.json())
            reply = self.script(req.input_ids, len(self.calls))
            self.calls.append({"input_ids": req.input_ids, "reply": reply})
            if reply.status != 200:
                return JSONResponse({"error": "scripted failure"}, status_code=reply.status)
            ids = self.tokenizer.encode(reply.text, add_special_tokens=False)
            if reply.finish == "stop":
                ids.append(self.tokenizer.eos_token_id)
            return {
                "text": reply.text,
                "output_ids": ids,
                "meta_info": {
                    "id": str(len(self.calls)), "finish_reason": {"type": reply.finish},
                    "prompt_tokens": len(req.input_ids), "completion_tokens": len(ids),
                    "output_token_logprobs": [[-0.25, t, None] for t in ids], "weight_version": "7",
                },
            }  # fmt: skip

        @app.get("/health")
        async def health():
            return {}

        self._app = AppThread(app)
        self.url = self._app.url

    def stop(self):
        self._app.stop()
