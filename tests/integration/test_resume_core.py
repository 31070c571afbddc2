"""The commit point of a step and the repairs of a killed run dir (core, no Prefect): a restored trainer
continues bit for bit, and the logs are made to agree with the last complete checkpoint."""

import json

import torch

from grpoflow.config import TrainConfig
from grpoflow.figures import Figures
from grpoflow.paths import RunPaths
from grpoflow.prepare.model import PreparedModel
from grpoflow.run.commit import StepCommits, save_step
from grpoflow.run.info import DatasetInfo, RunInfo, write_run_info
from grpoflow.run.metrics import MetricsLog, read_step_records
from grpoflow.run.record import StepRecord, StepTimes
from grpoflow.run.resume import find_resume_point, repair_run_dir
from grpoflow.train.checkpoint import restore_training_state
from grpoflow.train.step import train_step
from grpoflow.train.trainer import load_trainer
from tests.fakes.samples import agentic_samples


def _run_dir(tmp_path, flow: str = "train") -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    for name in ("config.json", "prompts.jsonl"):
        (paths.root / name).write_text("{}\n")
    model = PreparedModel("m", "/m", "0" * 64, "", "LlamaForCausalLM", 8)
    info = RunInfo(
        run_id="run",
        created_at="now",
        python="3",
        platform="x",
        code_commit=None,
        packages={},
        model=model,
        dataset=DatasetInfo(path="/d", sha256="0" * 64, tasks=[]),
        flow=flow,
    )
    write_run_info(paths, info)
    return paths


def test_restored_trainer_continues_bit_exact(tiny_model_dir, tmp_path):
    """Two steps in one process == one step, commit, a fresh process's trainer restored from it, one step."""
    cfg = TrainConfig(optimizer={"learning_rate": 1e-2})
    paths = _run_dir(tmp_path)
    a = load_trainer(tiny_model_dir, cfg, seed=0)
    samples = agentic_samples(a.model)
    m0 = train_step(a, samples, cfg, seed=0)
    log = MetricsLog(paths.metrics, paths.tb)
    record = StepRecord(0, train=Figures({"train/loss": m0["loss"]}), times=StepTimes(step=1.0))
    commits = StepCommits(paths, log)
    commits.finish(a, save_step(a, paths, 0, record), 0, record, full=True)
    commits.flush()  # the full checkpoint is complete, its row logged
    log.close()
    assert [r["step"] for r in read_step_records(paths.metrics)] == [0]
    train_step(a, samples, cfg, seed=1)

    b = load_trainer(tiny_model_dir, cfg, seed=0)
    point = find_resume_point(paths)
    assert point.last_step == 0 and point.next_step == 1
    assert restore_training_state(b, point.checkpoint)["optimizer_steps"] == 1 == b.optimizer_steps
    train_step(b, samples, cfg, seed=1)
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)


def _step_ckpt(
    paths: RunPaths, step: int, metrics: dict, timings: dict, complete: bool = True, full: bool = True
) -> None:
    d = paths.checkpoint(step)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"w")
    if complete:
        (d / "step.json").write_text(json.dumps({"step": step, "metrics": metrics, "timings": timings}) + "\n")
    if full:
        (d / "optimizer.pt").write_bytes(b"o")


def test_repair_appends_the_missing_row_and_drops_later_and_torn_ones(tmp_path):
    paths = _run_dir(tmp_path)
    _step_ckpt(paths, 0, {"x": 0.5}, {"time/step_s": 1.5})
    _step_ckpt(paths, 1, {"x": float("nan")}, {"time/step_s": 2.5})
    _step_ckpt(paths, 2, {}, {}, complete=False)  # an old-style or foreign dir: not a commit point
    _step_ckpt(paths, 3, {"x": 1}, {}, full=False)  # a step between full checkpoints: done again on resume
    (paths.root / "checkpoints" / ".step_2.tmp-99").mkdir()  # an interrupted write
    row0 = b'{"step": 0, "x": 0.5}\n'
    # step 1's row missing, rows of later steps, a torn last line
    paths.metrics.write_bytes(row0 + b'{"step": 2, "x": 1}\n{"step": 3, "x": 1}\n{"step": 4, "x"')
    paths.timings.write_bytes(b'{"step": 0, "time/step_s": 1.5}\n{"step": 1, "time/step_s": 2.5}\n')
    (paths.details(2)).mkdir(parents=True)
    (paths.details(2) / "samples.jsonl").write_text("{}\n")
    (paths.details(2) / "journal.jsonl").write_text("{}\n")
    (paths.root / ".metrics.jsonl.abc.tmp").write_text("half")

    point = find_resume_point(paths)
    assert (point.last_step, point.next_step) == (1, 2)
    notes = repair_run_dir(paths, point)
    assert paths.metrics.read_bytes() == row0 + b'{"step": 1, "x": NaN}\n'  # row 0's bytes untouched
    assert paths.timings.read_bytes() == b'{"step": 0, "time/step_s": 1.5}\n{"step": 1, "time/step_s": 2.5}\n'
    assert sorted(p.name for p in (paths.root / "checkpoints").iterdir()) == ["step_0", "step_1"]
    assert not (paths.details(2) / "samples.jsonl").exists() and (paths.details(2) / "journal.jsonl").exists()
    assert not list(paths.root.glob(".*.tmp"))
    assert any("torn" in n for n in notes) and any("appended the row of step 1" in n for n in notes)
    assert [r["step"] for r in read_step_records(paths.metrics)] == [0, 1]
    # a second repair finds nothing to do
    assert repair_run_dir(paths, find_resume_point(paths)) == []


