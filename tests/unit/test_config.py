import json
import re
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from grpoflow.config import (
    CONFIG_VERSION,
    ENGINE_TYPES,
    MOVED_SETTINGS,
    OpenCodeHarness,
    RunConfig,
    SglangLaunch,
    SglangServer,
    Terminus2Harness,
    apply_overrides,
    load_run_config,
    parse_run_config,
    read_config_file,
)
from grpoflow.errors import ConfigError
from grpoflow.paths import RUN_ID_PATTERN, new_run_id
from grpoflow.prepare.presets import layered_run_config


def test_defaults_resolve_with_a_generated_readable_run_id():
    cfg = parse_run_config({})
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", cfg.run_id)
    assert re.fullmatch(RUN_ID_PATTERN, cfg.run_id)
    assert cfg.model.source == "smollm2-135m-instruct" and cfg.engine.backend == "embedded"


def test_generated_run_ids_differ():
    assert len({new_run_id() for _ in range(50)}) == 50


def test_user_run_id_is_kept():
    assert parse_run_config({"run_id": "nightly-7"}).run_id == "nightly-7"


def test_every_field_has_a_description():
    # The Prefect UI renders these descriptions as the form's help text.
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            # a section, or each variant of one (`engine`: one type per backend)
            for ann in get_args(field.annotation) or (field.annotation,):
                if isinstance(ann, type) and issubclass(ann, BaseModel):
                    walk(ann, f"{prefix}{name}.")
                    seen.append(name)

    seen: list[str] = []
    walk(RunConfig)
    assert {"model", "dataset", "prompts", "engine", "rollout", "train", "cluster"} <= set(seen)


@pytest.mark.parametrize(
    "data, field",
    [
        ({"run_id": "Has Spaces"}, "run_id"),
        ({"seed": -1}, "seed"),
        ({"rollout": {"sampling": {"temperature": 9}}}, "rollout.sampling.temperature"),
        ({"rollout": {"n_samples_per_prompt": 0}}, "rollout.n_samples_per_prompt"),
        ({"rollout": {"temprature": 0.5}}, "rollout.temprature"),
        ({"train": {"loss": {"loss_aggregation": "mean"}}}, "train.loss.loss_aggregation"),
        ({"engine": {"backend": "tgi"}}, "engine.backend"),
        ({"engine": {"backend": "sglang"}}, "engine.url"),
        ({"engine": {"backend": "vllm"}}, "engine.url"),
        ({"engine": {"backend": "vllm-launch"}}, "engine.vllm.python"),
        ({"engine": {"backend": "sglang-launch"}}, "engine.sglang.python"),
        ({"engine": {"backend": "vllm-launch", "vllm": {"python": "p"}, "url": "http://h:1"}}, "engine.url"),
        (
            {"engine": {"backend": "vllm-launch", "vllm": {"python": "p", "args": ["--seed=3"]}}},
            "engine.vllm.args",
        ),
        (
            {"engine": {"backend": "vllm", "url": "http://h:1", "weight_sync": {"mode": "tensor"}}},
            "engine.weight_sync.mode",
        ),
        ({"engine": {"backend": "vllm", "url": "http://h:1", "deterministic": True}}, "engine.deterministic"),
        ({"engine": {"backend": "vllm", "url": "http://h:1"}, "train": {"lora": {}}}, "train.lora"),
        ({"prompts": {"eval_fraction": 1.5}}, "prompts.eval_fraction"),
        ({"cluster": {"train_ranks": 0}}, "cluster.train_ranks"),
        (
            {"engine": {"embedded": {"replicas": 2}, "backend": "sglang", "url": "http://h:1"}},
            "engine.embedded",
        ),
        ({"engine": {"embedded": {"threads": 0}}}, "engine.embedded.threads"),
        (
            {"engine": {"backend": "vllm-launch", "vllm": {"python": "p"}, "launch": {"mem_fraction_static": 1.0}}},
            "engine.launch.mem_fraction_static",
        ),
        (
            {"engine": {"backend": "sglang-launch", "sglang": {"python": "p", "max_total_tokens": 8}}},
            "engine.sglang.max_total_tokens",
        ),
        (
            {"cluster": {"ray_address": "local"}, "rollout": {"sandbox": {"backend": "e2b", "api_key_file": "/k"}}},
            "rollout.sandbox.api_key_file",
        ),
    ],
)
def test_bad_value_gives_one_line_naming_the_field(data, field):
    with pytest.raises(ConfigError) as exc:
        parse_run_config(data)
    msg = str(exc.value)
    assert "\n" not in msg
    assert f"`{field}`" in msg


