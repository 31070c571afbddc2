"""Configs written in an older layout, upgraded to today's where they enter: a file, a flow parameter, `--set`."""

from __future__ import annotations

import copy
from typing import Any

from grpoflow.errors import ConfigError

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


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (left as it is) with every setting of the old flat layout moved to its place (`MOVED_SETTINGS`);
    a setting given under both names is a `ConfigError` naming both."""
    out = copy.deepcopy(data)
    moved = []
    for old, new in MOVED_SETTINGS.items():
        section, key = old.split(".")
        node = out.get(section)
        if isinstance(node, dict) and key in node and not _became_section(old, node[key]):
            moved.append((old, new, node.pop(key)))
    for old, new, value in moved:
        node = out
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
    return out
