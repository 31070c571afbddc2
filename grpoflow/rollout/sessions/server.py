"""The session server: an OpenAI- and Anthropic-compatible chat front per session, token-exact over SGLang's
`/generate`.

    POST /sessions/<session_id>/v1/chat/completions     (OpenAI; streamed with stream=true)
    POST /sessions/<session_id>/v1/messages             (Anthropic Messages; streamed with stream=true)
    POST /sessions/<session_id>/v1/messages/count_tokens
    GET  /sessions/<session_id>/v1/models    GET /v1/models    GET /health    GET /stats

A harness gets `SessionServer.session_url(rollout_id)` as its OpenAI `api_base` (Anthropic clients: the same
without `/v1`) and `SessionServer.session_token(rollout_id)` as its API key: every session route refuses (401) a
request without the session's own token (`Authorization: Bearer` or `x-api-key`), so a trial cannot reach another
trial's session. Per request the server renders the
chat template (with `tools` when given); when the messages continue an earlier turn of the session (its messages
and the reply we returned, equal), it reuses that turn's exact prompt + output ids and tokenises only the new
suffix; otherwise the whole rendering is tokenised and the session's tree branches at the longest common token
prefix. It then calls the engine's `/generate` with `input_ids` and `return_logprob` and answers in OpenAI's
`chat.completion` shape: `logprobs.content` when `logprobs` is set, and with `return_token_ids` (vLLM / SGLang's
name, which Harbor's LiteLLM sends in `extra_body`) `choices[0].token_ids` and `prompt_token_ids`.

Tool calls: with a `tool_call_parser` the reply's text is parsed into `tool_calls` / `tool_use` blocks
(`grpoflow.rollout.sessions.tool_calls`); the trained tokens stay the generated ones. A reply the harness sends
back as history (in either API's shape) is recognised by its content and calls and rendered as the text the
policy generated, so the next prompt extends the turn's exact tokens.

Every request records whether tokenising the whole rendered history would have given other ids than the prompt
used (`retokenize_mismatch`); `/stats` and `SessionServer.stats()` report the rate.

A turn cut off at the token limit (finish_reason `length`, no EOS) closes its path: a later request that continues
it gets HTTP 400 (OpenAI error shape, code `session_path_closed`), which ends the harness's episode there. A prompt
at or past the context length gets 400 with OpenAI's `context_length_exceeded` code (harnesses that compact their
context react to it). With `truncation_ends_episode` (harnesses that cannot be stopped from outside: claude-code,
opencode) a cut-off turn is answered as a final text reply (finish `stop` / `end_turn`, no tool call parsed from
it), so the harness ends its episode without running the cut action and the trial is verified; the session still
records the turn as truncated. The API key is compared, never logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from grpoflow.config import ChatHarness, Engine, EpisodeConfig, SamplingConfig, ToolCallingHarness
from grpoflow.engine.clients import client_of
from grpoflow.engine.protocol import ChatParams, SamplingParams
from grpoflow.errors import EngineError, EngineUnavailableError
from grpoflow.rollout.sessions.tool_calls import ParsedReply, loads, message_key, parse_reply, parsed_key
from grpoflow.rollout.sessions.tree import SessionTree, Turn
from grpoflow.rollout.sessions.wire import (
    WireError,
    anthropic_error,
    anthropic_events,
    anthropic_message,
    anthropic_messages,
    anthropic_stop_reason,
    anthropic_tools,
    content_text,
    openai_chunks,
    openai_finish_reason,
)
from grpoflow.seeds import turn_seed
from grpoflow.tokens import (
    TemplateError,
    encode,
    is_cut_off,
    load_tokenizer,
    render,
    stop_ids,
    suffix_ids,
)

log = logging.getLogger(__name__)

# A rollout id is `step<N>-<instance id>-<k>` and instance ids are task names: allow anything printable but
# whitespace, `?` and `#` (a `/` travels percent-encoded and the route takes the rest of the path).
_SESSION_ID = re.compile(r"^[^\s?#]{1,400}$")


class ChatRequest(ChatParams):
    """A harness's chat request: any OpenAI message shape (tool calls, content parts) and tools, because the
    session server renders them with the model's own chat template."""

    messages: list[dict[str, Any]] = Field(..., min_length=1)
    tools: list[dict[str, Any]] | None = None
    stream_options: dict[str, Any] | None = None


