"""The run configuration: one pydantic model per concern, nested under `RunConfig`, one module per stage.

Every field carries a description because Prefect renders these models as the flow-run form in its UI.
The UI does not run model validators, so flows call `parse_run_config` again at start; every validation
failure becomes one `ConfigError` line that names the dotted field path. A config written in an older layout is
upgraded where it enters (`upgrade`).
"""

from grpoflow.config.data import DEFAULT_FAMILY_PATTERN, DatasetConfig, ModelConfig, PromptsConfig, RewardRule
from grpoflow.config.engine import (
    ENGINE_TYPES,
    AttachedEngine,
    EmbeddedEngine,
    EmbeddedEngineConfig,
    Engine,
    EngineApi,
    EngineConfig,
    LaunchConfig,
    LaunchedEngine,
    SglangConfig,
    SglangLaunch,
    SglangServer,
    VllmConfig,
    VllmLaunch,
    VllmServer,
    WeightSyncConfig,
)
from grpoflow.config.load import apply_overrides, load_run_config, parse_run_config, read_config_file
from grpoflow.config.rollout import (
    TOOL_CALL_PARSERS,
    EpisodeConfig,
    HarnessConfig,
    RolloutConfig,
    SamplingConfig,
    SandboxConfig,
    SandboxName,
)
from grpoflow.config.run import ClusterConfig, ReportConfig, RunConfig
from grpoflow.config.train import (
    BatchConfig,
    CheckpointConfig,
    EvalConfig,
    LoraSettings,
    LossConfig,
    OptimizerConfig,
    TrainConfig,
)
from grpoflow.config.upgrade import CONFIG_VERSION, MOVED_SETTINGS, upgrade

__all__ = [
    "CONFIG_VERSION",
    "ENGINE_TYPES",
    "AttachedEngine",
    "EmbeddedEngine",
    "Engine",
    "LaunchedEngine",
    "SglangLaunch",
    "SglangServer",
    "VllmLaunch",
    "VllmServer",
    "DEFAULT_FAMILY_PATTERN",
    "MOVED_SETTINGS",
    "TOOL_CALL_PARSERS",
    "BatchConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "DatasetConfig",
    "EmbeddedEngineConfig",
    "EngineApi",
    "EngineConfig",
    "EpisodeConfig",
    "EvalConfig",
    "HarnessConfig",
    "LaunchConfig",
    "LoraSettings",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PromptsConfig",
    "ReportConfig",
    "RewardRule",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "SandboxConfig",
    "SandboxName",
    "SglangConfig",
    "TrainConfig",
    "VllmConfig",
    "WeightSyncConfig",
    "apply_overrides",
    "load_run_config",
    "parse_run_config",
    "read_config_file",
    "upgrade",
]
