"""Configs written in an older layout, upgraded to today's where they enter: a file, a flow parameter, `--set`."""

from __future__ import annotations

import copy
from typing import Any

from grpoflow.config.variants import VARIANTS
from grpoflow.errors import ConfigError

# The layout this grpoflow writes (`RunConfig.config_version`). 2: the engine section is its backend's type; 3: the
# harness and the sandbox sections are too.
CONFIG_VERSION = 3

# Where each setting went when `rollout`, `train` and `engine` were grouped by concern: old dotted path -> new one.
# Run dirs made before keep config.json in the old layout (resume and rerun read it), deployments and `--set` keys
# may spell the old names: `upgrade` and `apply_overrides` move them, and nothing else knows the old names.
MOVED_SETTINGS: dict[str, str] = {
    **{f"rollout.{k}": f"rollout.sampling.{k}" for k in ("max_new_tokens", "temperature", "top_p", "top_k")},
    **{
        f"rollout.{k}": f"rollout.episode.{k}"
        for k in ("max_turns", "max_context_tokens", "early_truncation_exit", "command_timeout_sec", "output_cap_chars")
    },
    "rollout.harness": "rollout.harness.name",
    **{
        f"rollout.{k}": f"rollout.harness.{k}"
        for k in (
            "tool_call_parser",
            "session_server_url",
            "parser",
            "summarize",
            "linear_history",
            "policy_api_key_file",
        )
    },
    "rollout.sandbox": "rollout.sandbox.backend",
    "rollout.sandbox_kwargs": "rollout.sandbox.kwargs",
    "rollout.sandbox_api_key_file": "rollout.sandbox.api_key_file",
    "rollout.sandbox_create_limit": "rollout.sandbox.create_limit",
    "rollout.sandbox_retries": "rollout.sandbox.retries",
    "rollout.retry_backoff_s": "rollout.sandbox.retry_backoff_s",
    "rollout.on_retries_exhausted": "rollout.sandbox.on_retries_exhausted",
    **{
        f"train.{k}": f"train.loss.{k}"
        for k in (
            "eps_low",
            "eps_high",
            "kl_coef",
            "old_logprobs",
            "dual_clip",
            "tis_cap",
            "mismatch_band",
            "scale_by_std",
            "loss_aggregation",
            "filter_zero_std",
            "truncated",
            "overlong_cache",
        )
    },
    **{f"train.{k}": f"train.optimizer.{k}" for k in ("learning_rate", "max_grad_norm", "weight_decay")},
    **{
        f"train.{k}": f"train.batch.{k}"
        for k in ("global_batch_size", "micro_batch_tokens", "gradient_checkpointing", "checkpoint_above_tokens")
    },
    "train.save_interval": "train.checkpoint.interval",
    "train.eval_samples_per_prompt": "train.eval.samples_per_prompt",
    "train.eval_interval": "train.eval.interval",
    "engine.weight_sync": "engine.weight_sync.mode",
    "engine.weight_sync_dtype": "engine.weight_sync.dtype",
    "engine.weight_sync_address": "engine.weight_sync.address",
    **{f"engine.{k}": f"engine.embedded.{k}" for k in ("threads", "replicas", "router_policy", "max_batch_size")},
    **{f"engine.{k}": f"engine.launch.{k}" for k in ("device", "mem_fraction_static", "startup_timeout_s")},
    "engine.sglang_python": "engine.sglang.python",
    "engine.sglang_args": "engine.sglang.args",
    "engine.max_total_tokens": "engine.sglang.max_total_tokens",
    "engine.vllm_python": "engine.vllm.python",
    "engine.vllm_args": "engine.vllm.args",
}


def _became_section(old: str, value: Any) -> bool:
    """`rollout.harness` (and `sandbox`, `engine.weight_sync`) was a value and is now a section of that name: a
    dict there is the new layout already."""
    return MOVED_SETTINGS[old].startswith(old + ".") and isinstance(value, dict)


def moved_path(dotted: str) -> str:
    """A dotted setting's path in today's layout: `rollout.temperature` -> `rollout.sampling.temperature`, also
    below a moved dict (`rollout.sandbox_kwargs.memory_mb`); any other path as it is."""
    if dotted in MOVED_SETTINGS:
        return MOVED_SETTINGS[dotted]
    for old, new in MOVED_SETTINGS.items():
        if dotted.startswith(old + ".") and not new.startswith(old + "."):
            return new + dotted[len(old) :]
    return dotted