class MessagesRequest(BaseModel):
    """An Anthropic Messages request (the fields the session server reads; others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    max_tokens: int = Field(..., ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False

    def chat(self) -> ChatRequest:
        """The same request as an internal (OpenAI-shaped) chat request."""
        try:
            messages = anthropic_messages(self.system, self.messages)
        except WireError as e:
            raise RequestRefused(str(e), "invalid_content") from e
        return ChatRequest(
            model=self.model,
            messages=messages,
            tools=anthropic_tools(self.tools),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
        )


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(1, ge=1)  # not part of a count request


class RequestRefused(Exception):
    """A request the session cannot serve: answered `status` (400) with the API's error body."""

    def __init__(self, message: str, code: str, kind: str = "invalid_request_error", status: int = 400):
        super().__init__(message)
        self.code, self.kind, self.status = code, kind, status


@dataclass
class _Session:
    tree: SessionTree
    seed: int | None = None
    lock: asyncio.Lock | None = None  # created in the server's loop
    # the harness's view of each reply (content and tool calls) -> the text the policy generated
    replies: dict[tuple, str] = field(default_factory=dict)


@dataclass
class SessionStore:
    """Sessions by id, shared between the server's loop thread and callers (a thread lock guards the dict)."""

    sessions: dict[str, _Session] = field(default_factory=dict)
    # counters of popped sessions, so stats() covers the whole run
    _done: dict[str, float] = field(default_factory=dict)
    _closed: set[str] = field(default_factory=set)  # popped: a late request must not open them again
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, session_id: str) -> _Session:
        """The live session; a request for one already popped (its trial ended, or its attempt was retried) is
        refused: a harness left running in a lost sandbox must not write turns that would train."""
        with self._lock:
            if session_id in self._closed:
                raise RequestRefused(
                    f"session {session_id} has ended: its trial finished or was run again", "session_closed", status=410
                )
            s = self.sessions.get(session_id)
            if s is None:
                s = self.sessions[session_id] = _Session(SessionTree(session_id))
            return s

    def register(self, session_id: str, seed: int | None) -> None:
        with self._lock:
            if session_id in self._closed:
                raise ValueError(f"session {session_id} has ended; a new attempt needs a session of its own")
            s = self.sessions.setdefault(session_id, _Session(SessionTree(session_id)))
            s.seed = seed

    def pop(self, session_id: str) -> SessionTree:
        with self._lock:
            self._closed.add(session_id)
            s = self.sessions.pop(session_id, None)
            tree = s.tree if s is not None else SessionTree(session_id)
            for k, v in tree.stats().items():
                self._done[k] = self._done.get(k, 0.0) + v
            self._done["sessions"] = self._done.get("sessions", 0.0) + 1
            return tree

    def stats(self) -> dict[str, float]:
        """Totals over every session seen (popped and live); `retokenize_mismatch_rate` over all requests."""
        with self._lock:
            out = dict(self._done)
            for s in self.sessions.values():
                for k, v in s.tree.stats().items():
                    out[k] = out.get(k, 0.0) + v
            out["sessions"] = out.get("sessions", 0.0) + len(self.sessions)
        out.pop("retokenize_mismatch_rate", None)
        n = out.get("requests", 0.0)
        out["retokenize_mismatch_rate"] = out.get("retokenize_mismatches", 0.0) / n if n else 0.0
        return out