def test_several_bad_fields_are_all_named_in_one_line():
    with pytest.raises(ConfigError) as exc:
        parse_run_config({"seed": "x", "rollout": {"sampling": {"top_p": 0}}})
    msg = str(exc.value)
    assert "`seed`" in msg and "`rollout.sampling.top_p`" in msg and "\n" not in msg


def test_config_file_round_trip_and_overrides(tmp_path):
    cfg = parse_run_config({"run_id": "abc", "rollout": {"sampling": {"temperature": 0.5}}})
    f = tmp_path / "c.json"
    f.write_text(json.dumps(cfg.model_dump(mode="json")))
    again = load_run_config(f, {"rollout.episode.max_turns": 7})
    assert again.rollout.sampling.temperature == 0.5 and again.rollout.episode.max_turns == 7 and again.run_id == "abc"


def test_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        load_run_config(bad)
    with pytest.raises(ConfigError, match="missing.json: config file not found"):
        load_run_config(tmp_path / "missing.json")
    bad.write_text(json.dumps({"train": {"steps": -3}}))
    with pytest.raises(ConfigError, match=r"bad.json: field `train.steps`"):
        load_run_config(bad)


def test_lora_adapters_go_on_the_blocks_linears_only():
    cfg = parse_run_config({"train": {"lora": {"rank": 8}}})
    assert cfg.train.lora.rank == 8 and "q_proj" in cfg.train.lora.target_modules
    with pytest.raises(ConfigError, match="train.lora.target_modules.*embed_tokens: adapters go on the linear"):
        parse_run_config({"train": {"lora": {"target_modules": ["q_proj", "embed_tokens"]}}})


def test_a_dotted_override_fills_an_empty_optional_section():
    # a saved config.json of a run without LoRA says "lora": null; --set train.lora.rank=8 turns LoRA on
    data = apply_overrides({"train": {"lora": None, "steps": 2}}, {"train.lora.rank": 8})
    cfg = parse_run_config(data)
    assert cfg.train.lora.rank == 8 and cfg.train.steps == 2
    with pytest.raises(ConfigError, match="override `train.steps.x`: `steps` is not a section"):
        apply_overrides({"train": {"steps": 2}}, {"train.steps.x": 1})


def test_old_logprobs_auto_takes_the_decoupled_objective_when_rollouts_may_be_stale():
    assert parse_run_config({}).train.old_logprobs_mode() == "rollout"
    assert parse_run_config({"train": {"max_staleness": 1}}).train.old_logprobs_mode() == "recompute"
    pinned = {"train": {"max_staleness": 1, "loss": {"old_logprobs": "rollout"}}}
    assert parse_run_config(pinned).train.old_logprobs_mode() == "rollout"


@pytest.mark.parametrize("setting", [{"tis_cap": 3.0}, {"mismatch_band": 1.5}, {"mismatch_band": [0.5, 5]}])
def test_a_correction_that_would_do_nothing_is_refused_in_one_line(setting):
    name = next(iter(setting))
    with pytest.raises(ConfigError) as exc:
        parse_run_config({"train": {"loss": {"old_logprobs": "rollout", **setting}}})
    assert f"train.loss.{name}" in str(exc.value) and "\n" not in str(exc.value)
    # the same setting with the old policy it acts on, or in an async run's default, is taken
    recomputed = {"train": {"loss": {"old_logprobs": "recompute", **setting}}}
    assert getattr(parse_run_config(recomputed).train.loss, name) is not None
    assert getattr(parse_run_config({"train": {"max_staleness": 1, "loss": setting}}).train.loss, name) is not None


def test_a_saved_config_naming_every_default_still_loads():
    """config.json of an earlier run names every field, tis_cap's default among them, beside old_logprobs=rollout."""
    saved = parse_run_config({}).model_dump(mode="json")
    saved["train"]["loss"]["old_logprobs"] = "rollout"
    assert parse_run_config(saved).train.loss.tis_cap == 2.0


