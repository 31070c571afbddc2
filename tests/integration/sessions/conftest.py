"""Fixtures: a scripted SGLang `/generate` at the HTTP boundary, the embedded engine over the tiny model, and a
session server over either."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from grpoflow.rollout.sessions.server import SessionServer
from grpoflow.tokens import load_tokenizer
from tests.fakes.app_thread import AppThread
from tests.fakes.scripted_engine import Reply, ScriptedEngine
from tests.fakes.session_settings import session_settings


def Out(ids: list[int], finish: str = "stop", logprobs: list[float] | None = None) -> Reply:
    """One scripted generation given as the engine's exact output ids (not a re-tokenisation of a text)."""
    return Reply(ids=ids, finish=finish, logprobs=logprobs)


@pytest.fixture
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture
def scripted(tiny_model_dir) -> Iterator[Callable[..., tuple[ScriptedEngine, SessionServer]]]:
    """`engine, server = scripted(script, **sections)`: a scripted engine and a session server over it, with the
    settings a run's config sections give (`tests.fakes.session_settings`)."""
    started: list = []

    def make(script, **kwargs):
        engine = ScriptedEngine(str(tiny_model_dir), script)
        # A turn may have 32 tokens, what the tests' harness asks for: a request asking for fewer than the run
        # allows is a side request (a title), kept out of training.
        kwargs.setdefault("sampling", {"max_new_tokens": 32})
        server = SessionServer(session_settings(engine.url, str(tiny_model_dir), **kwargs)).start()
        started.append((engine, server))
        return engine, server

    yield make
    for engine, server in started:
        server.stop()
        engine.stop()


@pytest.fixture(scope="module")
def embedded_engine_url(tiny_model_dir) -> Iterator[str]:
    """The real embedded engine (scheduler + SGLang-API server) over the tiny model, in this process."""
    from grpoflow.embedded.engine.scheduler import Scheduler
    from grpoflow.embedded.engine.server import create_app

    scheduler = Scheduler(tiny_model_dir, seed=0, max_batch_size=8)
    served = AppThread(create_app(scheduler, "tiny"))
    yield served.url
    served.stop()
    scheduler.close()