@dataclass(frozen=True)
class SessionSettings:
    """What the session server does with every session: the run's own sections, each setting's one default in the
    config. `sampling` caps every turn (its `max_new_tokens` wins over the harness's `max_tokens`) and pins what
    every turn samples with, whatever the harness sends: the trainer scores the tokens under the run's sampling, so
    the engine must sample under it too. `episode.max_context_tokens` bounds prompt + output (the caller fits it to
    the engine's context, `grpoflow.rollout.policy.fit_to_engine`). `harness`: how replies are parsed into tool
    calls (its `tool_call_parser`; none for terminus-2) and whether a cut turn ends the episode (see the module doc).
    `engine`: the run's engine section (its API, request timeout, retries, and how long a turn waits out an engine
    that does not answer). `lora_path`: the adapter every generation names (a LoRA run's adapter sync,
    `grpoflow.train.sync`)."""

    engine_url: str
    tokenizer_path: str
    engine: Engine
    sampling: SamplingConfig
    episode: EpisodeConfig
    harness: ChatHarness
    lora_path: str | None = None
    model_name: str = "policy"

    @property
    def tool_call_parser(self) -> str | None:
        return self.harness.tool_call_parser if isinstance(self.harness, ToolCallingHarness) else None

    @property
    def truncation_ends_episode(self) -> bool:
        return self.harness.in_sandbox_cli and self.episode.early_truncation_exit

    @property
    def pinned_sampling(self) -> dict[str, Any]:
        return self.sampling.model_dump(include={"temperature", "top_p", "top_k"})


class SessionService:
    """What every route of the session server works with: the settings, the sessions, the tokenizer and the
    engine's client. `secret`: the key of the per-session tokens (`session_token`)."""

    def __init__(self, settings: SessionSettings, store: SessionStore, secret: bytes):
        self.settings, self.store, self.secret = settings, store, secret
        self.tokenizer = load_tokenizer(str(settings.tokenizer_path))
        # the template's turn end and the EOS; a template without one fails here, at start
        self.stop = stop_ids(self.tokenizer)
        # HF fast tokenizers reconfigure their Rust state on each call, so concurrent calls can fail: one thread
        # does all tokenising, off the event loop.
        self.tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-tokenizer")
        self.engine = client_of(
            settings.engine, settings.engine_url, lora_path=settings.lora_path, waits_out_outages=True
        )

    async def aclose(self) -> None:
        await self.engine.aclose()
        self.tok_pool.shutdown(wait=False)

    def card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "grpoflow"}

    def authorise(self, session_id: str, request: Request) -> None:
        if not _SESSION_ID.match(session_id):
            raise RequestRefused(f"invalid session id {session_id[:80]!r}", "invalid_session_id")
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), session_token(self.secret, session_id).encode()):
            raise RequestRefused(
                f"session {session_id[:80]}: missing or wrong API key (each session takes its own token)",
                "invalid_api_key",
                kind="authentication_error",
                status=401,
            )

    async def serve(
        self, session_id: str, req: ChatRequest, request: Request, id_prefix: str
    ) -> tuple[Turn, ParsedReply, list[int], list[float]]:
        """One turn of session `session_id`: generated, recorded in its tree, its reply parsed."""
        session = self.store.get(session_id)
        if session.lock is None:
            session.lock = asyncio.Lock()
        async with session.lock:  # a session's requests are sequential; keep them so if a harness misbehaves
            turn, prompt_ids, logprobs = await self._turn(session, req)
            # A cut reply is never parsed: its last call may be cut, and the cut action must not run. A request
            # without tools (terminus-2) gets the text as written.
            parser = self.settings.tool_call_parser if req.tools and not turn.truncated else None
            parsed = parse_reply(turn.reply, parser, id_prefix=id_prefix)
            session.replies[parsed_key(parsed)] = turn.reply
            if await request.is_disconnected():  # the harness gave up on this request: it never sees the reply
                session.tree.abandon(turn)
            return turn, parsed, prompt_ids, logprobs

    async def _turn(self, session: _Session, req: ChatRequest) -> tuple[Turn, list[int], list[float]]:
        c, tree, stop = self.settings, session.tree, self.stop
        loop = asyncio.get_running_loop()
        messages = [_template_message(m, session.replies) for m in req.messages]
        prev = tree.extended_turn(messages, req.tools)
        if prev is not None and prev.truncated:
            tree.refused += 1
            raise _closed(tree.session_id, prev.index)
        plan = await loop.run_in_executor(self.tok_pool, _prompt_plan, self.tokenizer, tree, messages, req.tools, prev)
        prompt_ids, full_ids, extends = plan
        closed = tree.closed_prefix(prompt_ids)
        if closed is not None:
            tree.refused += 1
            raise _closed(tree.session_id, closed.index)
        params = _sampling(req, len(prompt_ids), c, session, len(tree.turns))
        params.stop_token_ids = sorted({*(params.stop_token_ids or []), *stop})  # the turn end too
        t0 = time.perf_counter()
        try:
            resp = await self.engine.agenerate(
                prompt_ids, params, return_logprob=True, on_fault=lambda why: setattr(tree, "engine_outage", why)
            )
        except EngineUnavailableError:
            tree.engine_failures += 1  # the trial then fails for the engine, not for the policy
            raise
        tree.engine_outage = None
        gen_s = time.perf_counter() - t0
        out_ids, logprobs = list(resp.output_ids), resp.logprobs
        if len(logprobs) != len(out_ids):
            raise EngineError(f"/generate: {len(out_ids)} output ids but {len(logprobs)} logprobs")
        cut = is_cut_off(resp.meta_info.finish_reason.type, out_ids, stop)
        # A harness's own, smaller `max_tokens` (a title request) ends the reply where it asked: the harness sees
        # "length", but the policy was not cut short by the run's limit, so the trial is not over-long.
        own = _own_limit(req, c.sampling.max_new_tokens)
        mismatch_at = first_difference(prompt_ids, full_ids)
        turn = tree.add_turn(
            messages,
            prompt_ids,
            out_ids,
            logprobs,
            reply=resp.text,
            finish_reason="length" if cut else "stop",
            truncated=cut and not (own is not None and len(out_ids) >= own),
            own_limit=own is not None,
            extends=extends,
            retokenize_mismatch=mismatch_at is not None,
            first_mismatch=mismatch_at,
            sampling=params.model_dump(include={"temperature", "top_p", "top_k", "sampling_seed"}),
            tools=req.tools,
            weight_version=resp.meta_info.weight_version,
            generation_time_s=gen_s,
        )
        return turn, prompt_ids, logprobs


