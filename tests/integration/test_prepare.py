import json
import shutil

import pytest

from grpoflow.config import parse_run_config
from grpoflow.errors import DatasetError, ModelError, RunDirError
from grpoflow.prepare.dataset import builtin_dataset_path
from grpoflow.prepare.prompts import load_prompts
from grpoflow.run.start import prepare_run


def _cfg(tmp_path, model, **extra):
    return parse_run_config(
        {"run_id": "r1", "output_dir": str(tmp_path / "runs"), "model": {"source": str(model)}, **extra}
    )


def test_prepare_writes_config_provenance_and_prompts(tiny_model_dir, tmp_path):
    cfg = _cfg(tmp_path, tiny_model_dir, seed=4)
    run = prepare_run(cfg, cache_dir=tmp_path / "cache")
    root = tmp_path / "runs" / "r1"
    assert run.paths.root == root
    assert parse_run_config(json.loads((root / "config.json").read_text())) == cfg
    info = json.loads((root / "run.json").read_text())
    assert info["model"]["weights_sha256"] == run.model.weights_sha256
    assert info["model"]["path"] == str(tiny_model_dir.resolve()) and info["model"]["chat_template"]
    assert info["dataset"]["sha256"] == run.dataset_sha256 and len(info["dataset"]["tasks"]) == run.n_tasks
    assert info["packages"]["torch"] and info["python"]
    prompts = load_prompts(root / "prompts.jsonl")
    assert len(prompts) == run.n_tasks == sum(run.n_prompts.values())


def test_a_dataset_of_variants_is_split_by_family_and_run_json_records_it(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    for task in ("hello-file", "make-dir", "copy-file", "count-lines", "sort-lines"):
        for variant in ("medium", "hard"):
            shutil.copytree(builtin_dataset_path() / task, data / f"{task}_{variant}")
    run = prepare_run(_cfg(tmp_path, tiny_model_dir, dataset={"path": str(data)}), cache_dir=tmp_path / "cache")
    split = json.loads(run.paths.run_info.read_text())["split"]
    assert split["by"] == "family" and list(split["tasks"]) == ["trained", "heldout", "unseen"]
    unseen = {f for f, side in split["families"].items() if side == "unseen"}
    prompts = load_prompts(run.paths.prompts)
    assert unseen and not {p.metadata["split_family"] for p in prompts if p.split == "train"} & unseen
    assert sorted(split["tasks"]["unseen"]) == sorted(f"{f}_{v}" for f in unseen for v in ("medium", "hard"))


def test_existing_run_dir_is_never_touched(tiny_model_dir, tmp_path):
    root = tmp_path / "runs" / "r1"
    root.mkdir(parents=True)
    (root / "config.json").write_text("precious")
    with pytest.raises(RunDirError, match="already exists"):
        prepare_run(_cfg(tmp_path, tiny_model_dir), cache_dir=tmp_path / "cache")
    assert (root / "config.json").read_text() == "precious"
    assert sorted(p.name for p in root.iterdir()) == ["config.json"]


def test_bad_inputs_fail_before_a_run_dir_exists(tiny_model_dir, tmp_path):
    with pytest.raises(ModelError):
        prepare_run(_cfg(tmp_path, tmp_path / "missing-model"))
    empty = tmp_path / "empty-tasks"
    empty.mkdir()
    with pytest.raises(DatasetError):
        prepare_run(_cfg(tmp_path, tiny_model_dir, dataset={"path": str(empty)}))
    assert not (tmp_path / "runs" / "r1").exists()