@pytest.mark.parametrize("band", [0.9, 1.0, [2.0, 5.0], [0.5, 0.9], [0.0, 5.0]])
def test_a_band_that_holds_no_ratio_of_one_is_refused(band):
    with pytest.raises(ConfigError, match="train.loss.mismatch_band"):
        parse_run_config({"train": {"loss": {"old_logprobs": "recompute", "mismatch_band": band}}})


# --- the settings grouped by concern, and the old flat spellings that must keep loading ---

FLAT_CONFIG = Path(__file__).parent / "fixtures" / "config_flat_layout.json"  # as main saved it before the groups


def _as_saved(**groups) -> RunConfig:
    """The fixture's config: today's defaults but `dataset.build_images`, saved off when off was the default (a
    rerun keeps what its run had)."""
    return RunConfig.model_validate(
        {"run_id": "saved-before-config-groups", "dataset": {"build_images": False}} | groups
    )


def test_a_config_json_saved_in_the_flat_layout_loads_as_the_defaults():
    saved = json.loads(FLAT_CONFIG.read_text())
    assert "temperature" in saved["rollout"] and "learning_rate" in saved["train"]  # the old layout indeed
    assert "sglang_python" in saved["engine"] and "threads" in saved["engine"]
    expected = _as_saved()
    assert parse_run_config(saved) == expected
    assert load_run_config(FLAT_CONFIG) == expected
    assert RunConfig.model_validate(saved) == expected  # as Prefect validates a deployment's flat parameters


def test_a_deployment_s_flat_parameters_validate_into_the_grouped_config():
    """A deployment registered before the groups stores flat parameters; the flow's own validation moves them."""
    from flows.evaluate import evaluate_flow
    from flows.train import train_flow

    flat = json.loads(FLAT_CONFIG.read_text())
    assert train_flow.validate_parameters({"config": flat})["config"] == _as_saved()
    params = evaluate_flow.validate_parameters({"config": {"train": {"eval_samples_per_prompt": 3}}})
    assert params["config"].train.eval.samples_per_prompt == 3


# Each backend's own settings under their flat names, each at a value other than the default, and where they land.
FLAT_ENGINES = {
    "sglang-launch": (
        {
            "sglang_python": "/opt/sglang-venv/bin/python",
            "sglang_args": ["--context-length", "8192"],
            "max_total_tokens": 4096,
            "device": "cpu",
            "mem_fraction_static": 0.5,
            "startup_timeout_s": 60.0,
        },
        {
            "sglang": {
                "python": "/opt/sglang-venv/bin/python",
                "args": ["--context-length", "8192"],
                "max_total_tokens": 4096,
            },
            "launch": {"device": "cpu", "mem_fraction_static": 0.5, "startup_timeout_s": 60.0},
        },
    ),
    "vllm-launch": (
        {"vllm_python": "/opt/vllm-venv/bin/python", "vllm_args": ["--max-model-len", "8192"], "device": "cpu"},
        {
            "vllm": {"python": "/opt/vllm-venv/bin/python", "args": ["--max-model-len", "8192"]},
            "launch": {"device": "cpu"},
        },
    ),
    "embedded": (
        {"threads": 2, "replicas": 2, "router_policy": "round_robin", "max_batch_size": 8},
        {"embedded": {"threads": 2, "replicas": 2, "router_policy": "round_robin", "max_batch_size": 8}},
    ),
    "sglang": ({"url": "http://h:1"}, {"url": "http://h:1"}),
}


@pytest.mark.parametrize("backend", sorted(FLAT_ENGINES))
def test_every_old_engine_setting_of_a_flat_config_lands_in_its_backend_s_type(backend):
    """The fixture's flat engine section (every backend's settings at their defaults, as version 1 saved them) with
    the backend's own settings changed: they land in its groups, and the others' defaults go."""
    flat, grouped = FLAT_ENGINES[backend]
    saved = json.loads(FLAT_CONFIG.read_text())
    saved["engine"] |= {"backend": backend, **flat}
    assert parse_run_config(saved) == _as_saved(engine={"backend": backend, **grouped})
    known = {name for kind in ENGINE_TYPES.values() for name in kind.model_fields}
    assert all(k in known or f"engine.{k}" in MOVED_SETTINGS for k in saved["engine"])  # every flat name known


