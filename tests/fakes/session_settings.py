"""`session_settings`: a session server's settings as a run's config gives them, written the way the config is."""

from __future__ import annotations

from typing import Any

from grpoflow.config import parse_run_config
from grpoflow.rollout.sessions.server import SessionSettings


def session_settings(
    engine_url: str,
    tokenizer_path: str,
    *,
    harness: dict[str, Any] | None = None,
    sampling: dict[str, Any] | None = None,
    episode: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    lora_path: str | None = None,
) -> SessionSettings:
    """The settings of a run whose config has these sections (terminus-2 and the config's defaults otherwise), e.g.
    `session_settings(url, model, sampling={"max_new_tokens": 16}, episode={"max_context_tokens": 64})`."""
    rollout = {"harness": harness or {"name": "terminus-2"}, "sampling": sampling or {}, "episode": episode or {}}
    cfg = parse_run_config({"rollout": rollout, "engine": engine or {}})
    r = cfg.rollout
    return SessionSettings(
        engine_url, str(tokenizer_path), cfg.engine, r.sampling, r.episode, r.harness, lora_path=lora_path
    )
