"""Fixtures shared by every test tier: offline settings, one tiny random model per session."""

import os

import pytest
import torch

os.environ.setdefault("HARBOR_TELEMETRY", "0")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # the machine is shared; generation under test stays on one thread


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from grpoflow.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)