def test_another_backend_s_chosen_setting_is_named_unless_the_run_saved_it(tmp_path):
    """Version 1 let an engine carry every backend's settings and read its own: in a config, another backend's
    value is named (it would do nothing); in a run's own config.json, where it never did anything, it goes."""
    from grpoflow.run.resume import load_saved_config

    saved = json.loads(FLAT_CONFIG.read_text())
    saved["engine"] |= {"backend": "sglang", "url": "http://h:1", "threads": 2, "vllm_python": "/v"}
    with pytest.raises(ConfigError) as exc:
        parse_run_config(saved)
    msg = str(exc.value)
    assert "field `engine.embedded`: not a setting of engine.backend `sglang`" in msg and "`engine.vllm`" in msg
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(saved))
    assert load_saved_config(tmp_path / "old").engine == SglangServer(backend="sglang", url="http://h:1")
    today = parse_run_config({"engine": {"backend": "sglang", "url": "http://h:1"}}).model_dump()
    assert today["config_version"] == CONFIG_VERSION  # and so a default group beside it is named too
    with pytest.raises(ConfigError, match="field `engine.launch`: not a setting of engine.backend `sglang`"):
        parse_run_config(today | {"engine": today["engine"] | {"launch": {}}})


def test_a_newer_config_version_is_refused_in_one_line():
    newer = CONFIG_VERSION + 1
    with pytest.raises(
        ConfigError, match=rf"`config_version` {newer}: this grpoflow reads versions 1 to {CONFIG_VERSION}"
    ):
        parse_run_config({"config_version": newer})


V2_CONFIG = Path(__file__).parent / "fixtures" / "config_v2.json"  # a terminus-2 run's, as version 2 saved it


def test_a_version_2_config_keeps_loading_with_each_variant_as_its_type(tmp_path):
    saved = json.loads(V2_CONFIG.read_text())
    assert saved["config_version"] == 2 and "tool_call_parser" in saved["rollout"]["harness"]  # every harness's
    expected = parse_run_config(
        {
            "run_id": "saved-at-config-version-2",
            "rollout": {
                "harness": {"name": "terminus-2", "summarize": True},
                "sandbox": {"kwargs": {"memory_mb": 4096}},
            },
        }
    )
    assert parse_run_config(saved) == expected  # the other harnesses' settings held their defaults: they go
    assert RunConfig.model_validate(saved) == expected  # as Prefect validates a deployment's parameters
    # A run's own config.json lists every setting; one of another harness never took effect, whatever its value.
    saved["rollout"]["harness"]["tool_call_parser"] = "hermes"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(saved))
    from grpoflow.run.resume import load_saved_config

    assert load_saved_config(tmp_path / "old") == expected
    # A config someone wrote, though, is told that the value it chose does nothing there.
    with pytest.raises(
        ConfigError,
        match="field `rollout.harness.tool_call_parser`: not a setting of rollout.harness.name `terminus-2`",
    ):
        parse_run_config(saved)


@pytest.mark.parametrize(
    ("given", "error"),
    [
        (
            {"harness": {"name": "shell", "summarize": True}},
            "`rollout.harness.summarize`: not a setting of rollout.harness.name `shell`",
        ),
        (
            {"harness": {"name": "opencode", "parser": "xml"}},
            "`rollout.harness.parser`: not a setting of rollout.harness.name `opencode`",
        ),
        ({"harness": {"name": "aider"}}, "`rollout.harness.name`: one of shell, terminus-2, claude-code, opencode"),
        (
            {"sandbox": {"api_key_file": "/k"}},
            "`rollout.sandbox.api_key_file`: not a setting of rollout.sandbox.backend `local`",
        ),
        ({"sandbox": {"backend": "e2b", "kwargs": {"memory_mb": "x"}}}, None),
        (
            {"sandbox": {"kwargs": {"memory_mb": "x"}}},
            "`rollout.sandbox.kwargs.memory_mb`: Input should be a valid integer",
        ),
    ],
)
def test_a_setting_exists_only_in_the_variant_it_means_something_in(given, error):
    if error is None:
        assert parse_run_config({"rollout": given}).rollout.sandbox.kwargs == {"memory_mb": "x"}  # e2b's own kwargs
    else:
        with pytest.raises(ConfigError, match=re.escape(error)):
            parse_run_config({"rollout": given})


