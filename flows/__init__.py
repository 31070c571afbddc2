"""Prefect flows of grpoflow and the `grpoflow` command line.

Offline hygiene is set here, before Prefect, Harbor or LiteLLM are imported: nothing phones home. This is the one
list: tests and benches import this package, and run.sh relies on it.
"""

import os

OFFLINE_ENV = {
    "HARBOR_TELEMETRY": "0",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)
