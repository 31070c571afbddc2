"""What each named recipe resolves to, and how a preset layers under --config, flags and --set."""

import json

import pytest

from flows.cli import _config_from_args, build_parser, main
from grpoflow.config import parse_run_config
from grpoflow.errors import ConfigError
from grpoflow.placement import plan_gpus
from grpoflow.preflight import toy_values_notice
from grpoflow.prepare.presets import (
    PRESETS,
    layered_run_config,
    load_preset,
    merge_config,
    preset_config,
)
from grpoflow.train.memory import KNOWN_SHAPES, plan_memory, train_setup


def _dump(cfg) -> dict:
    return cfg.model_dump(exclude={"run_id"})


def _leaves(data: dict, prefix: str = "") -> dict:
    """Every setting of a dumped config by its dotted path (`train.optimizer.learning_rate`)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_the_presets():
    assert list(PRESETS) == ["embedded-default", "terminus-2-compaction", "tb2-qwen3-8b-8xh100", "sglang-e2b"]


def test_embedded_default_is_the_main_job_recipe_over_the_defaults():
    cfg, defaults = load_preset("embedded-default"), parse_run_config({})
    assert cfg.prompts.difficulties == ["easy"] and cfg.rollout.episode.max_turns == 3
    assert cfg.prompts.instance_eval_fraction == 0.5 and defaults.prompts.instance_eval_fraction is None
    assert (cfg.train.optimizer.learning_rate, cfg.train.eval.samples_per_prompt) == (5e-5, 2)
    assert cfg.train.loss.truncated == "penalize" and defaults.train.loss.truncated == "train"
    assert cfg.report.regrade_per_task == 2 and defaults.report.regrade_per_task == 0
    recipe = {
        "prompts.difficulties",
        "prompts.instance_eval_fraction",
        "rollout.episode.max_turns",
        "train.optimizer.learning_rate",
        "train.eval.samples_per_prompt",
        "train.loss.truncated",
        "report.regrade_per_task",
    }
    ours = _leaves(_dump(cfg))
    for name, value in _leaves(_dump(defaults)).items():  # everything else is the default
        if name not in recipe:
            assert ours[name] == value, name


def test_main_starts_from_the_recipe_and_train_from_the_defaults():
    main_cfg = _config_from_args(build_parser().parse_args(["main", "--set", "train.steps=2"]))
    train_cfg = _config_from_args(build_parser().parse_args(["train", "--set", "train.steps=2"]))
    assert main_cfg.prompts.difficulties == ["easy"] and main_cfg.train.steps == 2
    assert train_cfg.prompts.difficulties == [] and train_cfg.train.optimizer.learning_rate == 1e-5
    # the recipe is for the built-in model and tasks: with others, main starts from the defaults
    for own in (["--dataset", "/data/tasks"], ["--model", "/models/qwen"]):
        cfg = _config_from_args(build_parser().parse_args(["main", *own]))
        assert cfg.prompts.difficulties == [] and cfg.train.optimizer.learning_rate == 1e-5, own


def test_terminus_2_compaction_resolves_to_the_recipe():
    cfg = load_preset("terminus-2-compaction")
    r, t, e = cfg.rollout, cfg.train, cfg.engine
    assert (r.prompts_per_step, r.n_samples_per_prompt) == (4, 8)
    assert t.batch.global_batch_size == 32 == r.prompts_per_step * r.n_samples_per_prompt  # one optimizer step a step
    assert t.steps == 100
    assert (r.episode.max_context_tokens, r.sampling.max_new_tokens) == (32768, 8192)
    assert (t.loss.eps_low, t.loss.eps_high, t.loss.kl_coef) == (0.2, 0.28, 0.01)
    assert (e.backend, e.sglang.python) == ("sglang-launch", "/opt/sglang-venv/bin/python")
    # Everything the recipe does not name stays at its default.
    rest = parse_run_config(preset_config("terminus-2-compaction"))
    assert _dump(rest) == _dump(cfg)
    assert cfg.model == parse_run_config({}).model
    h = r.harness
    assert (h.name, h.parser, h.summarize, h.linear_history) == ("terminus-2", "xml", True, True)


def test_terminus_2_compaction_is_runnable_and_layers_like_any_preset():
    cfg = layered_run_config("terminus-2-compaction", None, {"rollout.harness.summarize": False})
    assert cfg.rollout.harness.name == "terminus-2" and cfg.rollout.harness.summarize is False


def test_tb2_qwen3_8b_is_the_compaction_recipe_placed_on_8_gpus_and_its_plan_fits_an_h100():
    cfg, recipe = load_preset("tb2-qwen3-8b-8xh100"), load_preset("terminus-2-compaction")
    r, t, e = cfg.rollout, cfg.train, cfg.engine
    assert r.harness == recipe.rollout.harness and t.loss.kl_coef == recipe.train.loss.kl_coef
    assert (r.sampling.max_new_tokens, r.episode.max_context_tokens, r.sampling.temperature) == (8192, 32768, 1.0)
    assert (t.loss.old_logprobs, t.loss.tis_cap, t.sharding, t.precision) == ("recompute", 2.0, "fsdp", "bf16")
    assert (e.weight_sync.mode, e.weight_sync.bucket_mb, e.launch.device) == ("distributed", 512, "cuda")
    plan = plan_gpus(cfg, 8)
    assert plan.trainer == (0, 1, 2, 3) and plan.engine == (4, 5, 6, 7)  # TP 4, each part on GPUs of its own
    # a rank's share, the longest episode trained alone included, under an H100's 80 GB
    setup = train_setup(cfg, len(plan.trainer), on_gpu=True)
    assert setup.longest_sample_tokens == r.episode.max_context_tokens > setup.micro_batch_tokens
    rank = plan_memory(KNOWN_SHAPES["qwen3-8b"], setup)
    assert rank.fits(80 * 10**9)
    assert toy_values_notice(cfg) is None


def test_a_gpu_engine_left_at_the_toy_defaults_is_told_in_one_line():
    attached = {"engine": {"backend": "sglang", "url": "http://127.0.0.1:30000"}}
    notice = toy_values_notice(parse_run_config(attached))
    assert notice.startswith("engine.backend=sglang keeps the embedded CPU recipe's rollout.sampling.max_new_tokens=64")
    assert "\n" not in notice and "rollout.sampling.temperature=0.5" in notice
    # a value the config gives, even the default's, is the user's choice
    chosen = parse_run_config(merge_config(attached, {"rollout": {"sampling": {"temperature": 0.5}}}))
    assert "temperature" not in toy_values_notice(chosen)
    assert toy_values_notice(parse_run_config({})) is None  # the embedded engine: the values are its own
    on_cpu = {"engine": {"backend": "sglang-launch", "launch": {"device": "cpu"}, "sglang": {"python": "/py"}}}
    assert toy_values_notice(parse_run_config(on_cpu)) is None


def test_sglang_e2b_attaches_to_sglang_and_runs_trials_in_e2b():
    cfg = load_preset("sglang-e2b")
    assert (cfg.engine.backend, cfg.engine.url) == ("sglang", "http://127.0.0.1:30000")
    assert cfg.rollout.sandbox.backend == "e2b"


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="preset `nope`: unknown; known presets: embedded-default, "):
        load_preset("nope")


def test_preset_data_is_a_copy():
    preset_config("sglang-e2b")["engine"]["url"] = "http://elsewhere:1"
    assert load_preset("sglang-e2b").engine.url == "http://127.0.0.1:30000"


def test_merge_replaces_leaves_and_lists_and_merges_sections():
    base = {"engine": {"backend": "sglang", "url": "u", "sglang": {"args": ["--a"]}}, "seed": 1}
    top = {"engine": {"url": "v", "sglang": {"args": ["--b"]}}, "train": {"steps": 2}}
    assert merge_config(base, top) == {
        "engine": {"backend": "sglang", "url": "v", "sglang": {"args": ["--b"]}},
        "seed": 1,
        "train": {"steps": 2},
    }


def test_cli_layers_preset_then_config_file_then_flags_then_set(tmp_path):
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"engine": {"url": "http://file:1"}, "seed": 5, "rollout": {"concurrency": 3}}))
    args = build_parser().parse_args(
        [
            "train",
            "--preset",
            "sglang-e2b",
            "--config",
            str(f),
            "--seed",
            "6",
            "--set",
            "rollout.concurrency=4",
            "--run-id",
            "layers-1",
        ]
    )
    cfg = _config_from_args(args)
    assert cfg.rollout.sandbox.backend == "e2b"  # from the preset
    assert cfg.engine.url == "http://file:1" and cfg.engine.backend == "sglang"  # file over preset, section merged
    assert cfg.seed == 6 and cfg.rollout.concurrency == 4 and cfg.run_id == "layers-1"  # flags, --set over the file


def test_cli_preset_errors_are_one_line_and_exit_2(tmp_path, capfd):
    assert main(["prepare", "--preset", "nope", "--output-dir", str(tmp_path)]) == 2
    assert capfd.readouterr().err.strip() == (
        "grpoflow: error: preset `nope`: unknown; known presets: embedded-default, terminus-2-compaction, "
        "tb2-qwen3-8b-8xh100, sglang-e2b"
    )
    assert main(["prepare", "--preset", "sglang-e2b", "--set", "engine.url=null", "--output-dir", str(tmp_path)]) == 2
    assert "preset sglang-e2b: field `engine.url`: required" in capfd.readouterr().err
    assert not any(tmp_path.iterdir())
