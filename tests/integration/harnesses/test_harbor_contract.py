"""Contract tests against the installed harbor: what the bindings, the trial configs and the result mapping name
still exists there, and Harbor's own models and factory accept what we build."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest
from harbor.agents.factory import AgentFactory
from harbor.models.agent.context import AgentContext
from harbor.models.agent.name import AgentName
from harbor.models.environment_type import EnvironmentType
from harbor.models.trial.config import TrialConfig
from harbor.models.trial.error_policy import ERROR_POLICIES
from harbor.models.trial.result import ExceptionInfo, TrialResult
from harbor.models.verifier.result import VerifierResult

from grpoflow.config import HARNESS_TYPES, SandboxName, parse_run_config
from grpoflow.prepare.dataset import builtin_dataset_path
from grpoflow.rollout.harnesses import HARNESSES, agent_factory
from grpoflow.rollout.outcome import HARBOR_EXCEPTION_NAMES
from grpoflow.rollout.sandbox import sandbox_config
from grpoflow.rollout.trials import TrialSpec, build_trial_config

SPEC = TrialSpec("hello-file", str(builtin_dataset_path() / "hello-file"), "g", 0, "g-0", 11)
HARBOR_AGENTS = [h for h, b in HARNESSES.items() if b.harbor_agent in AgentName.values()]


def _cfg(harness: str):
    return parse_run_config({"rollout": {"harness": {"name": harness}, "sandbox": {"backend": "local"}}})


def _agent_config(harness: str, api_base: str = "http://127.0.0.1:30000/v1"):
    cfg = _cfg(harness)
    make = agent_factory(
        cfg.rollout, cfg.engine, "http://127.0.0.1:30000", "/models/SmolLM2-135M", api_base_for=lambda spec: api_base
    )
    return cfg, make(SPEC)


def test_the_config_offers_exactly_the_harnesses_of_the_table():
    assert set(HARNESS_TYPES) == set(HARNESSES)


@pytest.mark.parametrize("harness", HARBOR_AGENTS)
def test_every_binding_names_a_real_harbor_agent(harness):
    binding = HARNESSES[harness]
    harbor_class = AgentFactory._AGENT_MAP[AgentName(binding.harbor_agent)]
    module, name = harbor_class.split(":")
    harbor_cls = getattr(__import__(module, fromlist=[name]), name)
    _, agent_config = _agent_config(harness)
    agent = AgentFactory.create_agent_from_config(agent_config, logs_dir=Path("/tmp/grpoflow-contract-logs"))
    # Harbor's own class, or ours subclassing it (terminus-2's early truncation exit), under Harbor's name.
    assert isinstance(agent, harbor_cls) and agent.name() == binding.harbor_agent


def test_the_shell_binding_builds_our_agent():
    _, agent_config = _agent_config("shell")
    agent = AgentFactory.create_agent_from_config(agent_config, logs_dir=Path("/tmp/grpoflow-contract-logs"))
    assert agent.name() == "grpoflow-shell"


@pytest.mark.parametrize("harness", list(HARNESSES))
def test_the_built_trial_config_is_a_valid_harbor_trial_config(harness, tmp_path):
    cfg, agent_config = _agent_config(harness)
    trial = build_trial_config(SPEC, 0, agent_config, sandbox_config(cfg.rollout), tmp_path)
    again = TrialConfig.model_validate_json(trial.model_dump_json())  # what Harbor writes and reads back
    assert again.agent.model_dump() == agent_config.model_dump()
    assert again.environment.model_dump() == trial.environment.model_dump()
    # Every kwarg is one the agent's constructor accepts (Harbor's options models forbid extras).
    AgentFactory.create_agent_from_config(again.agent, logs_dir=tmp_path / "logs")


@pytest.mark.parametrize("sandbox", [s for s in typing.get_args(SandboxName) if s != "local"])
def test_every_pass_through_environment_type_exists_in_harbor(sandbox):
    env = sandbox_config(parse_run_config({"rollout": {"sandbox": {"backend": sandbox}}}).rollout)
    assert env.type == EnvironmentType(sandbox) and env.import_path is None


def test_the_result_fields_the_mapping_reads_still_exist():
    # evaluate.classify / to_sample and rollout.run_trial read exactly these.
    assert {"agent_result", "verifier_result", "exception_info", "config"} <= set(TrialResult.model_fields)
    assert {"metadata", "rollout_details", "n_input_tokens", "n_output_tokens"} <= set(AgentContext.model_fields)
    assert "rewards" in VerifierResult.model_fields
    assert {"exception_type", "exception_message"} <= set(ExceptionInfo.model_fields)


def _harbor_exception_classes() -> set[str]:
    import harbor.agents.installed.base as installed
    import harbor.llms.base as llms
    import harbor.trial.errors as trial_errors
    import harbor.verifier.verifier as verifier

    return {
        name
        for module in (installed, llms, trial_errors, verifier)
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException)
    }


def test_every_exception_name_the_mapping_knows_exists_in_harbor():
    missing = HARBOR_EXCEPTION_NAMES - _harbor_exception_classes() - set(ERROR_POLICIES)
    assert missing == set()


def test_harbor_still_verifies_after_the_endings_we_treat_as_verified():
    # classify trusts a reward after these: Harbor's single-step trial records them and runs the verifier anyway.
    import harbor.trial.single_step as single_step

    source = inspect.getsource(single_step.SingleStepTrial._run_agent)
    assert "except (AgentTimeoutError, NonZeroAgentExitCodeError)" in source