def test_a_live_run_cannot_be_resumed_under_it(tmp_path):
    import pytest

    from grpoflow.errors import RunDirError
    from grpoflow.run.resume import run_lock

    paths = _run_dir(tmp_path)
    with run_lock(paths.root):
        with pytest.raises(RunDirError, match="another process is running this run"):
            with run_lock(paths.root):
                pass
    with run_lock(paths.root):  # released when the holder ends
        pass


def test_only_train_runs_resume(tmp_path):
    import pytest

    from grpoflow.errors import RunDirError

    paths = _run_dir(tmp_path, flow="evaluate")
    with pytest.raises(RunDirError, match="made by the `evaluate` flow; only train runs resume"):
        find_resume_point(paths)


def test_the_final_evaluation_row_of_a_finished_run_is_kept(tmp_path):
    """The last step (always a full checkpoint) is followed by the final evaluation's own row: a repair keeps it
    when the resume point is that last step, and drops it otherwise."""
    paths = _run_dir(tmp_path)
    _step_ckpt(paths, 0, {"x": 0.5}, {})
    _step_ckpt(paths, 1, {"x": 0.6}, {})
    rows = b'{"step": 0, "x": 0.5}\n{"step": 1, "x": 0.6}\n{"step": 2, "eval/trained/pass_at_1": 0.5}\n'
    paths.metrics.write_bytes(rows)
    paths.timings.write_bytes(b'{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    assert repair_run_dir(paths, find_resume_point(paths), steps=2) == []
    assert paths.metrics.read_bytes() == rows
    repair_run_dir(paths, find_resume_point(paths), steps=3)  # step 2 is a training step still to do
    assert paths.metrics.read_bytes() == rows.rsplit(b"{", 1)[0]


def test_a_run_made_before_evaluations_resumes_and_reruns_without_them(tmp_path):
    from grpoflow.config import parse_run_config
    from grpoflow.run.resume import load_saved_config

    saved = parse_run_config({"run_id": "old"}).model_dump(mode="json")
    del saved["train"]["eval"], saved["config_version"]  # config.json as a run of the earlier code wrote it
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(saved))
    assert load_saved_config(tmp_path / "old").train.eval.samples_per_prompt == 0
    saved["train"]["eval"] = {"samples_per_prompt": 3}  # a run that evaluates keeps its setting
    (tmp_path / "old" / "config.json").write_text(json.dumps(saved))
    assert load_saved_config(tmp_path / "old").train.eval.samples_per_prompt == 3


def test_run_json_is_typed_a_damaged_field_fails_with_one_line_naming_it(tmp_path):
    import json

    import pytest

    from grpoflow.errors import RunDirError
    from grpoflow.run.info import read_run_info, update_run_info

    paths = _run_dir(tmp_path)
    assert update_run_info(paths, rerun_of="old").rerun_of == "old" == read_run_info(paths).rerun_of
    data = json.loads(paths.run_info.read_text())
    paths.run_info.write_text(json.dumps({**data, "flow": "trian"}))
    with pytest.raises(RunDirError, match=r"run\.json: `flow`: Input should be 'train' or 'evaluate'"):
        read_run_info(paths)
    paths.run_info.write_text(json.dumps({**data, "resume": []}))  # misspelt
    with pytest.raises(RunDirError, match=r"run\.json: `resume`: Extra inputs are not permitted"):
        read_run_info(paths)
