"""Fixtures: a scripted SGLang `/generate` at the HTTP boundary, the embedded engine over the tiny model, and a
session server over either."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request

from grpoflow.agents.chat_tokens import load_tokenizer
from grpoflow.engine.protocol import GenerateRequest
from grpoflow.sessions.server import SessionServer
from tests.app_thread import AppThread


@dataclass
class Out:
    """One scripted generation: the exact output ids (the engine's, not a re-tokenisation of `text`)."""

    ids: list[int]
    finish: str = "stop"  # "stop" | "length"
    logprobs: list[float] | None = None  # default: -0.1 * (position + 1)


@dataclass
class ScriptedEngine:
    """SGLang's `/generate` answering from `script(input_ids, call index) -> Out`; records every request."""

    tokenizer_path: str
    script: Callable[[list[int], int], Out]
    calls: list[GenerateRequest] = field(default_factory=list)
    url: str = ""

    def __post_init__(self):
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request):
            req = GenerateRequest.model_validate(await request.json())
            out = self.script(req.input_ids, len(self.calls))
            self.calls.append(req)
            lps = out.logprobs or [-0.1 * (i + 1) for i in range(len(out.ids))]
            text = self.tokenizer.decode(out.ids, skip_special_tokens=True)
            return {
                "text": text, "output_ids": out.ids,
                "meta_info": {
                    "id": str(len(self.calls)), "finish_reason": {"type": out.finish}, "weight_version": "3",
                    "prompt_tokens": len(req.input_ids), "completion_tokens": len(out.ids),
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out.ids, strict=True)],
                },
            }  # fmt: skip

        self._app = AppThread(app)
        self.url = self._app.url

    def stop(self):
        self._app.stop()


@pytest.fixture
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture
def scripted(tiny_model_dir) -> Iterator[Callable[..., tuple[ScriptedEngine, SessionServer]]]:
    """`engine, server = scripted(script, **server_kwargs)`: a scripted engine and a session server over it."""
    started: list = []

    def make(script, **kwargs):
        engine = ScriptedEngine(str(tiny_model_dir), script)
        kwargs.setdefault("context_length", 2048)
        server = SessionServer(engine.url, str(tiny_model_dir), **kwargs).start()
        started.append((engine, server))
        return engine, server

    yield make
    for engine, server in started:
        server.stop()
        engine.stop()


@pytest.fixture(scope="module")
def embedded_engine_url(tiny_model_dir) -> Iterator[str]:
    """The real embedded engine (scheduler + SGLang-API server) over the tiny model, in this process."""
    from grpoflow.engine.scheduler import Scheduler
    from grpoflow.engine.server import create_app

    scheduler = Scheduler(tiny_model_dir, seed=0, max_batch_size=8)
    served = AppThread(create_app(scheduler, "tiny"))
    yield served.url
    served.stop()
    scheduler.close()
