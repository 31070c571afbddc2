"""The command line a user runs: bad input gives one clear line and exit status 2, and touches no run dir."""

import shutil

import pytest

from flows.cli import main
from grpoflow.prepare.dataset import builtin_dataset_path

pytestmark = pytest.mark.flow


def _err_line(capfd):
    err = capfd.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


def test_invalid_config_value_names_the_field(tmp_path, capfd):
    assert main(["prepare", "--output-dir", str(tmp_path), "--set", "rollout.sampling.temperature=9"]) == 2
    line = _err_line(capfd)
    assert line.startswith("grpoflow: error: command line: field `rollout.sampling.temperature`")
    assert not any(tmp_path.iterdir())


def test_bad_set_syntax(tmp_path, capfd):
    assert main(["prepare", "--output-dir", str(tmp_path), "--set", "rollout.sampling.temperature"]) == 2
    assert "expected KEY=VALUE" in _err_line(capfd)


def test_missing_model_path(tmp_path, capfd):
    assert main(["prepare", "--output-dir", str(tmp_path), "--run-id", "m1", "--model", str(tmp_path / "nope")]) == 2
    assert "no such file or directory" in _err_line(capfd) and not (tmp_path / "m1").exists()


def test_task_without_tests_names_the_task(tmp_path, tiny_model_dir, capfd):
    data = tmp_path / "tasks"
    shutil.copytree(builtin_dataset_path() / "hello-file", data / "hello-file")
    shutil.rmtree(data / "hello-file" / "tests")
    rc = main(
        [
            "prepare",
            "--output-dir",
            str(tmp_path / "runs"),
            "--run-id",
            "d1",
            "--model",
            str(tiny_model_dir),
            "--dataset",
            str(data),
        ]
    )
    line = _err_line(capfd)
    assert rc == 2 and str(data / "hello-file") in line and "test" in line
    assert not (tmp_path / "runs" / "d1").exists()


def test_existing_run_dir_is_refused_and_untouched(tmp_path, tiny_model_dir, capfd):
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "metrics.jsonl").write_text("keep me\n")
    rc = main(["prepare", "--output-dir", str(tmp_path), "--run-id", "r1", "--model", str(tiny_model_dir)])
    assert rc == 2 and "already exists" in _err_line(capfd)
    assert [p.name for p in (tmp_path / "r1").iterdir()] == ["metrics.jsonl"]
    assert (tmp_path / "r1" / "metrics.jsonl").read_text() == "keep me\n"


def test_prepare_prints_where_the_artifacts_are(tmp_path, tiny_model_dir, capfd):
    assert main(["prepare", "--output-dir", str(tmp_path), "--run-id", "ok-1", "--model", str(tiny_model_dir)]) == 0
    out = capfd.readouterr().out
    assert f"artifacts in {(tmp_path / 'ok-1').resolve()}" in out and "prompts.jsonl" in out


def test_a_bad_dataset_is_said_before_the_model_is_touched(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("GRPOFLOW_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "tasks"
    shutil.copytree(builtin_dataset_path() / "hello-file", data / "hello-file")
    (data / "hello-file" / "instruction.md").unlink()
    corrupt = tmp_path / "policy.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 8)  # converting it would fail (and cost)
    argv = ["prepare", "--output-dir", str(tmp_path / "runs"), "--run-id", "d2", "--model", str(corrupt)]
    assert main([*argv, "--dataset", str(data)]) == 2
    line = _err_line(capfd)
    assert str(data / "hello-file") in line and "instruction.md" in line, line
    assert not (tmp_path / "cache").exists()  # no GGUF read, no conversion dir: the model was never looked at


def test_evaluate_takes_the_split_to_evaluate(tmp_path, monkeypatch, capfd):
    import contextlib

    import flows.evaluate
    import flows.server

    called = []

    def evaluate_flow(cfg, **kwargs):  # what the flow is called with; the run dir it would make
        called.append((cfg.run_id, kwargs))
        (tmp_path / cfg.run_id).mkdir()

    monkeypatch.setattr(flows.evaluate, "evaluate_flow", evaluate_flow)
    monkeypatch.setattr(flows.server, "command_server", contextlib.nullcontext)
    base = ["evaluate", "--output-dir", str(tmp_path), "--run-id"]
    main([*base, "e-all", "--split", "all"])
    main([*base, "e-default"])
    assert called == [("e-all", {"from_run": None, "split": "all"}), ("e-default", {"from_run": None, "split": "eval"})]
    with pytest.raises(SystemExit):
        main([*base, "e-bad", "--split", "everything"])
    assert "invalid choice: 'everything'" in capfd.readouterr().err
