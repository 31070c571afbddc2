"""Offline hygiene: nothing phones home. The one list of environment variables that say so, applied before Prefect,
Harbor, LiteLLM or Hugging Face are imported (by the `flows` package for the CLI, the tests and the benches, and by
the core modules that import such a package themselves). Values already set win."""

import os

OFFLINE_ENV = {
    "HARBOR_TELEMETRY": "0",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else LiteLLM fetches its price map from GitHub when imported
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_offline_env() -> None:
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
