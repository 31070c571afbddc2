"""Prefect flows of grpoflow and the `grpoflow` command line.

Offline hygiene is set here, before Prefect, Harbor or LiteLLM are imported: nothing phones home.
"""

import os

for _key, _value in {
    "HARBOR_TELEMETRY": "0",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)
