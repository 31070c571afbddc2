"""A scripted policy behind an OpenAI chat-completions endpoint (what terminus-2's LiteLLM talks to).

A fake at the policy-server boundary: replies come from a script, `finish_reason` included, and every request is
recorded (messages, sampling params, Authorization header). Like the session server, it refuses with HTTP 400 any
request that extends a conversation whose last reply ended with `length`, so a harness that tried to go on would
be seen doing so.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.fakes.app_thread import AppThread


@dataclass
class Reply:
    text: str
    finish: str = "stop"  # "stop" | "length"


def terminus_json(commands: list[str], done: bool = False, duration: float = 0.1) -> str:
    """A reply in terminus-2's JSON format: each command typed into the terminal followed by Enter."""
    return json.dumps(
        {
            "analysis": "scripted",
            "plan": "scripted",
            "commands": [{"keystrokes": c + "\n", "duration": duration} for c in commands],
            "task_complete": done,
        }
    )


@dataclass
class ScriptedOpenAI:
    script: Callable[[list[dict], int], Reply]  # (messages, call index) -> reply
    requests: list[dict] = field(default_factory=list)
    refused: int = 0
    url: str = ""

    def __post_init__(self):
        app = FastAPI()
        closed: list[list[tuple[str, str]]] = []  # conversations (prompt + cut reply) that ended with `length`

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append({"body": body, "authorization": request.headers.get("authorization")})
            convo = [(m.get("role"), str(m.get("content"))) for m in body["messages"]]
            if any(convo[: len(c)] == c for c in closed):
                self.refused += 1
                return JSONResponse({"error": {"message": "this session ended with finish_reason length"}}, 400)
            reply = self.script(body["messages"], len(self.requests) - 1)
            if reply.finish == "length":
                closed.append(convo + [("assistant", reply.text)])
            return {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "m"),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": reply.text}, "finish_reason": reply.finish}
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

        self._app = AppThread(app)
        self.url = self._app.url

    def stop(self):
        self._app.stop()
