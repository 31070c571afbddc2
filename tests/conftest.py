"""Fixtures shared by every test tier: offline settings, one tiny random model per session."""

import pytest
import torch

import flows  # noqa: F401  (sets the offline environment, before Prefect, Harbor or LiteLLM load)

torch.set_num_threads(1)  # the machine is shared; generation under test stays on one thread


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.fakes.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture
def faulty_sandbox(monkeypatch):
    """`rollout.sandbox.backend=local` runs `tests.fakes.faulty_sandbox.FaultySandbox`: `rollout.sandbox.kwargs` can inject
    sandbox faults (`fail_start_probability`, `die_after_execs`)."""
    from tests.fakes.faulty_sandbox import FAULTY_SANDBOX_IMPORT_PATH, FaultySandboxSettings

    monkeypatch.setattr("grpoflow.rollout.sandbox.LOCAL_SANDBOX_IMPORT_PATH", FAULTY_SANDBOX_IMPORT_PATH)
    monkeypatch.setattr("grpoflow.sandbox_settings.SETTINGS", FaultySandboxSettings)  # its kwargs pass
    return FAULTY_SANDBOX_IMPORT_PATH


@pytest.fixture
def no_docker_engine(monkeypatch, tmp_path):
    """No Docker engine answers (DOCKER_HOST at a socket nobody listens on): tasks that need an image built are
    refused at prepare, whatever this machine runs."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
