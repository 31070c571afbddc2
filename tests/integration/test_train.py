"""The train step on the tiny random model: logprobs, accumulation, no-op steps, determinism, checkpoints, learning."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpoflow.config import RunConfig, TrainConfig
from grpoflow.prepare.model import prepare_model
from grpoflow.run.commit import prune_checkpoints
from grpoflow.train.checkpoint import save_checkpoint
from grpoflow.train.logprobs import token_logprobs
from grpoflow.train.step import (
    backward_minibatch,
    pack_micro_batches,
    prepare_samples,
    train_step,
)
from grpoflow.train.threads import share_cores
from grpoflow.train.trainer import load_trainer
from tests.fakes.samples import agentic_samples, make_sample


def _sample(tokens, mask, logprobs, reward, group, i=0, status="COMPLETED"):
    return make_sample(group, i, reward, status, tokens=tokens, mask=mask, logprobs=logprobs)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_token_logprobs_match_full_softmax(tiny_model_dir, monkeypatch):
    import grpoflow.train.logprobs as logprobs_mod

    monkeypatch.setattr(logprobs_mod, "_LOGIT_CHUNK_ELEMS", 1024 * 4)  # 4-row chunks: exercise the chunking
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(3, 1000, (3, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.rand(3, 12, generator=torch.Generator().manual_seed(1)) > 0.3  # (B, L-1)
    w = torch.randn(3, 12, generator=torch.Generator().manual_seed(2))

    lp, ent = token_logprobs(model, ids, mask)
    (lp * w).sum().backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    logits = model(ids[:, :-1]).logits.float()  # (B, L-1, V)
    full = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1) * mask
    (full * w).sum().backward()
    torch.testing.assert_close(lp, full, atol=1e-5, rtol=1e-5)
    probs = logits.softmax(-1)
    torch.testing.assert_close(ent, -(probs * logits.log_softmax(-1)).sum(-1) * mask, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(fused_grads[n], p.grad, atol=1e-6, rtol=1e-4, msg=n)


def test_pack_micro_batches():
    batches = pack_micro_batches([10, 40, 100, 20, 30, 5], budget=64)
    # longest first; rows * longest <= 64; the 100-token sample alone
    assert batches == [[2], [1], [4, 3], [0, 5]]
    assert sorted(i for b in batches for i in b) == list(range(6))


@pytest.mark.parametrize("aggregation", ["token", "sample"])
def test_micro_batching_gives_the_whole_batch_gradient(tiny_model_dir, aggregation):
    cfg = TrainConfig(loss={"loss_aggregation": aggregation}, batch={"micro_batch_tokens": 100_000})
    state = load_trainer(tiny_model_dir, cfg, seed=0)
    samples = agentic_samples(state.model)
    kept, adv, _ = prepare_samples(samples, cfg)

    def grads(budget):
        state.model.zero_grad(set_to_none=True)
        batch = cfg.batch.model_copy(update={"micro_batch_tokens": budget})
        m = backward_minibatch(state, kept, adv, cfg.model_copy(update={"batch": batch}))
        return {n: p.grad.clone() for n, p in state.model.named_parameters()}, m

    whole, m_whole = grads(100_000)
    split, m_split = grads(64)
    assert m_whole["n_micro_batches"] == 1 and m_split["n_micro_batches"] >= 6
    assert m_whole["loss"] == pytest.approx(m_split["loss"], abs=1e-6)  # ~0: advantages sum to 0 per group
    assert m_whole["n_tokens"] == m_split["n_tokens"]
    for n in whole:
        torch.testing.assert_close(split[n], whole[n], atol=1e-7, rtol=1e-4, msg=n)
    assert max(g.abs().max().item() for g in whole.values()) > 0


@pytest.mark.parametrize("filter_zero_std", [True, False])
def test_all_zero_advantages_leave_weights_bitwise_unchanged(tiny_model_dir, filter_zero_std):
    # weight decay on: an optimizer.step with zero gradients would still shrink the weights
    cfg = TrainConfig(loss={"filter_zero_std": filter_zero_std}, optimizer={"weight_decay": 0.1, "learning_rate": 1e-2})
    state = load_trainer(tiny_model_dir, cfg, seed=0)
    samples = agentic_samples(state.model)
    for s in samples:
        s.reward = 0.1 if s.group_id == "g0" else 1.0  # every group flat
    before = _weights(state.model)
    m = train_step(state, samples, cfg, seed=0)
    assert m["optimizer_steps"] == 0 and m["zero_std_groups"] == 3
    after = _weights(state.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_train_step_is_deterministic_and_moves_weights(tiny_model_dir):
    cfg = TrainConfig(
        optimizer={"learning_rate": 1e-3, "weight_decay": 0.01},
        batch={"global_batch_size": 5, "micro_batch_tokens": 64},
    )
    runs = []
    for _ in range(2):
        state = load_trainer(tiny_model_dir, cfg, seed=3)
        samples = agentic_samples(state.model)
        before = _weights(state.model)
        m = train_step(state, samples, cfg, seed=7)
        runs.append((_weights(state.model), m))
    (w1, m1), (w2, m2) = runs
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w1["lm_head.weight"], before["lm_head.weight"])
    assert m1["optimizer_steps"] == 3  # 12 samples, 5 per optimizer step
    assert m1["n_samples"] == 12 and m1["n_tokens"] == sum(sum(s.loss_mask[1:]) for s in samples)
    for k in (
        "loss",
        "grad_norm",
        "clip_frac_low",
        "clip_frac_high",
        "logprob_gap_mean",
        "logprob_gap_max",
        "entropy",
    ):
        assert k in m1 and m1[k] == m1[k], k
    assert 0 < m1["logprob_gap_mean"] < 0.2  # rollout logprobs are the model's + N(0, 0.05) noise
    assert m1 == m2  # what the step computed, every figure of it; its seconds are the update's (grpo_update)


def test_an_update_sharing_cores_with_a_rollout_takes_them_back_within_a_micro_batch_and_keeps_its_bits():
    """An async run's trainer runs on the cores the engine leaves while a rollout runs beside it and on all of them
    once it is done, switching between transformer layers, forward and backward; the update must be the one a
    fixed thread count gives, or a rerun of an async run would depend on timing. SmolLM2, the main job's model:
    its GEMMs are wide enough to be split between threads. Here, on 2 threads beside a 1-thread engine."""
    model = prepare_model("smollm2-135m-instruct").path
    cfg = TrainConfig(optimizer={"learning_rate": 1e-4})  # the whole step in one micro-batch, as on the main job
    threads = torch.get_num_threads()
    seen = []  # the thread count each time the share is asked, before it sets the next

    def generating():
        seen.append(torch.get_num_threads())
        return len(seen) <= 40  # the rollout ends 10 layers into the backward (30 layers forward, then back)

    def update(fixed=None):
        state = load_trainer(model, cfg, seed=3)
        samples = agentic_samples(state.model, n_groups=2, per_group=4)
        torch.set_num_threads(fixed or 2)
        try:
            if fixed is not None:
                m = train_step(state, samples, cfg, seed=7)
            else:
                with share_cores(state.model, 1, generating) as cores:  # beside a 1-thread engine
                    assert (cores.beside, cores.alone) == (1, 2)
                    m = train_step(state, samples, cfg, seed=7)
                assert torch.get_num_threads() == 2  # all of them back
            return _weights(state.model), m, state
        finally:
            torch.set_num_threads(threads)

    shared, m, state = update()
    assert m["n_micro_batches"] == 1 and m["optimizer_steps"] == 1
    assert seen[1:41] == [1] * 40 and set(seen[41:]) == {2} and len(seen) == 60  # each layer, forward and backward
    state.model(torch.tensor([[5, 6, 7]]))
    assert len(seen) == 60  # the block is over: no hook asks any more
    for fixed in (1, 2):
        alone, m_fixed, _ = update(fixed=fixed)
        assert all(torch.equal(shared[k], alone[k]) for k in alone), fixed
        assert m_fixed["loss"] == m["loss"] and m_fixed["grad_norm"] == m["grad_norm"]


def test_kl_to_reference(tiny_model_dir):
    cfg = TrainConfig(loss={"kl_coef": 0.1}, optimizer={"learning_rate": 1e-3})
    state = load_trainer(tiny_model_dir, cfg, seed=0)
    assert state.ref_model is not None and not any(p.requires_grad for p in state.ref_model.parameters())
    samples = agentic_samples(state.model)
    m1 = train_step(state, samples, cfg, seed=0)
    assert m1["kl"] == 0.0  # the policy is the reference before its first update
    m2 = train_step(state, samples, cfg, seed=0)
    assert m2["kl"] > 0.0


def test_bf16_autocast_path_runs(tiny_model_dir):
    # the CUDA configuration (fp32 weights, bf16 backbone, fp32 head), exercised with CPU autocast
    cfg = TrainConfig(optimizer={"learning_rate": 1e-3})
    state = load_trainer(tiny_model_dir, cfg, seed=0)
    state.autocast_dtype = torch.bfloat16
    before = _weights(state.model)
    m = train_step(state, agentic_samples(state.model), cfg, seed=0)
    assert m["optimizer_steps"] == 1 and m["logprob_gap_mean"] < 0.2  # bf16 rounding on top of the 0.05 noise
    assert all(v.dtype == torch.float32 for v in state.model.state_dict().values())
    assert not torch.equal(before["lm_head.weight"], state.model.lm_head.weight)


def test_failed_or_unrewarded_samples_are_refused():
    ok = _sample([5, 6, 7], [0, 1, 1], [0.0, -1.0, -1.0], 1.0, "g", 0)
    failed = _sample([5, 6, 7], [0, 1, 1], [0.0, -1.0, -1.0], None, "g", 1, status="FAILED")
    with pytest.raises(ValueError, match="g-1 .*FAILED"):
        prepare_samples([ok, failed], TrainConfig())
    unrewarded = ok.model_copy(update={"reward": None})  # model_copy skips validation
    with pytest.raises(ValueError, match="reward None"):
        prepare_samples([unrewarded], TrainConfig())


def test_checkpoint_round_trip(tiny_model_dir, tmp_path):
    from grpoflow.embedded.engine.weights import load_safetensors_dir

    cfg = TrainConfig(optimizer={"learning_rate": 1e-2}, batch={"gradient_checkpointing": True})
    state = load_trainer(tiny_model_dir, cfg, seed=0)
    train_step(state, agentic_samples(state.model), cfg, seed=0)
    out = save_checkpoint(state.model, state.tokenizer, tmp_path / "checkpoints" / "step_1")
    assert sorted(p.name for p in out.parent.iterdir()) == ["step_1"]  # no temp dir left behind
    want = _weights(state.model)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # the engine's weight update path
    assert load_safetensors_dir(fresh, out) > 0
    assert all(torch.equal(fresh.state_dict()[k], want[k]) for k in want)
    # saving the same step again (a retried step) replaces it
    save_checkpoint(state.model, state.tokenizer, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["step_1"]
    # a dir only an engine reads, in the engine's dtype: half the bytes, the weights rounded
    half = save_checkpoint(state.model, None, tmp_path / "sync", durable=False, dtype=torch.bfloat16)
    assert (half / "model.safetensors").stat().st_size < 0.6 * (out / "model.safetensors").stat().st_size
    assert load_safetensors_dir(fresh, half) > 0
    assert all(torch.equal(fresh.state_dict()[k], want[k].to(torch.bfloat16).float()) for k in want)


def test_a_lora_checkpoint_holds_the_adapter_and_the_merged_model_the_engine_serves(tiny_model_dir, tmp_path):
    from grpoflow.embedded.engine.weights import load_safetensors_dir
    from grpoflow.train.checkpoint import restore_training_state
    from grpoflow.train.lora import has_lora

    cfg = TrainConfig(
        lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, optimizer={"learning_rate": 1e-2}
    )
    state = load_trainer(tiny_model_dir, cfg, seed=0)
    trainable = [n for n, p in state.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)  # only the adapters train
    frozen = {k: v.clone() for k, v in _weights(state.model).items() if ".lora_" not in k}
    samples = agentic_samples(state.model)
    assert train_step(state, samples, cfg, seed=0)["optimizer_steps"] == 1
    assert all(torch.equal(frozen[k], v) for k, v in _weights(state.model).items() if k in frozen)

    adapter_only = save_checkpoint(
        state.model, state.tokenizer, tmp_path / "step_0", optimizer=state.optimizer, counters={}, weights=False
    )
    assert not list(adapter_only.glob("*.safetensors")) and (adapter_only / "adapter" / "adapter_config.json").is_file()
    size = sum(f.stat().st_size for f in adapter_only.rglob("*") if f.is_file())
    merged = save_checkpoint(state.model, state.tokenizer, tmp_path / "step_1")
    assert size * 20 < sum(f.stat().st_size for f in merged.rglob("*") if f.is_file())

    ids = torch.tensor([samples[0].tokens])
    mask = torch.ones(1, ids.shape[1] - 1, dtype=torch.bool)
    with torch.no_grad():
        want, _ = token_logprobs(state.model, ids, mask)
        # the engine's path: the merged model, loaded into a plain HF model under the base model's names
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert load_safetensors_dir(plain, merged) > 0 and not has_lora(plain)
        torch.testing.assert_close(token_logprobs(plain, ids, mask)[0], want, atol=1e-5, rtol=0)
        # a resumed trainer: base weights from the model dir, the adapter and its optimizer state from the checkpoint
        fresh = load_trainer(tiny_model_dir, cfg, seed=1)
        restore_training_state(fresh, adapter_only)
        torch.testing.assert_close(token_logprobs(fresh.model, ids, mask)[0], want, atol=1e-6, rtol=0)
    assert fresh.optimizer.state_dict()["state"].keys() == state.optimizer.state_dict()["state"].keys()


def test_prune_checkpoints_keeps_full_ones_the_latest_and_the_served_one(tmp_path):
    for n in [1, 2, 3, 4, 5, 6, 7, 9]:
        (tmp_path / f"step_{n}").mkdir()
        if n % 3 == 0:  # full checkpoints: with the optimizer state
            (tmp_path / f"step_{n}" / "optimizer.pt").write_bytes(b"o")
    (tmp_path / ".step_8.tmp-123").mkdir()  # an interrupted save
    (tmp_path / "notes").mkdir()
    # step_4: what the engines serve (an engine restarted is given its weights from there)
    removed = prune_checkpoints(tmp_path, latest=7, keep=tmp_path / "step_4")
    assert sorted(p.name for p in removed) == [".step_8.tmp-123", "step_1", "step_2", "step_5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_3", "step_4", "step_6", "step_7", "step_9"]


# --- learning: reward 1 if the completion contains a target token ---------------------------------------------


def _sample_completions(model, prompt, n, new_tokens, gen):
    """Plain ancestral sampling at temperature 1: (n, new_tokens) ids and their logprobs."""
    seq = torch.tensor(prompt).repeat(n, 1)
    lps = []
    with torch.no_grad():
        for _ in range(new_tokens):
            logp = model(seq).logits[:, -1].float().log_softmax(-1)  # (n, V)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)  # (n, 1)
            lps.append(logp.gather(-1, nxt))
            seq = torch.cat([seq, nxt], 1)
    return seq[:, len(prompt) :], torch.cat(lps, 1)


@pytest.mark.parametrize(
    "variant",
    [
        {"optimizer": {"learning_rate": 3e-3, "max_grad_norm": 1.0}},
        {
            "optimizer": {"learning_rate": 3e-2, "max_grad_norm": 1.0},
            "lora": {"rank": 8, "alpha": 16},
        },  # adapters: larger lr
    ],
    ids=["full", "lora"],
)
def test_grpo_learns_to_emit_a_target_token(tiny_model_dir, variant):
    cfg = TrainConfig(**variant)
    state = load_trainer(tiny_model_dir, cfg, seed=0)
    model, tok = state.model, state.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "List the files."}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    new_tokens = 8

    def reward_rate(target, seed=123):
        comp, _ = _sample_completions(model, prompt, 256, new_tokens, torch.Generator().manual_seed(seed))
        return (comp == target).any(1).float().mean().item()

    # the target: the token most completions of the untrained model contain (still only ~4%: random weights
    # are close to uniform), so each step has a few rewarded samples to learn from
    comp, _ = _sample_completions(model, prompt, 256, new_tokens, torch.Generator().manual_seed(1))
    rates = {t: (comp == t).any(1).float().mean().item() for t in comp.unique().tolist()}
    target = max(rates, key=rates.get)
    before = reward_rate(target)

    gen = torch.Generator().manual_seed(2)
    for step in range(6):
        samples = []
        for g in range(8):
            comp, lps = _sample_completions(model, prompt, 8, new_tokens, gen)
            for i in range(8):
                toks, mask = prompt + comp[i].tolist(), [0] * len(prompt) + [1] * new_tokens
                rollout_lp = [0.0] * len(prompt) + lps[i].tolist()
                samples.append(_sample(toks, mask, rollout_lp, float(target in comp[i]), f"s{step}g{g}", i))
        m = train_step(state, samples, cfg, seed=step)
        assert m["logprob_gap_max"] < 1e-3  # the sampler and the trainer score tokens alike
    after = reward_rate(target)
    assert after > 0.5 and after > before + 0.4, (before, after)  # ~0.02 -> ~1.0 seen


def test_token_logprobs_are_taken_at_the_rollout_temperature(tmp_path):
    from transformers import AutoModelForCausalLM

    from grpoflow.train.logprobs import token_logprobs
    from tests.fakes.tiny_model import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"))
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]  # (5, V)
        for t in (0.5, 1.0, 1.7):
            got, _ = token_logprobs(model, ids, mask, temperature=t)
            want = torch.log_softmax(logits / t, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            assert torch.allclose(got[0], want, atol=1e-5)


def test_recomputed_old_logprobs_make_the_first_ratio_exactly_one_and_report_the_mismatch(tiny_model_dir):
    """With the engine's logprobs as the old policy the noise of the engine is in every ratio (clipped tokens);
    recomputed by the trainer before the update, the first minibatch's ratio is 1 and the mismatch is measured
    (and corrected) apart."""
    results = {}
    for mode in ("rollout", "recompute"):
        cfg = TrainConfig(
            optimizer={"learning_rate": 1e-3}, batch={"micro_batch_tokens": 64}, loss={"old_logprobs": mode}
        )
        state = load_trainer(tiny_model_dir, cfg, seed=3)
        samples = agentic_samples(state.model)
        for s in samples:  # an engine far off the trainer: N(0, 0.5) on every trained logprob
            noise = torch.randn(len(s.tokens), generator=torch.Generator().manual_seed(len(s.tokens))) * 0.5
            s.rollout_logprobs = [v + float(e) if m else 0.0 for v, e, m in zip(s.rollout_logprobs, noise, s.loss_mask)]
        results[mode] = train_step(state, samples, cfg, seed=7)
    rollout, recompute = results["rollout"], results["recompute"]
    assert rollout["clip_frac_low"] + rollout["clip_frac_high"] > 0.05
    assert recompute["clip_frac_low"] == recompute["clip_frac_high"] == 0.0  # one update: old == current
    assert recompute["mismatch_kl"] > 0.05 and recompute["mismatch_ratio_max"] > 2.0
    assert recompute["optimizer_steps"] == 1 and recompute["n_tokens"] == rollout["n_tokens"]


def test_a_minibatch_whose_every_token_left_the_mismatch_band_does_not_step(tiny_model_dir):
    # weight decay on: a step on the zero gradient would still shrink the weights
    cfg = TrainConfig(
        loss={"old_logprobs": "recompute", "mismatch_band": 1.5}, optimizer={"weight_decay": 0.1, "learning_rate": 1e-2}
    )
    state = load_trainer(tiny_model_dir, cfg, seed=0)
    samples = agentic_samples(state.model)
    for s in samples:  # an engine 1 nat off on every trained token: exp(1) > 1.5, all outside the band
        s.rollout_logprobs = [v - 1.0 if m else 0.0 for v, m in zip(s.rollout_logprobs, s.loss_mask, strict=True)]
    before = _weights(state.model)
    m = train_step(state, samples, cfg, seed=0)
    assert (m["optimizer_steps"], m["skipped_masked"], m["mismatch_masked_frac"]) == (0, 1, 1.0)
    assert all(torch.equal(before[k], v) for k, v in _weights(state.model).items())


def _turns(*lengths, reward=0.0, status="COMPLETED", group="g", i=0):
    mask = [0] * 3
    for n in lengths:
        mask += [1] * n + [0] * 2
    return _sample(list(range(3, 3 + len(mask))), mask, [-0.5 * m for m in mask], reward, group, i, status)


def test_over_long_samples_are_trained_masked_or_penalized_as_configured():
    from grpoflow.config import parse_run_config
    from grpoflow.train.step import prepare_samples, shape_overlong

    cut = _turns(5, 16, status="TRUNCATED", i=0)  # its second turn hit max_new_tokens = 16
    near = _turns(14, reward=1.0, i=1)  # 2 tokens into the soft band of 4
    short = _turns(6, reward=1.0, i=2)

    def cfg(mode):
        return parse_run_config(
            {"rollout": {"sampling": {"max_new_tokens": 16}}, "train": {"loss": {"truncated": mode}}}
        )

    same, extra = shape_overlong([cut, near, short], cfg("train"))
    assert same == [cut, near, short] and extra == {}

    masked, extra = shape_overlong([cut, near, short], cfg("mask"))
    assert sum(masked[0].loss_mask) == 0 and masked[1:] == [near, short] and extra == {"truncated_masked": 1.0}
    assert sum(cut.loss_mask) > 0  # a copy: the journaled sample keeps its mask
    kept, adv, _ = prepare_samples(masked, cfg("mask").train)
    assert [s.sample_index for s in kept] == [1, 2]  # not trained, but its reward 0 still counts in the group
    # (1 - 2/3) / std(0, 1, 1) = 1/sqrt(2); without the masked reward the group (1, 1) would carry no signal
    assert adv.tolist() == pytest.approx([2**-0.5] * 2, rel=1e-4)

    penalized, extra = shape_overlong([cut, near, short], cfg("penalize"))
    assert [s.reward for s in penalized] == [-1.0, 0.5, 1.0]  # cache 16 // 4 = 4: 16 -> -1, 14 -> -0.5
    assert extra["overlong_penalty_mean"] == pytest.approx(-0.5)


def test_a_model_whose_logits_are_not_its_lm_head_is_refused_at_load(tiny_model_dir, monkeypatch):
    from grpoflow.train import trainer as trainer_mod

    real = trainer_mod.AutoModelForCausalLM.from_pretrained

    def scaled(*args, **kwargs):  # a logit multiplier the attribute check does not know
        model = real(*args, **kwargs)
        model.register_forward_hook(lambda mod, inp, out: out.__setitem__("logits", out["logits"] * 1.5) or out)
        return model

    monkeypatch.setattr(trainer_mod.AutoModelForCausalLM, "from_pretrained", scaled)
    with pytest.raises(NotImplementedError, match=r"its logits are not the LM head of its last hidden state"):
        load_trainer(tiny_model_dir, TrainConfig(), seed=0)


def test_the_segments_of_a_rollout_share_one_overlong_penalty():
    from grpoflow.config import parse_run_config
    from grpoflow.train.step import prepare_samples, shape_overlong

    first = _turns(16, 4, i=0)  # a compacted trial: its segments train different turns, one of them hit the limit
    second = _turns(4, i=0).model_copy(update={"segment_index": 1})
    other = _turns(4, reward=1.0, i=1)
    cfg = parse_run_config(
        {"rollout": {"sampling": {"max_new_tokens": 16}}, "train": {"loss": {"truncated": "penalize"}}}
    )
    shaped, extra = shape_overlong([first, second, other], cfg)
    assert [s.reward for s in shaped] == [-1.0, -1.0, 1.0] and extra["overlong_penalty_mean"] == -0.5
    prepare_samples(shaped, cfg.train)  # one reward per rollout: its segments' rewards agree


def test_an_engines_copy_of_the_adapter_is_in_its_dtype(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from grpoflow.train.lora import save_adapter

    state = load_trainer(tiny_model_dir, TrainConfig(lora={"rank": 4}), seed=0)
    save_adapter(state.model, tmp_path / "sglang", torch.bfloat16)  # what an adapter sync writes for SGLang
    save_adapter(state.model, tmp_path / "checkpoint")
    half, full = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("sglang", "checkpoint"))
    assert {t.dtype for t in half.values()} == {torch.bfloat16} and {t.dtype for t in full.values()} == {torch.float32}
    assert half.keys() == full.keys()


def test_an_update_without_samples_keeps_the_weights_and_reports_every_metric(tiny_model_dir):
    """A step whose every group was dropped: no optimizer step, and the same metric columns as any other step,
    so metrics.jsonl and the plots keep steady columns."""
    from grpoflow.train.step import grpo_update

    cfg = RunConfig(train={"weight_decay": 0.1})
    state = load_trainer(tiny_model_dir, cfg.train, seed=0)
    full = grpo_update(state, agentic_samples(state.model), cfg, step=0)
    before = _weights(state.model)
    empty = grpo_update(state, [], cfg, step=1)
    assert set(empty.computed) == set(full.computed) and set(empty.seconds) == set(full.seconds)
    assert empty.computed["n_samples"] == 0 and empty.computed["optimizer_steps"] == 0
    assert all(torch.equal(before[k], v) for k, v in _weights(state.model).items())
