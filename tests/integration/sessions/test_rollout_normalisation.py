"""GRPO and the loss with a rollout split into segments: one slot in the group, one sample's weight."""

from __future__ import annotations

import pytest
import torch

from grpoflow.config import LossConfig
from grpoflow.samples import Sample
from grpoflow.train.grpo import LossInputs, group_advantages, policy_loss
from grpoflow.train.step import _rollout_minibatches


def test_group_statistics_count_a_rollout_once_whatever_its_segments():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5])
    groups = ["g"] * 5
    rollouts = ["a", "a", "a", "b", "c"]
    adv = group_advantages(rewards, groups, scale_by_std=False, rollout_ids=rollouts)
    assert adv.tolist() == pytest.approx([0.5, 0.5, 0.5, -0.5, 0.0])  # the mean over 3 rollouts is 0.5
    per_row = group_advantages(rewards, groups, scale_by_std=False)
    assert per_row[0].item() == pytest.approx(1.0 - 3.5 / 5)  # what counting segments would have given
    std = group_advantages(rewards, groups, scale_by_std=True, eps=0.0, rollout_ids=rollouts)
    u = torch.tensor([1.0, 0.0, 0.5])
    assert std[:4].tolist() == pytest.approx([((1 - 0.5) / u.std(correction=0)).item()] * 3 + [-1.2247449], rel=1e-5)
    with pytest.raises(ValueError, match="different rewards"):
        group_advantages(torch.tensor([1.0, 0.0, 0.5]), ["g"] * 3, True, rollout_ids=["a", "a", "b"])


def test_sample_aggregation_weighs_a_segmented_rollout_as_one_sample():
    """Rollout A split into two rows (3 + 2 trained tokens) gives the loss and gradient of A as one row."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, generator=g) - 1.0
    b = torch.randn(4, generator=g) - 1.0
    old_a, old_b = a + 0.1 * torch.randn(5, generator=g), b + 0.1 * torch.randn(4, generator=g)

    def run(rows_lp, rows_old, masks, adv, **kw):
        lp = rows_lp.clone().requires_grad_(True)
        cfg = LossConfig(eps_low=0.2, eps_high=0.28, loss_aggregation="sample", dual_clip=None, tis_cap=None)
        loss, _ = policy_loss(LossInputs(lp, rows_old, adv, masks, **kw), cfg)
        loss.backward()
        return loss.item(), lp.grad

    # merged: A as one row of 5, B as one row of 4 (padded to 5)
    lp_m = torch.stack([a, torch.cat([b, torch.zeros(1)])])
    old_m = torch.stack([old_a, torch.cat([old_b, torch.zeros(1)])])
    mask_m = torch.tensor([[1] * 5, [1] * 4 + [0]])
    loss_m, grad_m = run(lp_m, old_m, mask_m, torch.tensor([0.7, -0.7]))
    # segmented: A's first 3 tokens, A's last 2, B
    lp_s = torch.stack([torch.cat([a[:3], torch.zeros(2)]), torch.cat([a[3:], torch.zeros(3)]), lp_m[1]])
    old_s = torch.stack([torch.cat([old_a[:3], torch.zeros(2)]), torch.cat([old_a[3:], torch.zeros(3)]), old_m[1]])
    mask_s = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    adv_s = torch.tensor([0.7, 0.7, -0.7])
    loss_s, grad_s = run(lp_s, old_s, mask_s, adv_s, sample_tokens=torch.tensor([5, 5, 4]), denominator=2)
    assert loss_s == pytest.approx(loss_m, rel=1e-5)  # float32 sums in another order
    torch.testing.assert_close(torch.cat([grad_s[0, :3], grad_s[1, :2]]), grad_m[0])
    # counted per row (the old behaviour) the segmented rollout would weigh twice
    loss_rows, _ = run(lp_s, old_s, mask_s, adv_s)
    assert loss_rows != pytest.approx(loss_m, rel=1e-3)


def _s(rollout: str) -> Sample:
    return Sample(
        run_id="r",
        step=0,
        instance_id="t",
        group_id="g",
        sample_index=0,
        rollout_id=rollout,
        tokens=[1, 2],
        loss_mask=[0, 1],
        rollout_logprobs=[0.0, -1.0],
        prompt_len=1,
        reward=1.0,
        status="COMPLETED",
        exit_status="Submitted",
    )


def test_minibatches_keep_a_rollouts_segments_together_and_count_rollouts():
    kept = [_s(r) for r in ["a", "b", "a", "c", "b", "d"]]
    batches = _rollout_minibatches(kept, 2, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert len(batches) == 2  # 4 rollouts, 2 per minibatch
    for b in batches:
        assert len({kept[i].rollout_id for i in b}) == 2
        for i in b:  # every segment of a rollout in the batch is in the batch
            assert all(j in b for j, s in enumerate(kept) if s.rollout_id == kept[i].rollout_id)
    # one sample per rollout: the seeded permutation the trainer always used
    single = [_s(str(i)) for i in range(5)]
    want = torch.randperm(5, generator=torch.Generator().manual_seed(3)).tolist()
    assert _rollout_minibatches(single, None, seed=3) == [want]


@pytest.mark.parametrize("aggregation", ["token", "sample"])
def test_train_step_trains_each_generated_token_of_a_segmented_rollout_once(tiny_model_dir, aggregation):
    from grpoflow.config import TrainConfig
    from grpoflow.rollout.sessions.segments import segment_samples
    from grpoflow.rollout.sessions.tree import SessionTree
    from grpoflow.train.step import train_step
    from grpoflow.train.trainer import load_trainer

    tree = SessionTree("a")
    turns = [
        ([5, 6, 7], [10, 11, 12]),
        ([5, 6, 7, 10, 11, 12, 8], [13]),
        ([5, 6, 7, 10, 11, 12, 9], [14, 15]),
        ([5, 20], [16, 17]),
    ]
    for prompt, out in turns:
        tree.add_turn(
            [{"role": "user", "content": str(prompt)}],
            prompt,
            out,
            [-2.0] * len(out),
            reply="",
            finish_reason="stop",
            truncated=False,
            extends=None,
            retokenize_mismatch=False,
            first_mismatch=None,
            weight_version=None,
            generation_time_s=0.0,
        )
    segs = segment_samples(_s("a"), tree)
    assert len(segs) == 3
    other = _s("b").model_copy(
        update={"reward": 0.0, "tokens": [5, 6, 30], "loss_mask": [0, 0, 1], "rollout_logprobs": [0.0, 0.0, -2.0]}
    )
    cfg = TrainConfig(loss={"loss_aggregation": aggregation}, batch={"global_batch_size": 1, "micro_batch_tokens": 64})
    state = load_trainer(tiny_model_dir, cfg, seed=0, device="cpu")
    out = train_step(state, segs + [other], cfg, seed=0)
    assert out["optimizer_steps"] == 2  # 2 rollouts, one per minibatch: the 3 segments travel together
    assert out["n_samples"] == 4
    assert out["n_tokens"] == 3 + 1 + 2 + 2 + 1  # each generated token once
