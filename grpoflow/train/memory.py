"""What one trainer rank holds, in bytes, before a run rents the GPUs: parameters, gradients, AdamW state, the KL
reference, FSDP's gathered units, activations and the LM head's chunks, from the model's shape and the run's
settings (`grpoflow plan`; `bench/fsdp.py` prints it beside measured peaks).

It counts what this trainer keeps (`train/trainer.py`, `train/fsdp.py`, `train/logprobs.py`): fp32 master weights,
fp32 gradients of the trained weights, AdamW's two fp32 moments; sharded (`fsdp`) all three are split across the
ranks, replicated each rank holds them whole plus the flat fp32 copy `all_reduce_grads` sums. The reference is a
second fp32 model only for full fine-tuning with `kl_coef > 0` (LoRA's is its base with the adapter off).
Activations are an estimate of what autograd keeps per token and layer (the layer's input, its norms, q/k/v, the
attention output and the MLP's three intermediate tensors, at the compute precision); with activation
checkpointing only each layer's input is kept, plus one layer recomputed at a time. The LM head runs in row
chunks of at most 64 MiB of logits (`logprobs._LOGIT_CHUNK_ELEMS`), so no (tokens, vocab) tensor is counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from grpoflow.config import RunConfig

GiB = 2**30
_LOGIT_CHUNK_BYTES = 64 * 2**20  # logprobs.py: chunk * vocab fp32 logits, and their recomputation in backward
_RUNTIME_BYTES = 1 * GiB  # torch's own state per process (the CUDA context on a GPU, the libraries on the CPU)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (transformers' config.json names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2's q/k/v projections have biases; Llama's do not
    head_dim: int | None = None  # None: hidden_size / num_attention_heads (Qwen3-32B's is wider)
    qk_norm: bool = False  # Qwen3 normalizes each head's queries and keys (a head_dim RMSNorm weight each)

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        names = cls.__dataclass_fields__
        given = {k: config[k] for k in names if k in config and k not in ("qkv_bias", "qk_norm")}
        return cls(
            **given,
            qkv_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias")),
            qk_norm=config.get("model_type") in ("qwen3", "qwen3_moe"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelShape:
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        return self.head_size * self.num_key_value_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer in one decoder layer, by its module name."""
        h, i, kv, q = self.hidden_size, self.intermediate_size, self.kv_dim, self.head_size * self.num_attention_heads
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def layer_params(self) -> int:
        q = self.head_size * self.num_attention_heads
        biases = q + 2 * self.kv_dim if self.qkv_bias else 0
        norms = 2 * self.hidden_size + 2 * self.head_size * self.qk_norm  # two RMSNorms (+ q_norm, k_norm)
        return sum(a * b for a, b in self.linear_shapes().values()) + biases + norms

    @property
    def root_params(self) -> int:
        """Embedding, final norm and (untied) LM head: FSDP's root unit."""
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * self.hidden_size + self.hidden_size

    @property
    def params(self) -> int:
        return self.num_hidden_layers * self.layer_params + self.root_params

    def lora_params(self, rank: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        return self.num_hidden_layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)


