"""Bad configuration through the `grpoflow` command line: exit status 2, one stderr line naming the field or
file, nothing written to the output dir (and Prefect never started: the error comes before any flow)."""

from __future__ import annotations

import json

import pytest

from flows.cli import main

from .conftest import assert_one_line


def _run(tmp_path, capfd, *args):
    out = tmp_path / "runs"
    rc = main(["prepare", "--output-dir", str(out), *args])
    err = capfd.readouterr().err.strip()
    assert rc == 2, f"exit {rc}, stderr {err!r}"
    assert "\n" not in err and err.startswith("grpoflow: error: "), f"not one error line: {err!r}"
    assert not out.exists() or not any(out.iterdir())
    return err


OUT_OF_RANGE = [
    ("engine.embedded.threads=0", "engine.embedded.threads"),
    ("engine.embedded.max_batch_size=0", "engine.embedded.max_batch_size"),
    ("rollout.sampling.top_p=0", "rollout.sampling.top_p"),
    ("rollout.episode.max_context_tokens=10", "rollout.episode.max_context_tokens"),
    ("train.loss.eps_low=2", "train.loss.eps_low"),
    ("train.optimizer.learning_rate=0", "train.optimizer.learning_rate"),
    ("prompts.max_prompts=0", "prompts.max_prompts"),
    ("seed=-5", "seed"),
]


@pytest.mark.parametrize(("setting", "field"), OUT_OF_RANGE, ids=[s for s, _ in OUT_OF_RANGE])
def test_out_of_range_value_names_the_field(tmp_path, capfd, setting, field):
    err = _run(tmp_path, capfd, "--set", setting)
    assert f"field `{field}`" in err


WRONG = [
    ("rollout.episode.max_turns=four", "rollout.episode.max_turns"),
    ('train.loss.scale_by_std="maybe"', "train.loss.scale_by_std"),
    ("engine.embedded.router_policy=nearest", "engine.embedded.router_policy"),
    ("engine.launch.device=cpu", "engine.launch"),  # a launched server's setting, and the engine is embedded
    ("train=5", "train"),
    ("trian.steps=3", "trian"),  # unknown section
    ("rollout.temprature=0.7", "rollout.temprature"),  # unknown key
    ("rollout.harness.name=terminus", "rollout.harness.name"),
    ("rollout.sandbox.backend=nowhere", "rollout.sandbox.backend"),
    ("engine.backend=sglang-launch", "engine.sglang.python"),  # cross-field: launch needs its python
    ("engine.backend=sglang", "engine.url"),  # cross-field: an external server needs its URL
    ('rollout.sandbox.kwargs={"auth_token": "x"}', "rollout.sandbox.kwargs.auth_token"),
    # the local sandbox's kwargs, checked here rather than when the first trial starts
    ('rollout.sandbox.kwargs={"memory_mb": -5}', "rollout.sandbox.kwargs.memory_mb"),
    ("rollout.sandbox.kwargs.memory_mb=-5", "rollout.sandbox.kwargs.memory_mb"),
    ('rollout.sandbox.kwargs={"memory_mb": "lots"}', "rollout.sandbox.kwargs.memory_mb"),
    ('rollout.sandbox.kwargs={"memory_mb": true}', "rollout.sandbox.kwargs.memory_mb"),
    ('rollout.sandbox.kwargs={"cpu_time_sec": 0}', "rollout.sandbox.kwargs.cpu_time_sec"),
    ('rollout.sandbox.kwargs={"max_output_bytes": 1.5}', "rollout.sandbox.kwargs.max_output_bytes"),
    ('rollout.sandbox.kwargs={"process_scope": "forever"}', "rollout.sandbox.kwargs.process_scope"),
    ('rollout.sandbox.kwargs={"memroy_mb": 512}', "rollout.sandbox.kwargs.memroy_mb"),  # unknown key
]


@pytest.mark.parametrize(("setting", "field"), WRONG, ids=[s for s, _ in WRONG])
def test_wrong_type_or_unknown_key_names_the_field(tmp_path, capfd, setting, field):
    err = _run(tmp_path, capfd, "--set", setting)
    assert f"`{field}`" in err


@pytest.mark.parametrize("run_id", ["Upper", "has space", "../escape", "-leading-dash", "a" * 64, "under_score"])
def test_bad_run_id_is_refused(tmp_path, capfd, run_id):
    err = _run(tmp_path, capfd, f"--run-id={run_id}")
    assert "field `run_id`" in err
    assert not (tmp_path / "escape").exists()


def test_unknown_sandbox_kwarg_says_what_the_local_sandbox_takes_without_echoing_it(tmp_path, capfd):
    err = _run(tmp_path, capfd, "--set", 'rollout.sandbox.kwargs={"memroy_mb": "x-secretish-9"}')
    assert "not a setting of the local sandbox" in err and "memory_mb" in err and "x-secretish-9" not in err


def test_valid_local_sandbox_kwargs_and_another_sandbox_s_kwargs_pass():
    from grpoflow.config import parse_run_config

    local = {"memory_mb": 512, "cpu_time_sec": 60, "process_scope": "trial", "work_dir": "/tmp/sb"}
    assert parse_run_config({"rollout": {"sandbox": {"kwargs": local}}}).rollout.sandbox.kwargs == local
    e2b = {"sandbox_timeout_secs": 600}  # not the local sandbox's: Harbor's environment checks its own
    assert parse_run_config({"rollout": {"sandbox": {"backend": "e2b", "kwargs": e2b}}}).rollout.sandbox.kwargs == e2b


def test_credential_in_config_is_refused_without_echoing_it(tmp_path, capfd):
    err = _run(tmp_path, capfd, "--set", "rollout.api_key=e2b_supersecret123")
    assert "`rollout.api_key`" in err and "supersecret" not in err


CONFIG_FILES = [
    ("not-json", b"{ this is not json", "not valid JSON"),
    ("not-object", b'[{"seed": 1}]', "top level must be a JSON object"),
    ("not-utf8", b'{"run_id": "caf\xe9"}', "not valid JSON"),
    ("empty", b"", "not valid JSON"),
    ("bad-field", json.dumps({"train": {"steps": -1}}).encode(), "field `train.steps`"),
]


@pytest.mark.parametrize(("data", "words"), [c[1:] for c in CONFIG_FILES], ids=[c[0] for c in CONFIG_FILES])
def test_bad_config_file_names_the_file(tmp_path, capfd, data, words):
    f = tmp_path / "run.json"
    f.write_bytes(data)
    err = _run(tmp_path, capfd, "--config", str(f))
    assert str(f) in err and words in err


def test_missing_config_file_names_the_file(tmp_path, capfd):
    f = tmp_path / "missing.json"
    err = _run(tmp_path, capfd, "--config", str(f))
    assert str(f) in err and "not found" in err


def test_config_that_is_a_directory_names_it(tmp_path, capfd):
    d = tmp_path / "configs"
    d.mkdir()
    err = _run(tmp_path, capfd, "--config", str(d))
    assert str(d) in err and "is a directory" in err


def test_saved_config_with_a_bad_override_names_the_field(tmp_path, capfd):
    # A config.json saved by a run is valid; an override on top of it is still checked field by field.
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"run_id": "old-run", "rollout": {"sampling": {"temperature": 0.5}}}))
    err = _run(tmp_path, capfd, "--config", str(f), "--set", "rollout.sampling.temperature=-1")
    assert str(f) in err and "field `rollout.sampling.temperature`" in err


def test_assert_one_line_helper_rejects_multiline():
    with pytest.raises(AssertionError):
        assert_one_line(ValueError("a\nb"))
