"""`train.sharding`: `auto` shards above one trainer rank; a run saved before sharded training keeps replicating
when resumed or rerun."""

import json

from grpoflow.config import parse_run_config
from grpoflow.run.resume import load_saved_config


def _cfg(ranks, **train):
    return parse_run_config({"run_id": "s", "train": train, "cluster": {"train_ranks": ranks}})


def test_auto_shards_above_one_rank_and_an_explicit_choice_stands():
    assert _cfg(1).sharding_mode() == "replicate"
    assert _cfg(2).sharding_mode() == "fsdp"
    assert _cfg(4, sharding="replicate").sharding_mode() == "replicate"
    assert _cfg(1, sharding="fsdp").sharding_mode() == "fsdp"


def test_a_run_saved_before_sharding_keeps_replicating(tmp_path):
    saved = _cfg(2).model_dump(mode="json")
    del saved["train"]["sharding"], saved["config_version"]  # as a run saved it before either
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_saved_config(tmp_path).sharding_mode() == "replicate"
    saved["train"]["sharding"] = "auto"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_saved_config(tmp_path).sharding_mode() == "fsdp"