# Public configs (config.json on the model hub) of the sizes users train, for plans made without the weights.
KNOWN_SHAPES = {
    "qwen2.5-7b": ModelShape(152064, 3584, 18944, 28, 28, 4, qkv_bias=True),
    "qwen2.5-14b": ModelShape(152064, 5120, 13824, 48, 40, 8, qkv_bias=True),
    "qwen2.5-32b": ModelShape(152064, 5120, 27648, 64, 40, 8, qkv_bias=True),
    "qwen3-8b": ModelShape(151936, 4096, 12288, 36, 32, 8, head_dim=128, qk_norm=True),
    "qwen3-14b": ModelShape(151936, 5120, 17408, 40, 40, 8, head_dim=128, qk_norm=True),
    "qwen3-32b": ModelShape(151936, 5120, 25600, 64, 64, 8, head_dim=128, qk_norm=True),
    "smollm2-360m": ModelShape(49152, 960, 2560, 32, 15, 5, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class TrainSetup:
    ranks: int = 1
    sharding: str = "replicate"  # or "fsdp"
    precision: str = "fp32"  # the decoder layers' compute dtype: "fp32" or "bf16"
    lora_rank: int | None = None
    lora_targets: list[str] = field(default_factory=list)
    kl: bool = False  # kl_coef > 0
    micro_batch_tokens: int = 4096
    checkpointing: bool = False  # every micro-batch recomputes its activations (`gradient_checkpointing`)
    checkpoint_above_tokens: int | None = None  # and every one whose longest sample is longer than this
    longest_sample_tokens: int = 0  # the longest sample a step may hold; one longer than a micro-batch runs alone
    reduce_once: bool = False  # sharded gradients accumulate whole until the optimizer step's last micro-batch

    def checkpointed(self, longest: int) -> bool:
        """Whether a micro-batch whose longest sample has `longest` tokens recomputes its activations (as
        `trainer.use_activation_checkpointing` decides)."""
        above = self.checkpoint_above_tokens
        return self.checkpointing or (above is not None and longest > above)


@dataclass(frozen=True)
class MemoryPlan:
    rows: dict[str, int]  # bytes per rank by what holds them

    @property
    def total(self) -> int:
        return sum(self.rows.values())

    def fits(self, device_bytes: int) -> bool:
        return self.total <= device_bytes


def plan_memory(shape: ModelShape, setup: TrainSetup) -> MemoryPlan:
    """Bytes one rank holds at its peak, the update's (see the module doc)."""
    n = setup.ranks if setup.sharding == "fsdp" else 1  # how many ways the persistent state is split
    params = shape.params
    trained = shape.lora_params(setup.lora_rank, setup.lora_targets) if setup.lora_rank else params
    compute = 2 if setup.precision == "bf16" else 4
    t = max(setup.micro_batch_tokens, setup.longest_sample_tokens)  # the most tokens one micro-batch holds
    activations = _peak_activations(shape, setup, compute)
    rows = {
        "parameters": 4 * params // n,
        "gradients": 4 * trained // (1 if setup.reduce_once else n),
        "optimizer": 8 * trained // n,
        "reference": 4 * params // n if setup.kl and not setup.lora_rank else 0,
        # replicated ranks sum gradients through one flat fp32 copy; sharded ones gather a layer (and the next,
        # prefetched) at the compute precision, and the fp32 root unit whole
        "communication": (
            4 * trained
            if setup.sharding != "fsdp" and setup.ranks > 1
            else (2 * shape.layer_params * compute + 4 * shape.root_params if setup.sharding == "fsdp" else 0)
        ),
        "activations": activations,
        "lm head chunks": 2 * _LOGIT_CHUNK_BYTES + 4 * t * 3,  # a chunk, its recomputation; (T,) targets, log Z, logp
        "runtime": _RUNTIME_BYTES,
    }
    return MemoryPlan(rows)


def _peak_activations(shape: ModelShape, setup: TrainSetup, compute: int) -> int:
    """The most activations one micro-batch keeps: a full one, or a sample longer than a micro-batch alone, each
    recomputed (checkpointed) or not as the trainer decides by its longest sample."""
    full, longest = setup.micro_batch_tokens, setup.longest_sample_tokens
    biggest = max(full, longest)
    above = setup.checkpoint_above_tokens
    if setup.checkpointing or above is None:
        return _activations(shape, biggest, setup.checkpointing, compute)
    # samples of at most `above` tokens are not recomputed: a full micro-batch of them, or one alone
    kept = _activations(shape, max(full, min(above, longest)), False, compute)
    return max(kept, _activations(shape, biggest, True, compute)) if longest > above else kept


def _activations(shape: ModelShape, tokens: int, checkpointed: bool, compute: int) -> int:
    """What autograd keeps for a micro-batch of `tokens` (see the module doc)."""
    h, q = shape.hidden_size, shape.head_size * shape.num_attention_heads
    # per token and layer: the input and its norm (h each), q and the attention output (q each), k and v, and the
    # MLP's gate, up and their product (intermediate each)
    per_token_layer = compute * (2 * h + 2 * q + 2 * shape.kv_dim + 3 * shape.intermediate_size)
    if checkpointed:  # each layer's input, and one layer recomputed at a time
        return tokens * (shape.num_hidden_layers * h * compute + per_token_layer)
    return tokens * shape.num_hidden_layers * per_token_layer


def train_setup(cfg: RunConfig, ranks: int, on_gpu: bool) -> TrainSetup:
    """The run's trainer settings with `ranks` ranks, `auto`s resolved as the trainer resolves them."""
    t = cfg.train
    precision = t.precision if t.precision != "auto" else ("bf16" if on_gpu else "fp32")
    return TrainSetup(
        ranks=ranks,
        sharding=cfg.sharding_mode(ranks),
        precision=precision,
        lora_rank=t.lora.rank if t.lora else None,
        lora_targets=list(t.lora.target_modules) if t.lora else [],
        kl=t.loss.kl_coef > 0,
        micro_batch_tokens=t.batch.micro_batch_tokens,
        checkpointing=t.batch.gradient_checkpointing,
        checkpoint_above_tokens=t.batch.checkpoint_above_tokens,
        # a trained sample (a segment of a compacted trial) holds at most an episode's context
        longest_sample_tokens=cfg.rollout.episode.max_context_tokens,
        reduce_once=t.batch.reduce_gradients_once,
    )


def plan_table(shape: ModelShape, setups: dict[str, TrainSetup], device_gb: float | None = None) -> list[str]:
    """A table of GiB per rank, one column per setup, with the total and (given a device size) whether it fits."""
    plans = {name: plan_memory(shape, s) for name, s in setups.items()}
    width = max(12, *(len(n) for n in setups))
    lines = [f"{'GiB per rank':<16}" + "".join(f"{n:>{width + 2}}" for n in setups)]
    for row in next(iter(plans.values())).rows:
        lines.append(f"{row:<16}" + "".join(f"{p.rows[row] / GiB:>{width + 2}.1f}" for p in plans.values()))
    lines.append(f"{'total':<16}" + "".join(f"{p.total / GiB:>{width + 2}.1f}" for p in plans.values()))
    if device_gb is not None:
        verdicts = ["fits" if p.fits(int(device_gb * 1e9)) else "does not fit" for p in plans.values()]
        lines.append(f"{f'on {device_gb:g} GB':<16}" + "".join(f"{v:>{width + 2}}" for v in verdicts))
    return lines
