"""The GRPO update: the objective, the optimizer, batching, checkpoints and evaluations."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpoflow.config.base import Section


class LoraSettings(Section):
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank r: the adapter's inner dimension.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the adapter's output is scaled by alpha / rank.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names (last part) of the linear layers of the blocks that get an adapter.",
    )

    @field_validator("target_modules")
    @classmethod
    def _block_linears(cls, v: list[str]) -> list[str]:
        # tied to each other in most small models, and an engine skips a tied head when it loads weights
        tied = sorted(set(v) & {"lm_head", "embed_tokens"})
        if tied:
            raise ValueError(f"{', '.join(tied)}: adapters go on the linear layers of the blocks only")
        return v


# Settings that act only on recomputed old logprobs (`TrainConfig.old_logprobs_mode`): set otherwise, they would do
# nothing.
_RECOMPUTE_ONLY = ("tis_cap", "mismatch_band")


class LossConfig(Section):
    """The GRPO objective: clipping, the old policy, advantages, how the loss is aggregated."""

    eps_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip range below 1 (ratio >= 1 - eps_low).")
    eps_high: float = Field(0.28, ge=0.0, le=10.0, description="PPO clip range above 1 (ratio <= 1 + eps_high).")
    kl_coef: float = Field(0.0, ge=0.0, description="Coefficient of the k3 KL penalty to the reference model.")
    old_logprobs: Literal["auto", "rollout", "recompute"] = Field(
        "auto",
        description="The PPO ratio's old policy: `rollout` takes the engine's logprobs from the rollout; "
        "`recompute` has the trainer recompute them before the update (one more forward pass; with stale rollouts, "
        "the decoupled objective) and corrects the engine-vs-trainer mismatch apart (`tis_cap`, `mismatch_band`). "
        "`auto`: `recompute` with `train.max_staleness` > 0, else `rollout`.",
    )
    dual_clip: float | None = Field(
        3.0,
        gt=1.0,
        description="Dual-clip for negative advantages: past this ratio a token keeps no gradient, so no "
        "mismatched token can set the step's direction. Empty: off.",
    )
    tis_cap: float | None = Field(
        2.0,
        gt=0.0,
        description="With recomputed old logprobs: each token's loss is weighted by its trainer/engine probability "
        "ratio, capped here (truncated importance sampling). Empty: no weight.",
    )
    mismatch_band: float | tuple[float, float] | None = Field(
        None,
        description="With recomputed old logprobs: tokens whose trainer/engine probability ratio is outside the "
        "band are left out of the loss (counted). A number b: [1/b, b]; a pair [low, high] with low < 1 < high: "
        "that band (IcePop's is [0.5, 5]). Empty: none are.",
    )
    scale_by_std: bool = Field(
        True,
        description="Divide group advantages by the group's reward std. Off is Dr.GRPO's advantage; Dr.GRPO also "
        "divides the loss by a constant, not by token counts, which neither loss_aggregation does.",
    )
    loss_aggregation: Literal["token", "sample"] = Field(
        "token", description="Average the loss over all tokens of the batch, or per sample then over samples."
    )
    filter_zero_std: bool = Field(
        True,
        description="Leave out groups whose rewards are all equal (they carry no GRPO signal); counted in metrics.",
    )
    truncated: Literal["train", "mask", "penalize"] = Field(
        "train",
        description="Over-long samples (a turn cut off, or the context window full): `train` them as any other, "
        "`mask` their loss (their reward still counts in the group's statistics), or `penalize` every sample "
        "DAPO-style: a turn longer than rollout.sampling.max_new_tokens - overlong_cache loses reward linearly, -1 "
        "at the limit.",
    )
    overlong_cache: int | None = Field(
        None,
        ge=1,
        description="The soft band of `penalize`, in tokens. Empty: a quarter of rollout.sampling.max_new_tokens.",
    )

    @field_validator("mismatch_band")
    @classmethod
    def _band_holds_one(cls, band: float | tuple[float, float] | None) -> float | tuple[float, float] | None:
        if band is None:
            return None
        low, high = (1 / band, band) if isinstance(band, float) else band
        if not 0 < low < 1 < high:
            raise ValueError("a number above 1, or a pair [low, high] with 0 < low < 1 < high")
        return band


class OptimizerConfig(Section):
    """The AdamW optimizer."""

    learning_rate: float = Field(1e-5, gt=0.0, le=1.0, description="AdamW learning rate.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")


class BatchConfig(Section):
    """How a step's rollouts are cut into optimizer steps and micro-batches, and what that costs in memory."""

    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Rollouts (trials) per optimizer step; a compacted trial's segments stay together. Empty: all of the rollout step (one update).",
    )
    micro_batch_tokens: int = Field(
        4096, ge=64, description="Token budget of one forward/backward micro-batch (gradients accumulate)."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    reduce_gradients_once: bool = Field(
        False,
        description="Sharded ranks (`train.sharding` fsdp) reduce-scatter the gradients once per optimizer step, "
        "after its last micro-batch, instead of after every micro-batch: fewer collectives, while every rank "
        "holds the whole fp32 gradient until then (4 bytes per trained parameter, not 4 / ranks). Replicated "
        "ranks always sum once per optimizer step.",
    )
    checkpoint_above_tokens: int | None = Field(
        4096,
        ge=1,
        description="Recompute activations in backward for every micro-batch whose longest sample is longer than "
        "this (all of them with `gradient_checkpointing`). Empty: `gradient_checkpointing` alone decides.",
    )


class CheckpointConfig(Section):
    """Which steps leave a full checkpoint."""

    interval: int = Field(
        10,
        ge=1,
        description="Write a full checkpoint (weights, optimizer state, counters: a resume point, kept) after every "
        "N steps and after the last. Other steps write only the weights the engine loads next, and only the "
        "latest of those is kept.",
    )


class EvalConfig(Section):
    """The policy's evaluation on its train tasks and the held-out split."""

    samples_per_prompt: int = Field(
        4,
        ge=0,
        le=256,
        description="Trials per prompt when the run evaluates the policy on its train tasks and on the held-out "
        "`eval` split, with the same seeds every time, so evaluations differ only by the weights. 0: no evaluation.",
    )
    interval: int = Field(
        0,
        ge=0,
        description="Evaluate before the first step, after the last, and also every N steps between (0: only "
        "before and after).",
    )


class TrainConfig(Section):
    steps: int = Field(16, ge=0, le=100000, description="Training steps (rollout -> evaluate -> GRPO update).")
    max_staleness: int = Field(
        0,
        ge=0,
        le=16,
        description="How many updates behind the trainer the weights that generated a step's trials may be. 0: "
        "each step's rollout waits for the previous step's update. 1 or more: the next step's rollout runs on "
        "the engine while the trainer trains on this one (one rollout ahead), and the weights reach the engine "
        "between rollouts, at most `max_staleness` updates late (k > 1 syncs less often). A trial's turns all "
        "come from one weight version; older samples are dropped and counted. On a CPU box with the embedded "
        "engine the trainer then takes the cores the engine leaves.",
    )
    max_probe_logprob_gap: float | None = Field(
        0.1,
        gt=0.0,
        description="Before the first step the engine samples a short probe reply and the trainer scores it: a mean "
        "|engine - trainer| logprob beyond this (nats) fails the run, since every PPO ratio would be noise. "
        "Empty: no probe.",
    )
    max_failed_steps: int = Field(
        3,
        ge=1,
        description="Steps in a row whose every trial failed, before the run stops with the most common reasons "
        "(instead of committing unchanged weights).",
    )
    sharding: Literal["auto", "replicate", "fsdp"] = Field(
        "auto",
        description="How `cluster.train_ranks` hold the policy: `replicate` gives every rank the whole model, "
        "gradients and optimizer state; `fsdp` shards all three across the ranks (torch FSDP2). `auto`: `fsdp` "
        "with more than one rank.",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="The decoder layers' compute dtype; weights, optimizer state, gradient reductions and the LM "
        "head stay fp32. `auto`: bf16 on a GPU, fp32 on the CPU.",
    )
    lora: LoraSettings | None = Field(
        None,
        description="Train LoRA adapters (PEFT) instead of all weights: only the adapters are trained and "
        "checkpointed; the engine serves the base model with the adapters merged in. Empty: full training.",
    )
    loss: LossConfig = Field(default_factory=LossConfig, description="The GRPO objective.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="The AdamW optimizer.")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="Optimizer steps and micro-batches.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Full checkpoints.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation of the policy.")

    @model_validator(mode="after")
    def _no_setting_that_does_nothing(self) -> TrainConfig:
        if self.old_logprobs_mode() == "recompute":
            return self
        for name in _RECOMPUTE_ONLY:
            # A saved config.json names every field: only a value other than the default (or off) was chosen.
            value = getattr(self.loss, name)
            default = LossConfig.model_fields[name].default
            if name in self.loss.model_fields_set and value is not None and value != default:
                raise ValueError(
                    f"`train.loss.{name}`: acts only on recomputed old logprobs and this run takes the rollout's; set "
                    "train.loss.old_logprobs=recompute (`auto` does with max_staleness > 0), or leave it unset"
                )
        return self

    def old_logprobs_mode(self) -> Literal["rollout", "recompute"]:
        """`loss.old_logprobs` with `auto` resolved: the decoupled objective (`recompute`) when rollouts may be
        stale."""
        if self.loss.old_logprobs != "auto":
            return self.loss.old_logprobs
        return "recompute" if self.max_staleness > 0 else "rollout"
