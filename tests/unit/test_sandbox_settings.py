"""The local sandbox's settings, as the run config checks them, match what its constructor takes and refuses."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from grpoflow.embedded.sandbox.local import LocalSandbox
from grpoflow.sandbox_settings import LocalSandboxSettings, sandbox_kwargs_problem

SET_BY_GRPOFLOW = {
    "session_bridge",
    "cli_dir",
    "base_images",
}  # the policy's bridge and the harness's CLIs, never a user's


def test_the_constructor_takes_the_settings_through_their_model_and_only_grpoflow_s_own_keywords_besides():
    params = inspect.signature(LocalSandbox.__init__).parameters
    assert LocalSandbox.Settings is LocalSandboxSettings
    assert {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} == SET_BY_GRPOFLOW


INTS = [n for n, f in LocalSandboxSettings.model_fields.items() if f.annotation is int]


@pytest.mark.parametrize("name", INTS)
@pytest.mark.parametrize("value", [0, -5, True, 1.5, "512"])
def test_what_the_settings_refuse_the_constructor_refuses(name, value):
    assert sandbox_kwargs_problem({name: value}) is not None
    with pytest.raises(ValueError, match=name):  # refused before Harbor's arguments are looked at
        LocalSandbox(Path("/nonexistent"), "env", "session", None, None, base_images={}, **{name: value})


def test_a_bad_process_scope_is_refused_by_both():
    assert "process_scope" in sandbox_kwargs_problem({"process_scope": "forever"})
    with pytest.raises(ValueError, match="process_scope"):
        LocalSandbox(Path("/nonexistent"), "env", "session", None, None, base_images={}, process_scope="forever")
