"""Sharded GRPO updates (`train.sharding` fsdp, torch FSDP2 on gloo): 2 and 4 ranks take the single process's
step (both loss aggregations, dual-clip, truncated importance sampling and the mismatch band on; LoRA with its KL
reference as the adapter-off policy; a full fine-tune's sharded reference), weights equal within fp32 rounding;
bf16 mixed precision keeps fp32 master weights and AdamW state."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from grpoflow.config import parse_run_config
from grpoflow.train.fsdp import decoder_layers, full_parameters, is_sharded, served
from grpoflow.train.ranks import leave_trainer_group, run_update, trainer_ranks
from grpoflow.train.trainer import load_trainer
from tests.fakes.samples import agentic_samples

pytestmark = pytest.mark.timeout(900)

OFF_POLICY = {"old_logprobs": "recompute", "dual_clip": 3.0, "tis_cap": 2.0, "mismatch_band": 1.5}
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
CASES = {
    "token": {"loss_aggregation": "token", **OFF_POLICY},
    "sample-minibatches": {
        "loss_aggregation": "sample",
        "global_batch_size": 4,
        "micro_batch_tokens": 64,
        **OFF_POLICY,
    },
    "a-rank-idle": {"loss_aggregation": "sample", "global_batch_size": 1},
    # gradients kept whole over a minibatch's micro-batches (and a rank's idle passes), reduced after the last
    "reduce-once": {"global_batch_size": 4, "batch": {"micro_batch_tokens": 64, "reduce_gradients_once": True}},
    "lora-kl": {"lora": LORA, "kl_coef": 0.1, "learning_rate": 1e-3},
    "full-kl": {"kl_coef": 0.1},
}


def _config(model_dir, ranks, sharding, **train):
    return parse_run_config(
        {
            "run_id": "fsdp",
            "model": {"source": str(model_dir)},
            "dataset": {"path": "builtin-fixed"},
            "train": {"learning_rate": 1e-5, "sharding": sharding, **train},
            "cluster": {"train_ranks": ranks},
        }
    )


def _single(model_dir, train, steps=2):
    cfg = _config(model_dir, 1, "replicate", **train)
    state = load_trainer(model_dir, cfg.train, seed=0)
    samples = agentic_samples(state.model)
    metrics = [run_update(state, samples, cfg, step).computed for step in range(steps)]
    return metrics, {n: p.detach().clone() for n, p in state.model.named_parameters()}, samples


def _sharded(model_dir, ranks, samples, train, steps=2, **extra):
    cfg = _config(model_dir, ranks, "fsdp", **train, **extra)
    state = load_trainer(model_dir, cfg.train, seed=0, sharded=True)
    with trainer_ranks(state, model_dir, cfg):
        assert is_sharded(state.model)
        metrics = [run_update(state, samples, cfg, step).computed for step in range(steps)]
        weights = full_parameters(state)
        master = {n: (p.to_local().dtype, type(p)) for n, p in state.model.named_parameters()}
        moments = [v.to_local().dtype for s in state.optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert state.dp is None
    return metrics, weights, master, moments


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_ranks_take_the_single_process_step(tiny_model_dir, case, ranks):
    train = CASES[case]
    expected, theirs, samples = _single(tiny_model_dir, train)
    got, ours, master, _ = _sharded(tiny_model_dir, ranks, samples, train)
    assert all(t is DTensor and d == torch.float32 for d, t in master.values())
    for want, have in zip(expected, got, strict=True):
        assert want["optimizer_steps"] >= 1 and have["optimizer_steps"] == want["optimizer_steps"]
        for key in ("n_samples", "n_tokens", "n_forward_tokens", "skipped_masked", "tokens_trained"):
            assert have[key] == want[key], key
        for key in ("loss", "grad_norm", "clip_frac_high", "logprob_gap_mean", "entropy", "mismatch_masked_frac"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        if "kl" in want:
            assert have["kl"] == pytest.approx(want["kl"], rel=1e-4, abs=1e-9)
    assert sorted(ours) == sorted(theirs)
    moved = [n for n in theirs if not torch.equal(theirs[n], load_trainer_weight(tiny_model_dir, n, train))]
    assert moved  # the steps changed weights: the comparison below is not of two untouched models
    for name, p in theirs.items():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=1e-6, msg=name)


_INITIAL: dict = {}


def load_trainer_weight(model_dir, name, train):
    key = (str(model_dir), bool(train.get("lora")))
    if key not in _INITIAL:
        cfg = _config(model_dir, 1, "replicate", **train)
        _INITIAL[key] = {
            n: p.detach().clone() for n, p in load_trainer(model_dir, cfg.train, seed=0).model.named_parameters()
        }
    return _INITIAL[key][name]


def test_bf16_keeps_fp32_master_weights_and_two_ranks_take_one_ranks_step(tiny_model_dir):
    """bf16 layers on the CPU: master weights and AdamW moments stay fp32 DTensors; 2 sharded ranks take the
    step of 1 sharded rank (same bf16 casts; only the reduction order differs), and both are near fp32's."""
    train = {"loss_aggregation": "token", "precision": "bf16", **OFF_POLICY}
    fp32, _, samples = _single(tiny_model_dir, {k: v for k, v in train.items() if k != "precision"}, steps=1)
    one, w1, master, moments = _sharded(tiny_model_dir, 1, samples, train, steps=1)
    two, w2, _, _ = _sharded(tiny_model_dir, 2, samples, train, steps=1)
    assert all(t is DTensor and d == torch.float32 for d, t in master.values())
    assert moments and all(d == torch.float32 for d in moments)
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-3)
    assert one[0]["grad_norm"] == pytest.approx(fp32[0]["grad_norm"], rel=5e-2)
    assert one[0]["grad_norm"] != fp32[0]["grad_norm"]  # bf16 did run: its rounding shows
    # Adam's first step moves every weight by about lr whatever its gradient's size, so a near-zero gradient
    # whose sign the other reduction order flips moves its weight the other way: some elements (about a tenth of
    # a percent, seen on the CPU) differ by up to 2 x lr; the others agree to within fp32 rounding of the update.
    lr = _config(tiny_model_dir, 1, "fsdp", **train).train.optimizer.learning_rate
    diff = torch.cat([(w2[name] - p).abs().flatten() for name, p in w1.items()])
    assert (diff > 2e-6).float().mean().item() < 1e-2 and diff.max().item() <= 2 * lr * 1.01


