"""One default per setting, in the config: the leaves a run configures take the config's own sections (as Harbor
stores them with each trial, JSON) and declare no default of their own for a setting the config has, so a leaf
built without the config cannot quietly sample, cap or time out differently from the run."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

from harbor.agents.factory import AgentFactory
from pydantic import BaseModel

from grpoflow.config import RunConfig, parse_run_config
from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.rollout.agents.shell import ShellAgent
from grpoflow.rollout.harnesses import agent_factory
from grpoflow.rollout.sessions.server import SessionSettings
from grpoflow.rollout.trials import TrialSpec
from grpoflow.sandbox_settings import LocalSandboxSettings

LEAVES = (ShellAgent.__init__, LocalSandbox.__init__, SessionSettings.__init__)


def _models(annotation) -> list[type[BaseModel]]:
    """The config sections an annotation names (through unions, `Annotated`, containers)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def configured_settings() -> set[str]:
    """Every setting's name in the run config, each engine backend's and the local sandbox's included."""
    names: set[str] = set()
    todo, seen = [RunConfig, LocalSandboxSettings], set()
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, f in model.model_fields.items():
            names.add(name)
            todo += _models(f.annotation)
    return names


def defaults_of_settings(leaf, settings: set[str]) -> set[str]:
    params = inspect.signature(leaf).parameters.values()
    return {p.name for p in params if p.default is not p.empty and p.name in settings}


def test_no_leaf_declares_a_default_for_a_configured_setting():
    settings = configured_settings()
    assert {"max_new_tokens", "max_turns", "outage_wait_s", "memory_mb", "tp_size"} <= settings  # the walk reaches
    assert {leaf.__qualname__: defaults_of_settings(leaf, settings) for leaf in LEAVES} == {
        leaf.__qualname__: set() for leaf in LEAVES
    }


def test_the_check_finds_a_leaf_that_spells_a_setting_again():
    def leaf(self, *, engine_url: str, max_new_tokens: int = 96, temperature: float = 1.0, lora_path=None): ...

    assert defaults_of_settings(leaf, configured_settings()) == {"max_new_tokens", "temperature"}


def test_the_shell_agent_runs_with_the_run_s_sections_as_harbor_rebuilds_them():
    cfg = parse_run_config(
        {
            "engine": {"backend": "sglang", "url": "http://127.0.0.1:30000", "outage_wait_s": 7.0},
            "rollout": {"sampling": {"max_new_tokens": 77, "temperature": 0.25}, "episode": {"max_turns": 9}},
        }
    )
    make = agent_factory(cfg.rollout, cfg.engine, "http://127.0.0.1:30000", "/m/tokenizer")
    spec = TrialSpec("hello-file", "/tasks/hello-file", "g", 0, "step0-hello-file-0", 5)
    agent = AgentFactory.create_agent_from_config(make(spec), logs_dir=Path("/tmp/grpoflow-leaf-logs"))
    assert isinstance(agent, ShellAgent) and agent.seed == 5
    assert (agent.sampling, agent.episode, agent.engine) == (cfg.rollout.sampling, cfg.rollout.episode, cfg.engine)
    assert isinstance(agent.engine, type(cfg.engine)) and agent.engine.outage_wait_s == 7.0
