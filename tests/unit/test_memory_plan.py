"""`grpoflow plan`'s memory per trainer rank: the parameter count is the model's own, the persistent state splits
across sharded ranks, and what the trainer does not keep (a second reference for LoRA, a flat gradient copy when
sharded) is not counted."""

from dataclasses import replace

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from flows.cli import main
from grpoflow.config import parse_run_config
from grpoflow.train.memory import KNOWN_SHAPES, ModelShape, TrainSetup, plan_memory, train_setup

GiB = 2**30


def test_the_shape_counts_the_parameters_transformers_builds(tiny_model_dir):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    assert ModelShape.from_dir(tiny_model_dir).params == sum(p.numel() for p in model.parameters())
    # the published counts of SmolLM2-135M and Qwen2.5-7B
    assert ModelShape(49152, 576, 1536, 30, 9, 3, tie_word_embeddings=True).params == 134_515_008
    assert KNOWN_SHAPES["qwen2.5-7b"].params == 7_615_616_512


def test_a_qwen3_shape_with_its_wider_heads_counts_what_transformers_builds():
    """Qwen3-32B's heads (64 x 128) are wider than its hidden size (5120), and every Qwen3 normalizes queries and
    keys: the shape read from a config.json of that kind counts what transformers builds from it."""
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=1000,
        hidden_size=80,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config.to_dict())
    assert shape.head_size == 16 and shape.qk_norm
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert round(KNOWN_SHAPES["qwen3-32b"].params / 1e9, 1) == 32.8  # the model card's 32.8B


def test_sharding_splits_weights_gradients_and_adam_and_replicating_adds_the_flat_gradient_copy():
    shape = KNOWN_SHAPES["qwen2.5-7b"]
    one = plan_memory(shape, TrainSetup(ranks=1)).rows
    replicated = plan_memory(shape, TrainSetup(ranks=4)).rows
    sharded = plan_memory(shape, TrainSetup(ranks=4, sharding="fsdp")).rows
    assert one["parameters"] == 4 * shape.params and one["optimizer"] == 8 * shape.params
    assert one["communication"] == 0 and replicated["communication"] == 4 * shape.params
    for row in ("parameters", "gradients", "optimizer"):
        assert sharded[row] == one[row] // 4 and replicated[row] == one[row]
    # a gathered layer (and the next) in bf16 plus the fp32 root unit, not the model
    assert shape.root_params * 4 < sharded["communication"] < one["parameters"] / 4
    # reduced once per optimizer step, the gradients accumulate whole on every rank until then
    once = plan_memory(shape, TrainSetup(ranks=4, sharding="fsdp", reduce_once=True)).rows
    assert once["gradients"] == one["gradients"] and once["optimizer"] == sharded["optimizer"]


def test_a_sample_longer_than_a_micro_batch_is_planned_alone_and_by_its_own_checkpointing():
    """The step runs a sample longer than `micro_batch_tokens` alone; it recomputes activations when longer than
    `checkpoint_above_tokens`, while a full micro-batch of shorter samples does not."""
    shape = KNOWN_SHAPES["qwen3-14b"]
    base = TrainSetup(ranks=8, sharding="fsdp", precision="bf16", micro_batch_tokens=4096)
    acts = lambda **kw: plan_memory(shape, replace(base, **kw)).rows["activations"]  # noqa: E731
    short = acts()
    assert acts(longest_sample_tokens=32768) == 8 * short  # alone, nothing recomputed: 8x the tokens
    small = acts(micro_batch_tokens=1024)  # beside micro-batches small enough that the long sample is the peak
    recomputed = acts(micro_batch_tokens=1024, longest_sample_tokens=32768, checkpoint_above_tokens=4096)
    assert small < recomputed < 32 * small  # the long one recomputes
    # a full micro-batch of samples under the threshold does not recompute, whatever its size
    assert acts(micro_batch_tokens=16384, checkpoint_above_tokens=4096) == 4 * short
    # nor does a sample longer than a micro-batch but under the threshold, alone
    assert acts(longest_sample_tokens=32768, checkpoint_above_tokens=16384) == 4 * short
    cfg = parse_run_config({"rollout": {"episode": {"max_context_tokens": 32768}}})
    assert train_setup(cfg, 8, on_gpu=True).longest_sample_tokens == 32768


def test_lora_trains_adapters_only_and_its_reference_is_the_base():
    shape = KNOWN_SHAPES["qwen2.5-32b"]
    full = plan_memory(shape, TrainSetup(kl=True)).rows
    lora = plan_memory(shape, TrainSetup(kl=True, lora_rank=16, lora_targets=["q_proj", "v_proj"])).rows
    assert full["reference"] == full["parameters"] and lora["reference"] == 0
    per_layer = 16 * (5120 + 5120) + 16 * (5120 + 1024)
    assert lora["optimizer"] == 8 * 64 * per_layer and lora["parameters"] == full["parameters"]


def test_activation_checkpointing_keeps_each_layer_s_input_only():
    shape = KNOWN_SHAPES["qwen2.5-7b"]
    plain = plan_memory(shape, TrainSetup(precision="bf16", micro_batch_tokens=8192)).rows["activations"]
    saved = plan_memory(shape, TrainSetup(precision="bf16", micro_batch_tokens=8192, checkpointing=True))
    assert saved.rows["activations"] < plain / 5
    assert saved.rows["activations"] >= 8192 * 28 * 3584 * 2


def test_the_run_s_settings_resolve_as_the_trainer_resolves_them():
    batch = {"micro_batch_tokens": 8192, "reduce_gradients_once": True}
    cfg = parse_run_config({"run_id": "p", "train": {"loss": {"kl_coef": 0.1}, "batch": batch}})
    gpu, cpu = train_setup(cfg, 4, on_gpu=True), train_setup(cfg, 1, on_gpu=False)
    assert (gpu.sharding, gpu.precision, gpu.kl, gpu.checkpointing, gpu.reduce_once) == (
        "fsdp",
        "bf16",
        True,
        False,
        True,
    )
    assert gpu.checkpointed(8192) and not gpu.checkpointed(4096)  # above train.batch.checkpoint_above_tokens
    assert (cpu.sharding, cpu.precision) == ("replicate", "fp32")


def test_grpoflow_plan_prints_the_placement_and_a_column_per_rank_count(capsys):
    argv = ["plan", "--shape", "qwen2.5-32b", "--ranks", "4,8", "--gpus", "8", "--set", "train.lora.rank=16"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "grpoflow plan: trainer on GPU 0, engine off this machine's GPUs (of 8)"
    assert "qwen2.5-32b (32.76B parameters), LoRA r=16, bf16 compute" in out[1]
    assert out[2].split() == ["GiB", "per", "rank", "4", "ranks", "8", "ranks"]
    total = next(line for line in out if line.startswith("total")).split()[1:]
    assert float(total[0]) > float(total[1])
    assert out[-1].split()[-2:] == ["fits", "fits"]
    assert main(["plan", "--shape", "llama-9000b"]) == 2
    assert "--shape llama-9000b: not one of" in capsys.readouterr().err