def test_a_sync_gathers_each_tensor_in_the_engine_s_dtype(tiny_model_dir):
    """Each shard is cast to the engine's dtype before its gather: half the bytes on the wire and in memory for
    bf16, and the bits of the fp32 whole cast after."""
    cfg = _config(tiny_model_dir, 2, "fsdp")
    state = load_trainer(tiny_model_dir, cfg.train, seed=0, sharded=True)
    with trainer_ranks(state, tiny_model_dir, cfg):
        whole = full_parameters(state)
        names, shapes, tensors = served(state, torch.bfloat16)
        sent = dict(zip(names, tensors, strict=True))
    assert set(sent) == set(whole)  # the tiny model ties no tensor: every parameter is served under its name
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, whole[n].to(torch.bfloat16)) for n, t in sent.items())
    assert [list(sent[n].shape) for n in names] == shapes


def test_activation_checkpointing_changes_no_bit(tiny_model_dir):
    """Micro-batches longer than `checkpoint_above_tokens` recompute their layers in backward (counted on rank
    0): the sharded update is bitwise the one without."""
    train = {"loss_aggregation": "token", "micro_batch_tokens": 64}
    _, _, samples = _single(tiny_model_dir, train, steps=0)
    out = {}
    for above in (None, 8):
        cfg = _config(tiny_model_dir, 2, "fsdp", **train, checkpoint_above_tokens=above)
        state = load_trainer(tiny_model_dir, cfg.train, seed=0, sharded=True)
        calls = []
        for layer in decoder_layers(state.model):
            if hasattr(layer, "_gradient_checkpointing_func"):
                func = layer._gradient_checkpointing_func
                layer._gradient_checkpointing_func = lambda *a, f=func, **k: calls.append(1) or f(*a, **k)
        with trainer_ranks(state, tiny_model_dir, cfg):
            run_update(state, samples, cfg, 0)
            out[above] = (len(calls), full_parameters(state))
    assert out[None][0] == 0 and out[8][0] > 0
    for name, p in out[None][1].items():
        assert torch.equal(out[8][1][name], p), name