def test_choosing_another_harness_by_override_leaves_the_old_one_s_settings():
    before = parse_run_config({"rollout": {"harness": {"name": "terminus-2", "summarize": True}}}).model_dump()
    after = parse_run_config(apply_overrides(before, {"rollout.harness.name": "opencode"}))
    assert after.rollout.harness == OpenCodeHarness()
    kept = apply_overrides(before, {"rollout.harness.name": "terminus-2", "rollout.harness.parser": "xml"})
    assert parse_run_config(kept).rollout.harness == Terminus2Harness(summarize=True, parser="xml")


def test_choosing_another_backend_by_override_leaves_the_old_one_s_settings():
    before = parse_run_config({}).model_dump()
    after = apply_overrides(before, {"engine.backend": "sglang-launch", "engine.sglang.python": "/p"})
    assert isinstance(parse_run_config(after).engine, SglangLaunch) and "embedded" not in after["engine"]


def test_resume_and_rerun_read_a_run_dir_saved_in_the_flat_layout(tmp_path):
    from grpoflow.run.resume import load_saved_config

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(FLAT_CONFIG.read_text())
    cfg = load_saved_config(tmp_path / "old")
    assert cfg == _as_saved()
    raw = read_config_file(tmp_path / "old" / "config.json")["rollout"]["sandbox"]  # settings it predates: defaults
    assert raw == {k: v for k, v in cfg.rollout.sandbox.model_dump().items() if k in raw} and "retries" in raw


def test_a_flat_config_file_layers_under_a_preset_and_takes_new_overrides(tmp_path):
    f = tmp_path / "old.json"
    f.write_text(json.dumps({"rollout": {"temperature": 0.7, "harness": "terminus-2"}, "train": {"steps": 3}}))
    cfg = layered_run_config("embedded-default", f, {"rollout.sampling.top_k": 5})
    assert (cfg.rollout.sampling.temperature, cfg.rollout.sampling.top_k) == (0.7, 5)
    assert cfg.rollout.harness.name == "terminus-2" and cfg.rollout.episode.max_turns == 3  # the preset's
    assert load_run_config(f, {"rollout.sampling.temperature": 0.2}).rollout.sampling.temperature == 0.2


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("rollout.temperature=0.7", "rollout.sampling.temperature=0.7"),
        ("rollout.harness=terminus-2", "rollout.harness.name=terminus-2"),
        ("rollout.sandbox_kwargs.memory_mb=512", "rollout.sandbox.kwargs.memory_mb=512"),
        ("train.save_interval=3", "train.checkpoint.interval=3"),
        ("train.learning_rate=0.001", "train.optimizer.learning_rate=0.001"),
        ("engine.weight_sync=disk", "engine.weight_sync.mode=disk"),
        (
            "engine.backend=sglang-launch engine.sglang_python=/x",
            "engine.backend=sglang-launch engine.sglang.python=/x",
        ),
        (
            'engine.backend=vllm-launch engine.vllm_python=/x engine.vllm_args=["--enforce-eager"]',
            'engine.backend=vllm-launch engine.vllm.python=/x engine.vllm.args=["--enforce-eager"]',
        ),
        ("engine.threads=2", "engine.embedded.threads=2"),
        (
            "engine.backend=sglang-launch engine.sglang.python=/x engine.device=cpu",
            "engine.backend=sglang-launch engine.sglang.python=/x engine.launch.device=cpu",
        ),
    ],
)
def test_an_old_set_key_gives_the_config_of_the_new_one(old, new):
    from flows.cli import _config_from_args, build_parser

    def cfg(items):
        sets = [a for item in items.split(" ") for a in ("--set", item)]
        return _config_from_args(build_parser().parse_args(["train", "--run-id", "r", *sets]))

    assert cfg(old) == cfg(new) != cfg("train.steps=16")


