"""The whole run (`RunConfig`): its sections, where the work runs and what the summary says."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from grpoflow.config.base import Section, any_of_schema
from grpoflow.config.data import DatasetConfig, ModelConfig, PromptsConfig
from grpoflow.config.engine import EmbeddedEngine, EngineConfig
from grpoflow.config.rollout import RolloutConfig
from grpoflow.config.train import TrainConfig
from grpoflow.config.upgrade import CONFIG_VERSION, upgrade
from grpoflow.config.variants import name_variants
from grpoflow.errors import ConfigError
from grpoflow.paths import RUN_ID_PATTERN


class ReportConfig(Section):
    """What the run's summary says beyond its metrics."""

    cost_per_gpu_hour: float | None = Field(
        None,
        ge=0.0,
        description="Price of one GPU hour: engine and trainer seconds are priced at it in the run's ledger "
        "(cost per trained token). Empty: no cost.",
    )
    cost_per_sandbox_hour: float | None = Field(
        None, ge=0.0, description="Price of one sandbox hour, for the run's ledger. Empty: sandboxes cost nothing."
    )
    regrade_per_task: int = Field(
        0,
        ge=0,
        le=1000,
        description="When the run ends, Harbor regrades every graded trial of its first and last evaluations and up "
        "to this many of each task's other graded trials (its verifier again, in a fresh sandbox, on the workdir the "
        "trial recorded); task health flags the task's verifier as flaky when a reward differs from the recorded "
        "one, and the verdict weighs each row's change against its share of differing regrades (grader noise). "
        "Above 0 every trial also keeps its task's workdir "
        "in its trial dir; tasks that name no workdir are not regraded. 0: no regrade, nothing extra recorded.",
    )


class ClusterConfig(Section):
    """Where the work runs, beyond the flow's own process."""

    ray_address: str = Field(
        "",
        description="The Ray cluster a step's trials run on, spread over rollout workers (Ray actors); the step "
        "still journals, scores and retries them here. Empty: no Ray, trials run in the flow's process. `local`: "
        "start Ray on this machine for the run. Else a running cluster's address (`host:6379`, `ray://host:10001`).",
    )
    rollout_workers: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Rollout workers on the Ray cluster. Empty: one per alive node.",
    )

    train_ranks: int = Field(
        1,
        ge=1,
        le=64,
        description="Data-parallel trainer processes on this machine: each holds the policy and its optimizer, "
        "computes its share of every minibatch's rollouts, and the gradients are summed across them (gloo on the "
        "CPU, NCCL when each rank has a GPU of its own) before every rank takes the same step. 1: the flow's "
        "process trains alone.",
    )
    listen_host: str = Field(
        "",
        pattern=r"^[A-Za-z0-9.:_-]*$",
        description="The address the engine (and its router) this run starts listens on, and gives rollout "
        "workers. Empty: 127.0.0.1, or this node's address when `ray_address` names a cluster of other machines.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a trainer rank waits in a collective (a gradient sum, a sharded gather) for the "
        "others before the step fails: what a hung, stopped or lost rank costs at most.",
    )
    failure_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long a trainer rank of another process may go without a heartbeat before the step fails "
        "with its cause: a rank stopped, frozen or gone with its node is found this soon, not at the collective "
        "timeout.",
    )


class RunConfig(Section):
    """The whole run: the model and task set, the engine, the agent trials and the GRPO update. Fields left as
    they are keep their defaults; the flow checks the config again when it starts."""

    # (The docstring is the description of the `config` parameter in the Prefect UI's run form.)
    run_id: str | None = Field(
        None,
        pattern=RUN_ID_PATTERN,
        description="Names the run dir, the flow run and its artifacts: lowercase letters, digits and dashes. "
        "Empty: a UTC timestamp plus a short hash.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for prompt order/split, sampling and training.")
    output_dir: str = Field("runs", min_length=1, description="Directory holding one sub-directory per run_id.")
    config_version: Literal[CONFIG_VERSION] = Field(  # type: ignore[valid-type]
        CONFIG_VERSION,
        description="The layout this config is written in; one in an older layout is upgraded when it is read.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig, description="The Harbor task set.")
    prompts: PromptsConfig = Field(default_factory=PromptsConfig, description="How prompts.jsonl is made.")
    engine: EngineConfig = Field(
        default_factory=EmbeddedEngine,
        description="The inference engine: its backend (`engine.backend`) and the settings that backend takes.",
        json_schema_extra=any_of_schema,
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Agent trials per step.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The GRPO update.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Where the work runs.")
    report: ReportConfig = Field(default_factory=ReportConfig, description="What the run's summary says.")

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        # Prefect hands its flow parameter here directly: a deployment may still spell an older layout.
        if not isinstance(data, dict):
            return data
        try:
            data = name_variants(upgrade(data))
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return {**data, "config_version": CONFIG_VERSION}

    @property
    def run_dir(self) -> Path:
        if self.run_id is None:
            raise ConfigError("run config: field `run_id` is not resolved yet (call parse_run_config)")
        return Path(self.output_dir) / self.run_id

    @model_validator(mode="after")
    def _ray_takes_no_key_files(self) -> RunConfig:
        # A key read from a file reaches only this process's environment; Ray workers would start sandboxes
        # without it, and grpoflow ships no secret through Ray.
        keys = {
            "rollout.sandbox.api_key_file": self.rollout.sandbox.key_file(),
            "rollout.harness.policy_api_key_file": self.rollout.harness.policy_key_file(),
        }
        for name, value in keys.items():
            if self.cluster.ray_address and value:
                raise ValueError(
                    f"`{name}`: not with cluster.ray_address; put the key in the environment each Ray "
                    "node was started in"
                )
        return self

    @model_validator(mode="after")
    def _adapter_sync_needs_lora(self) -> RunConfig:
        if self.engine.weight_sync.mode == "adapter" and self.train.lora is None:
            raise ValueError(
                "`engine.weight_sync.mode`: `adapter` syncs a LoRA adapter; set train.lora, or another sync"
            )
        if self.train.lora is not None and not self.engine.takes_lora:
            raise ValueError(
                f"`train.lora`: LoRA runs are not supported with {self.engine.name} here; use SGLang or the "
                "embedded engine"
            )
        return self

    def sharding_mode(self, ranks: int | None = None) -> Literal["replicate", "fsdp"]:
        """`train.sharding` with `auto` resolved: sharded with more than one trainer rank (`ranks`, default
        `cluster.train_ranks`)."""
        if self.train.sharding != "auto":
            return self.train.sharding
        return "fsdp" if (ranks or self.cluster.train_ranks) > 1 else "replicate"

    def weight_sync_mode(self) -> Literal["disk", "distributed", "tensor", "adapter"]:
        """`engine.weight_sync.mode` with `auto` resolved: to the embedded engine in memory, to SGLang through the
        run dir."""
        if self.engine.weight_sync.mode != "auto":
            return self.engine.weight_sync.mode
        return self.engine.default_sync