@pytest.mark.parametrize("train", [{}, {"lora": LORA, "learning_rate": 1e-3}], ids=["full", "lora"])
def test_sharded_checkpoint_is_an_hf_dir_and_resumes_bit_exact(tiny_model_dir, tmp_path, train):
    """2 sharded ranks: step 0, full checkpoint from the shards (DCP), step 1. The checkpoint is a plain HF dir
    (from_pretrained loads the policy's weights, a LoRA run's merged); a trainer restored from it and sharded over
    2 ranks again takes step 1 to the same bytes (AdamW's moments decide them); a single process restored from it takes
    the same step within fp32 rounding."""
    from transformers import AutoModelForCausalLM

    from grpoflow.figures import Figures
    from grpoflow.run.commit import StepCommits, save_step
    from grpoflow.run.metrics import MetricsLog
    from grpoflow.run.record import StepRecord, StepTimes
    from grpoflow.run.resume import find_resume_point
    from grpoflow.train.checkpoint import OPTIMIZER_DCP, holds_optimizer, restore_training_state
    from tests.integration.test_resume_core import _run_dir

    paths = _run_dir(tmp_path)
    cfg = _config(tiny_model_dir, 2, "fsdp", **train)
    a = load_trainer(tiny_model_dir, cfg.train, seed=0, sharded=True)
    samples = agentic_samples(a.model)
    log = MetricsLog(paths.metrics, paths.tb)
    with trainer_ranks(a, tiny_model_dir, cfg):
        m0 = run_update(a, samples, cfg, 0).computed
        record = StepRecord(0, train=Figures({"train/loss": m0["loss"]}), times=StepTimes(step=1.0))
        commits = StepCommits(paths, log)
        commits.finish(a, save_step(a, paths, 0, record), 0, record, full=True)
        commits.flush()
        saved = full_parameters(a)
        run_update(a, samples, cfg, 1)
        after = full_parameters(a)
    log.close()
    ckpt = find_resume_point(paths).checkpoint
    assert holds_optimizer(ckpt) and (ckpt / OPTIMIZER_DCP / ".metadata").is_file()
    assert not (ckpt / "sharded").exists() and not list(ckpt.glob(".*"))
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
    if "lora" in train:  # the merged model: base + the adapter's delta, under the base model's names
        b = load_trainer(tiny_model_dir, cfg.train, seed=0)
        restore_training_state(b, ckpt)
        from grpoflow.train.lora import serving_tensors

        for name, t in serving_tensors(b.model).items():
            assert torch.equal(hf[name], t), name
    else:
        for name, t in saved.items():
            assert torch.equal(hf[name], t), name

    # sharded again over 2 ranks: the same bytes as the uninterrupted trainer
    c = load_trainer(tiny_model_dir, cfg.train, seed=0, sharded=True)
    assert restore_training_state(c, ckpt)["optimizer_steps"] == 1
    with trainer_ranks(c, tiny_model_dir, cfg, ckpt):
        assert all(torch.equal(v, saved[k]) for k, v in full_parameters(c).items())  # rank 0's, on every shard
        run_update(c, samples, cfg, 1)
        resumed = full_parameters(c)
    for name, t in after.items():
        assert torch.equal(resumed[name], t), name

    # and one process, unsharded
    one = _config(tiny_model_dir, 1, "replicate", **train)
    d = load_trainer(tiny_model_dir, one.train, seed=0)
    restore_training_state(d, ckpt)
    run_update(d, samples, one, 1)
    for name, p in d.model.named_parameters():
        torch.testing.assert_close(p.detach(), after[name], rtol=0, atol=1e-6, msg=name)


def test_a_large_sharded_checkpoint_is_split_into_files_with_an_index(tiny_model_dir, tmp_path, monkeypatch):
    """Above `MAX_FILE_BYTES` the weights go to several safetensors files and an index, as `save_pretrained`
    writes a large model; `from_pretrained` loads them as the trainer's weights (one sharded rank, bf16 cast)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import grpoflow.train.dcp as dcp_mod
    from grpoflow.train.checkpoint import save_sharded_checkpoint

    monkeypatch.setattr(dcp_mod, "MAX_FILE_BYTES", 200_000)
    cfg = _config(tiny_model_dir, 1, "fsdp")
    state = load_trainer(tiny_model_dir, cfg.train, seed=0, sharded=True)
    with trainer_ranks(state, tiny_model_dir, cfg):
        out = save_sharded_checkpoint(
            state, tmp_path / "ckpt", step_record={"step": 0}, durable=True, weights=True, dtype=torch.bfloat16
        )
        weights = full_parameters(state)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and (out / "model.safetensors.index.json").is_file() and (out / "step.json").is_file()
    stored = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    for name, t in weights.items():
        assert stored[name].dtype == torch.bfloat16 and torch.equal(loaded[name], t.to(torch.bfloat16)), name


def test_ranks_meet_after_this_process_made_other_groups(tiny_model_dir):
    """torch names a default group by how many groups its process has made; rank 0 (this long-lived process) has
    made some, the fresh worker ranks none: they still meet, at once."""
    for _ in range(2):  # as earlier trainer ranks of this process leave it (a weight-update group outlives them)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        leave_trainer_group(dist.group.WORLD)
    cfg = _config(tiny_model_dir, 2, "fsdp")
    state = load_trainer(tiny_model_dir, cfg.train, seed=0, sharded=True)
    with trainer_ranks(state, tiny_model_dir, cfg):  # without the fix: hangs until the group's timeout
        assert is_sharded(state.model) and state.dp.world == 2