def _moved(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with every setting of the old flat layout moved to its place (`MOVED_SETTINGS`), in place; a setting
    given under both names is a `ConfigError` naming both."""
    moved = []
    for old, new in MOVED_SETTINGS.items():
        section, key = old.split(".")
        node = data.get(section)
        if isinstance(node, dict) and key in node and not _became_section(old, node[key]):
            moved.append((old, new, node.pop(key)))
    for old, new, value in moved:
        node = data
        *parents, leaf = new.split(".")
        for p in parents:
            if node.get(p) is None:
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ConfigError(f"`{old}`: moved to `{new}`, but `{p}` there is not a section")
        if leaf in node:
            raise ConfigError(f"`{old}` and `{new}` are one setting (the first its old name): give only `{new}`")
        node[leaf] = value
    return data


# Until version 2 the engine section held all five backends' settings, and until version 3 the harness section all
# four harnesses' and the sandbox section the key file of cloud sandboxes, each read only by the variant it
# belongs to: a saved config lists them all. Their old defaults, which such a config may carry beside any variant.
_OLD_DEFAULTS: dict[tuple[str, ...], tuple[int, dict[str, Any]]] = {  # section -> (the last version with them, ...)
    ("engine",): (
        1,
        {
            "url": None,
            "embedded": {"threads": 1, "replicas": 1, "router_policy": "cache_aware", "max_batch_size": 16},
            "launch": {"device": "cuda", "mem_fraction_static": 0.8, "startup_timeout_s": 900.0},
            "sglang": {"python": None, "args": [], "max_total_tokens": None},
            "vllm": {"python": None, "args": []},
        },
    ),
    ("rollout", "harness"): (
        2,
        {
            "tool_call_parser": "qwen25",
            "session_server_url": None,
            "parser": "json",
            "summarize": False,
            "linear_history": True,
            "policy_api_key_file": None,
        },
    ),
    ("rollout", "sandbox"): (2, {"api_key_file": None}),
}


def _at_default(value: Any, default: Any) -> bool:
    if isinstance(value, dict) and isinstance(default, dict):
        return all(default.get(k) == v for k, v in value.items())
    return value == default


def _one_variant(data: dict[str, Any], version: int, saved: bool) -> None:
    """Each variant section of an older config as its variant's type, in place: the settings of other variants go
    when they hold their old defaults (whichever variant a merge ends on, nothing changes), or always in a run's own
    saved config (where they never took effect); a chosen value stays, for validation to name."""
    for v in VARIANTS:
        last, defaults = _OLD_DEFAULTS[v.path]
        section = v.section(data)
        if version > last or section is None:
            continue
        kind = v.type_of(section)
        if kind is None:
            continue  # validation names it
        for name, default in defaults.items():
            if name in section and name not in kind.model_fields and (saved or _at_default(section[name], default)):
                del section[name]


def _v1_saved(data: dict[str, Any]) -> None:
    """A run's own version 1 config.json with what the run did where a setting came later, in place: it lists
    every field the run had, so one missing was made before the setting. Without `train.eval.samples_per_prompt`
    the run evaluated nothing; without `train.sharding` its ranks replicated the model; without `prompts.split_by`
    it split by task (which `auto` might not, on a dataset whose tasks come in families)."""
    train = data.get("train")
    if isinstance(train, dict):
        if "samples_per_prompt" not in (train.get("eval") or {}):
            train["eval"] = {**(train.get("eval") or {}), "samples_per_prompt": 0}
        train.setdefault("sharding", "replicate")
    prompts = data.get("prompts")
    if isinstance(prompts, dict) and not prompts.get("path"):
        prompts.setdefault("split_by", "task")


def upgrade(data: dict[str, Any], saved: bool = False) -> dict[str, Any]:
    """`data` (left as it is) in today's layout, whichever version wrote it (`config_version`; none: 1): old flat
    names moved (`MOVED_SETTINGS`) and each variant section's settings of other variants left out (`_one_variant`). `saved`:
    `data` is a run's own config.json, which lists every setting it had; a version 1 one gets what the run did for
    the settings that came after it."""
    version = data.get("config_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= CONFIG_VERSION:
        raise ConfigError(
            f"`config_version` {version!r}: this grpoflow reads versions 1 to {CONFIG_VERSION} (a newer one wrote it?)"
        )
    out = _moved(copy.deepcopy(data))
    _one_variant(out, version, saved)
    if version == 1 and saved:
        _v1_saved(out)
    return out
