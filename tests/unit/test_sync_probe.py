"""The sync probe's test for an ignored sync, on scripted logprobs: it fires for a step the engine could show
and stays quiet for one smaller than the engine's own gap to the trainer (a bfloat16 engine rounds it away)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import grpoflow.train.probe as probe_module
from grpoflow.errors import EngineError
from grpoflow.train.probe import SyncProbe

IDS = [5, 6, 7, 8]


def _scripted(monkeypatch, engine: list[float], trainer: list[float]) -> None:
    monkeypatch.setattr(probe_module, "_probe_reply", lambda *a: (IDS, torch.tensor(engine), torch.tensor(trainer)))


@pytest.mark.parametrize("step, fires", [(0.004, False), (0.05, True)])
def test_an_engine_left_on_the_old_logprobs_fails_only_for_a_step_it_could_show(monkeypatch, step, fires):
    client, state = SimpleNamespace(base_url="http://engine"), SimpleNamespace(optimizer_steps=0)
    old = [-1.0, -0.5, -0.25, -2.0]
    probe = SyncProbe(limit=0.1)
    _scripted(monkeypatch, [x + 0.002 for x in old], old)  # the engine's own gap: 0.002 nats
    probe.check(client, state, "1")
    state.optimizer_steps = 1  # the trainer moved by `step`; the engine still serves the old logprobs
    _scripted(monkeypatch, [x + 0.002 for x in old], [x - step for x in old])
    if fires:
        with pytest.raises(EngineError, match="still serves the old weights after the sync to version 2"):
            probe.check(client, state, "2")
    else:
        assert probe.check(client, state, "2")["probe_gap"] == pytest.approx(step + 0.002, abs=1e-6)
