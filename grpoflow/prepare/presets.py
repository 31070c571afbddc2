"""Named run recipes: each a partial `RunConfig` (only what differs from the defaults), validated on load.

A preset is the first layer of a run's configuration: `grpoflow train --preset NAME` starts from it, and
`--config`, flags and `--set` override it, in that order (`layered_run_config`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpoflow.config import (
    RunConfig,
    apply_overrides,
    parse_run_config,
    read_config_file,
)
from grpoflow.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: Mapping[str, Any]  # partial RunConfig data


def merge_config(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dicts merge key by key; any other value in `top` (lists too) replaces the one in `base`."""
    out = copy.deepcopy(dict(base))
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# terminus-2 with context compaction, as in the seed recipe: SGLang started for the run from its own environment
# (the path is the usual install location); terminus-2 summarises long episodes and keeps each context a linear
# history, the unit that trains as one segment, in its XML reply format; kl_coef weighs the k3 estimator, the
# recipe's "low-variance KL".
_COMPACTION = {
    "engine": {"backend": "sglang-launch", "sglang": {"python": "/opt/sglang-venv/bin/python"}},
    "rollout": {
        "harness": {"name": "terminus-2", "parser": "xml", "summarize": True, "linear_history": True},
        "prompts_per_step": 4,
        "n_samples_per_prompt": 8,
        "sampling": {"max_new_tokens": 8192},
        "episode": {"max_context_tokens": 32768},
    },
    "train": {
        "steps": 100,
        "batch": {"global_batch_size": 32},
        "loss": {"eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.01},
    },
}


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "embedded-default",
            "The main job (`grpoflow main`): SmolLM2-135M on the embedded CPU engine and the local sandbox, "
            "trained on the built-in easy task families (the only ones on which the 135M model earns rewards often "
            "enough for GRPO groups to have spread; 7 families of 4 instances, split by family, half of each "
            "trained family's instances held out), evaluated before and after with 2 trials per instance "
            "(56 trials); at the end, every evaluation trial is regraded (each verdict row's grader noise), and 2 "
            "training trials of each task, to catch flaky verifiers.",
            {
                # Half the trained families' instances held out: 20 paired trials on held-out instances, where a
                # quarter gave 10, too few for an interval that can exclude zero at the gains this model makes.
                "prompts": {"difficulties": ["easy"], "instance_eval_fraction": 0.5},
                "rollout": {"episode": {"max_turns": 3}},
                # Penalize over-long turns (DAPO's soft band): trained as any other, a cut-off turn that still
                # passed taught the policy to run on past its command, until every turn was cut off.
                "train": {
                    "optimizer": {"learning_rate": 5e-5},
                    "eval": {"samples_per_prompt": 2},
                    "loss": {"truncated": "penalize"},
                },
                "report": {"regrade_per_task": 2},
            },
        ),
        Preset(
            "terminus-2-compaction",
            "Terminus-2 with context compaction on SGLang: 4 prompts x 8 samples, one optimizer step of 32 per "
            "rollout step, 100 steps, 32k-token episodes, 8k-token turns, clip 0.2/0.28, k3 KL 0.01.",
            _COMPACTION,
        ),
        Preset(
            "tb2-qwen3-8b-8xh100",
            "Production: Qwen3-8B (its Hugging Face folder at /models/Qwen3-8B; set model.source for another) on "
            "Terminal-Bench 2 tasks (give --dataset) in Docker, on one 8xH100 machine: terminus-2 with compaction "
            "as terminus-2-compaction, sampled at temperature 1; SGLang on GPUs 4-7 (TP 4), four trainer ranks on "
            "GPUs 0-3 sharding the model (FSDP2, bf16 compute; a 32k-token episode trains alone, recomputing), "
            "weights sent in 512 MB buckets over NCCL, old logprobs recomputed by the trainer with truncated "
            "importance sampling. `grpoflow plan --preset tb2-qwen3-8b-8xh100 --gpus 8 --gpu-gb 80 --shape "
            "qwen3-8b` shows what a rank holds.",
            merge_config(
                _COMPACTION,
                {
                    "model": {"source": "/models/Qwen3-8B"},
                    "engine": {
                        "tp_size": 4,
                        "launch": {"device": "cuda"},
                        "weight_sync": {"mode": "distributed", "bucket_mb": 512},
                    },
                    "rollout": {
                        "sandbox": {"backend": "docker"},
                        "sampling": {"temperature": 1.0},
                        "concurrency": 32,
                    },
                    "cluster": {"train_ranks": 4},
                    "train": {
                        "sharding": "fsdp",
                        "precision": "bf16",
                        "loss": {"old_logprobs": "recompute", "tis_cap": 2.0},
                    },
                },
            ),
        ),
        Preset(
            "sglang-e2b",
            "Production: attach to an SGLang server already running (SGLang's default port on this host; set "
            "engine.url for another) and run trials in e2b sandboxes (key from E2B_API_KEY or "
            "rollout.sandbox.api_key_file).",
            {
                "engine": {"backend": "sglang", "url": "http://127.0.0.1:30000"},
                "rollout": {"sandbox": {"backend": "e2b"}},
            },
        ),
    ]
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"preset `{name}`: unknown; known presets: {', '.join(PRESETS)}") from None


def preset_config(name: str) -> dict[str, Any]:
    """The preset's partial config as a fresh dict (callers may change it)."""
    return copy.deepcopy(dict(get_preset(name).config))


def load_preset(name: str, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The preset over the defaults, plus dotted overrides, validated (a run_id is generated if none is set)."""
    return parse_run_config(apply_overrides(preset_config(name), overrides or {}), source=f"preset {name}")


def layered_run_config(preset: str, config_file: Path | None, overrides: dict[str, Any]) -> RunConfig:
    """preset < config file < dotted overrides, validated once."""
    data, source = preset_config(preset), f"preset {preset}"
    if config_file is not None:
        data = merge_config(data, read_config_file(Path(config_file)))
        source += f" + {config_file}"
    return parse_run_config(apply_overrides(data, overrides), source=source)