def test_an_old_and_a_new_name_of_one_setting_at_once_is_one_line_naming_both(tmp_path):
    with pytest.raises(ConfigError) as exc:
        apply_overrides({}, {"rollout.temperature": 0.5, "rollout.sampling.temperature": 0.5})
    msg = str(exc.value)
    assert "`rollout.temperature`" in msg and "`rollout.sampling.temperature`" in msg and "\n" not in msg
    both = {"rollout": {"temperature": 0.5, "sampling": {"temperature": 0.4}}}
    with pytest.raises(ConfigError) as exc:
        parse_run_config(both)
    msg = str(exc.value)
    assert "`rollout.temperature`" in msg and "`rollout.sampling.temperature`" in msg and "\n" not in msg
    f = tmp_path / "both.json"
    f.write_text(json.dumps({"train": {"save_interval": 2, "checkpoint": {"interval": 3}}}))
    with pytest.raises(ConfigError, match=r"both.json: `train.save_interval` and `train.checkpoint.interval`"):
        load_run_config(f)


def _sections(model: type[BaseModel], name: str) -> list[type[BaseModel]]:
    """The section types field `name` of `model` may hold: one, or each variant (`engine`); none for a value."""
    ann = model.model_fields[name].annotation
    return [a for a in get_args(ann) or (ann,) if isinstance(a, type) and issubclass(a, BaseModel)]


def test_every_old_path_leads_to_a_setting_that_exists():
    for old, new in MOVED_SETTINGS.items():
        *groups, leaf = new.split(".")
        models = [RunConfig]
        for part in groups:
            models = [s for m in models if part in m.model_fields for s in _sections(m, part)]
        assert any(leaf in m.model_fields for m in models), old  # the table points somewhere
        assert old.split(".")[0] == new.split(".")[0], old  # a setting stays in its section
        section, key = old.split(".")
        # An old name is no name of today (`engine.sglang_python` vs the group `engine.sglang`), unless it became
        # the section its setting moved into (`rollout.harness` -> `rollout.harness.name`).
        today = {k for m in _sections(RunConfig, section) for k in m.model_fields}
        assert key not in today or new.startswith(old + "."), old


def _field_counts(model: type[BaseModel], prefix: str = "") -> dict[str, int]:
    """Fields of each section and group, by dotted path (a nested group counts as one field of its parent)."""
    counts = {prefix.rstrip(".") or "<run>": len(model.model_fields)}
    for name in model.model_fields:
        variants = _sections(model, name)
        for section in variants:  # a section with variants counts each: `engine[sglang-launch]`
            tag = f"[{section.model_config['title']}]" if len(variants) > 1 else ""
            counts |= _field_counts(section, f"{prefix}{name}{tag}.")
    return counts


def test_fields_per_group():
    counts = _field_counts(RunConfig)
    print(counts)
    assert {k: v for k, v in counts.items() if k.split(".")[0].split("[")[0] in ("rollout", "train", "engine")} == {
        "rollout": 8,
        "rollout.sampling": 4,
        "rollout.episode": 5,
        "rollout.harness[shell]": 1,
        "rollout.harness[terminus-2]": 6,
        "rollout.harness[claude-code]": 4,
        "rollout.harness[opencode]": 4,
        "rollout.sandbox[local]": 8,
        "rollout.sandbox[local].breaker": 5,
        "rollout.sandbox[harbor]": 9,
        "rollout.sandbox[harbor].breaker": 5,
        "train": 12,
        "train.loss": 12,
        "train.optimizer": 3,
        "train.batch": 5,
        "train.checkpoint": 1,
        "train.eval": 2,
        "train.lora": 3,
        "engine[embedded]": 10,
        "engine[embedded].weight_sync": 4,
        "engine[embedded].embedded": 4,
        "engine[sglang]": 9,
        "engine[sglang].weight_sync": 4,
        "engine[vllm]": 9,
        "engine[vllm].weight_sync": 4,
        "engine[sglang-launch]": 11,
        "engine[sglang-launch].weight_sync": 4,
        "engine[sglang-launch].launch": 3,
        "engine[sglang-launch].sglang": 3,
        "engine[vllm-launch]": 11,
        "engine[vllm-launch].weight_sync": 4,
        "engine[vllm-launch].launch": 3,
        "engine[vllm-launch].vllm": 2,
    }