def create_app(settings: SessionSettings, store: SessionStore, secret: bytes) -> FastAPI:
    """The session server app; `secret`: the key of the per-session tokens (`session_token`)."""
    service = SessionService(settings, store, secret)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        try:
            yield
        finally:
            await service.aclose()

    app = FastAPI(title="grpoflow session server", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.service = service
    _install_error_handlers(app)
    app.include_router(router)
    return app


router = APIRouter()


def _service(request: Request) -> SessionService:
    return request.app.state.service


Service = Annotated[SessionService, Depends(_service)]


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/stats")
async def stats(service: Service) -> dict:
    return service.store.stats()


@router.get("/v1/models")
async def models(service: Service) -> dict:
    return {"object": "list", "data": [service.card()]}


@router.get("/sessions/{session_id:path}/v1/models")
async def session_models(session_id: str, request: Request, service: Service) -> dict:
    service.authorise(session_id, request)
    return {"object": "list", "data": [service.card()]}


@router.post("/sessions/{session_id:path}/v1/chat/completions")
async def chat(session_id: str, req: ChatRequest, request: Request, service: Service):
    service.authorise(session_id, request)
    if req.n != 1:
        raise RequestRefused(
            f"n={req.n}: a session records one path per request, so n must be 1", "unsupported_parameter"
        )
    c = service.settings
    turn, parsed, prompt_ids, logprobs = await service.serve(session_id, req, request, "call_")
    body = _response(
        service.tokenizer, req, c.model_name, prompt_ids, turn, parsed, logprobs, c.truncation_ends_episode
    )
    if req.stream:
        usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(openai_chunks(body, usage), media_type="text/event-stream")
    return body


@router.post("/sessions/{session_id:path}/v1/messages")
async def messages(session_id: str, req: MessagesRequest, request: Request, service: Service):
    service.authorise(session_id, request)
    c = service.settings
    turn, parsed, prompt_ids, _ = await service.serve(session_id, req.chat(), request, "toolu_")
    finish = _reported_finish(turn, c.truncation_ends_episode)
    body = anthropic_message(
        parsed,
        anthropic_stop_reason(parsed, finish),
        req.model or c.model_name,
        len(prompt_ids),
        len(turn.output_ids),
    )
    if req.stream:
        return StreamingResponse(anthropic_events(body), media_type="text/event-stream")
    return body


@router.post("/sessions/{session_id:path}/v1/messages/count_tokens")
async def count_tokens(session_id: str, req: CountTokensRequest, request: Request, service: Service) -> dict:
    """The prompt's length as the policy would see it (a fresh rendering; claude-code asks before compacting)."""
    service.authorise(session_id, request)
    chat = req.chat()
    session = service.store.get(session_id)
    messages = [_template_message(m, session.replies) for m in chat.messages]
    tokenizer = service.tokenizer
    ids = await asyncio.get_running_loop().run_in_executor(
        service.tok_pool, lambda: encode(tokenizer, render(tokenizer, messages, chat.tools, generation_prompt=True))
    )
    return {"input_tokens": len(ids)}


def session_token(secret: bytes, session_id: str) -> str:
    """The API key of one session: a MAC of its id under the server's secret (nothing to store per session, and
    no session's token says anything about another's)."""
    return hmac.new(secret, session_id.encode(), hashlib.sha256).hexdigest()


def _template_message(m: dict[str, Any], replies: Mapping[tuple, str]) -> dict[str, Any]:
    """A request message as the chat template gets it: content as text, fields the template may use kept. An
    assistant message that is one of the session's replies (its content and calls, in the harness's shape)
    becomes the text the policy generated, tool calls and all, so its rendering is what the policy wrote."""
    key = message_key(m)
    if key is not None and key in replies:
        return {"role": "assistant", "content": replies[key]}
    try:
        content = content_text(m.get("content"), "message content")
    except WireError as e:
        raise RequestRefused(str(e), "unsupported_content") from e
    if not isinstance(m.get("role"), str):
        raise RequestRefused("every message needs a string `role`", "invalid_message")
    out = {k: v for k, v in m.items() if k in ("role", "name", "tool_call_id") and v is not None}
    if m.get("tool_calls"):  # a call the session does not know (edited history): arguments as the object they are
        out["tool_calls"] = [_call_with_object_arguments(c) for c in m["tool_calls"]]
    out["content"] = content
    return out


def _call_with_object_arguments(call: Any) -> Any:
    """OpenAI sends a call's arguments as a JSON string; chat templates write them with `tojson`, so a string
    would be encoded twice (SGLang and vLLM parse them first too)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


def _prompt_plan(tokenizer, tree: SessionTree, messages, tools, prev) -> tuple[list[int], list[int], int | None]:
    """(prompt ids to send, ids of the whole history tokenised afresh, the turn whose ids were reused)."""
    full_text = render(tokenizer, messages, tools, generation_prompt=True)
    full_ids = encode(tokenizer, full_text)
    if prev is None:
        return full_ids, full_ids, None
    try:
        suffix = suffix_ids(tokenizer, messages, len(prev.messages) + 1, prev.reply, prev.output_ids, tools, full_text)
    except TemplateError as e:
        tree.extend_failures += 1
        log.warning(
            "session %s: cannot extend turn %d token-exactly (%s); tokenising the whole history",
            tree.session_id,
            prev.index,
            e,
        )
        return full_ids, full_ids, None
    base, _, _ = tree.path(prev.end)
    return base + suffix, full_ids, prev.index


def _own_limit(req: ChatRequest, cap: int) -> int | None:
    """The request's own token limit when it is below the run's (`max_new_tokens`), else None."""
    wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return wanted if wanted is not None and wanted < cap else None


def _sampling(
    req: ChatRequest, prompt_len: int, settings: SessionSettings, session: _Session, turn: int
) -> SamplingParams:
    """The turn's sampling: the run's pinned parameters whatever the request asks, at most the run's turn length
    and what the context leaves, and a seed of the session's (trial seed, turn) when the session has one: a harness
    sending one `seed` on every call would replay one noise stream."""
    context_length = settings.episode.max_context_tokens
    if prompt_len >= context_length:
        raise RequestRefused(
            f"This model's maximum context length is {context_length} tokens. However, your messages resulted in "
            f"{prompt_len} tokens.",
            "context_length_exceeded",
        )
    wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    limits = [x for x in (wanted, settings.sampling.max_new_tokens, context_length - prompt_len) if x is not None]
    seed = turn_seed(session.seed, turn) if session.seed is not None else req.seed
    try:
        return SamplingParams(
            max_new_tokens=min(limits),
            **settings.pinned_sampling,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            sampling_seed=seed,
        )
    except ValueError as e:
        raise RequestRefused(f"invalid sampling parameters: {e}", "invalid_sampling_parameters") from e


def _response(
    tokenizer,
    req: ChatRequest,
    model_name: str,
    prompt_ids: list[int],
    turn: Turn,
    parsed: ParsedReply,
    logprobs: list[float],
    truncation_ends_episode: bool,
) -> dict:
    finish = _reported_finish(turn, truncation_ends_episode)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [c.openai() for c in parsed.tool_calls]
        message["content"] = parsed.content or None
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": openai_finish_reason(parsed, finish),
        "logprobs": {"content": _logprob_content(tokenizer, turn.output_ids, logprobs)} if req.logprobs else None,
    }
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model or model_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(turn.output_ids),
            "total_tokens": len(prompt_ids) + len(turn.output_ids),
        },
        "weight_version": turn.weight_version,
    }
    if req.return_token_ids:
        choice["token_ids"] = turn.output_ids
        body["prompt_token_ids"] = prompt_ids
    return body


def _reported_finish(turn: Turn, truncation_ends_episode: bool) -> str:
    """What the harness is told: a cut turn is a final one when the harness must end its episode on it."""
    return "stop" if turn.truncated and truncation_ends_episode else turn.finish_reason


def _logprob_content(tokenizer, ids: list[int], logprobs: list[float]) -> list[dict]:
    out = []
    for tok, lp in zip(ids, logprobs, strict=True):
        piece = tokenizer.decode([tok])
        out.append({"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")), "top_logprobs": []})
    return out


def _closed(session_id: str, turn: int) -> RequestRefused:
    return RequestRefused(
        f"session {session_id}: this conversation continues turn {turn}, whose reply was cut off at the token "
        "limit (finish_reason length); that path is closed and the episode ends there",
        "session_path_closed",
    )


def _error(request: Request, status: int, message: str, kind: str, code: str | None) -> JSONResponse:
    if "/v1/messages" in request.url.path:  # an Anthropic client reads Anthropic's error shape
        if code == "context_length_exceeded":  # and claude-code compacts on Anthropic's own wording
            message = f"prompt is too long: {message}"
        return JSONResponse(anthropic_error(status, message), status_code=status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestRefused)
    async def _refused(request: Request, exc: RequestRefused) -> JSONResponse:
        return _error(request, exc.status, str(exc), exc.kind, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:3]:
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            parts.append(f"{loc}: {err.get('msg')}")  # never the input: it is the harness's text
        return _error(request, 400, f"{request.url.path}: " + "; ".join(parts), "invalid_request_error", "invalid_body")

    @app.exception_handler(EngineUnavailableError)
    async def _unavailable(request: Request, exc: EngineUnavailableError) -> JSONResponse:
        log.warning("engine unavailable on %s: %s", request.url.path, exc)
        return _error(request, 503, f"the engine is unavailable: {exc}", "api_error", "engine_unavailable")

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        log.warning("engine call failed on %s: %s", request.url.path, exc)
        return _error(request, 502, f"the engine failed: {exc}", "api_error", "engine_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Only the path and the exception: headers (the API key) and bodies never reach the log.
        log.error("unhandled error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
        return _error(request, 500, f"{type(exc).__name__}: {exc}", "api_error", "internal_error")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (or the shorter length), None when equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class SessionServer:
    """The session server in this process: uvicorn on a free loopback port, in a daemon thread with its own loop.

    Usable from sync and async code alike (`start`/`stop` block briefly; `with` and `async with` work):

        with SessionServer(SessionSettings(engine_url, tokenizer_path, engine, sampling, episode, harness)) as srv:
            api_base = srv.session_url(rollout_id, seed=trial_seed)   # ends in /v1
            api_key = srv.session_token(rollout_id)
            ... the harness talks to api_base with api_key ...
            tree = srv.pop_session(rollout_id)                        # after the trial ended
            samples = segment_samples(trial_sample, tree)
    """

    def __init__(self, settings: SessionSettings, *, host: str = "127.0.0.1", public_url: str | None = None):
        """`public_url`: the URL sandboxes elsewhere reach this server at (`rollout.harness.session_server_url`); the
        server then listens on every interface at its port. Without it, on `host` (loopback) at a free port."""
        self.settings, self.store = settings, SessionStore()
        self._secret = secrets.token_bytes(32)  # per server: tokens of another run's server are refused
        self._host, self._port = host, 0
        self._public_url = public_url.rstrip("/") if public_url else None
        if self._public_url:
            port = urlsplit(self._public_url).port
            if port is None:
                raise ValueError(f"session server URL {public_url!r}: give the port it listens on")
            self._host, self._port = "0.0.0.0", port
        self.model_name = settings.model_name
        self.url = ""
        self._server = None
        self._thread: threading.Thread | None = None
        self._sock = None

    def start(self, timeout_s: float = 30.0) -> SessionServer:
        import uvicorn

        from grpoflow.sockets import bind_socket

        if self._thread is not None:
            return self
        for s in self.store.sessions.values():  # a restarted server runs a new event loop: old locks are bound
            s.lock = None
        app = create_app(self.settings, self.store, self._secret)
        self._sock = bind_socket(self._host, self._port)
        self.url = self._public_url or f"http://{self._host}:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="session-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"session server at {self.url} did not start within {timeout_s:.0f} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None

    def session_url(self, session_id: str, seed: int | None = None) -> str:
        """The OpenAI `api_base` for one session (ends in /v1). With `seed` (the trial's), every turn samples
        with `turn_seed(seed, turn)`, whatever seed the request sends, so a trial's generations are a function of
        its seed."""
        if not _SESSION_ID.match(session_id):
            raise ValueError(f"session id {session_id!r}: 1 to 400 characters, no whitespace, `?` or `#`")
        if seed is not None:
            self.store.register(session_id, seed)
        return f"{self.url}/sessions/{quote(session_id, safe='')}/v1"

    def session_token(self, session_id: str) -> str:
        """The API key the session's harness must send (`Authorization: Bearer` or `x-api-key`)."""
        return session_token(self._secret, session_id)

    def pop_session(self, session_id: str) -> SessionTree:
        """The session's recorded tree, forgotten here (a session that made no request gives an empty tree).
        Call it after the trial ended; a later request with the same id is refused (410)."""
        return self.store.pop(session_id)

    def stats(self) -> dict[str, float]:
        return self.store.stats()

    def __enter__(self) -> SessionServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self) -> SessionServer:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.stop)
