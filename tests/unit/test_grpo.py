"""GRPO math against hand-computed values."""

import math

import pytest
import torch

from grpoflow.config import LossConfig
from grpoflow.train.grpo import LossInputs, group_advantages, policy_loss, zero_std_groups

EPS_LOW, EPS_HIGH = 0.2, 0.28


def test_group_advantages_with_and_without_std():
    # groups interleaved on purpose: a = [1, 0, 0, 1], b = [2, 2], c = [0, 3, 3]
    gids = ["a", "c", "a", "b", "a", "c", "b", "a", "c"]
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 0.0, 3.0, 2.0, 1.0, 3.0])
    # a: mean 0.5, population std 0.5; b: all equal -> 0; c: mean 2, deviations (-2, 1, 1), std sqrt(2)
    s2 = math.sqrt(2)
    want_std = [1.0, -2 / s2, -1.0, 0.0, -1.0, 1 / s2, 0.0, 1.0, 1 / s2]
    got = group_advantages(r, gids, scale_by_std=True, eps=0.0)
    torch.testing.assert_close(got, torch.tensor(want_std))
    want_drgrpo = [0.5, -2.0, -0.5, 0.0, -0.5, 1.0, 0.0, 0.5, 1.0]
    torch.testing.assert_close(group_advantages(r, gids, scale_by_std=False), torch.tensor(want_drgrpo))
    # eps sits in the denominator: (r - mean) / (std + eps)
    got_eps = group_advantages(r, gids, scale_by_std=True, eps=0.5)
    assert got_eps[0].item() == pytest.approx(0.5 / (0.5 + 0.5))


def test_equal_rewards_give_exact_zero_and_are_reported():
    # 0.1 * 3 / 3 != 0.1 in floating point: the advantage must still be exactly 0, not a residue
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.7])
    gids = ["x", "x", "x", "y", "y", "z"]
    adv = group_advantages(r, gids, scale_by_std=True)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[5].item() == 0.0  # a group of one carries no signal
    assert zero_std_groups(r, gids) == ["x", "z"]


LOSS_SETTINGS = ("kl_coef", "dual_clip", "tis_cap", "mismatch_band")


def _loss(lp, old, adv, mask, agg="token", **kw):
    """The loss with the clip range above, no correction unless given (`kw`: LossInputs fields and settings)."""
    # the loss reads the behaviour logprobs it is given; `recompute` only lets the config name the corrections
    settings = {"dual_clip": None, "tis_cap": None, "old_logprobs": "recompute"}
    settings |= {k: kw.pop(k) for k in LOSS_SETTINGS if k in kw}
    cfg = LossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH, loss_aggregation=agg, **settings)
    return policy_loss(LossInputs(lp, old, adv, mask, **kw), cfg)


def test_clipping_both_sides_removes_the_gradient():
    # one token per sample: (A, ratio) = (+1, 1.5) clipped high, (-1, 0.5) clipped low,
    # (+1, 0.5) and (-1, 1.5) not clipped (the pessimistic min keeps the unclipped term)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    lp = torch.log(torch.tensor([[1.5], [0.5], [0.5], [1.5]])).requires_grad_()
    old = torch.zeros(4, 1)
    loss, m = _loss(lp, old, adv, torch.ones(4, 1), denominator=1.0)  # sum, to read per-token terms
    # per-token losses: -min(1.5, 1.28) = -1.28; -min(-0.5, -0.8) = 0.8; -min(0.5, 0.8) = -0.5; 1.5
    assert loss.item() == pytest.approx(-1.28 + 0.8 - 0.5 + 1.5)
    loss.backward()
    # d(-ratio * A)/d lp = -ratio * A where unclipped, 0 where clipped
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0], [0.0], [-0.5], [1.5]]))
    assert m["clip_frac_high"].item() == pytest.approx(0.25)
    assert m["clip_frac_low"].item() == pytest.approx(0.25)
    assert m["logprob_gap_max"].item() == pytest.approx(math.log(2))


def test_masked_positions_change_nothing():
    torch.manual_seed(0)
    lp = torch.randn(3, 5) * 0.1 - 2
    old = lp + torch.randn(3, 5) * 0.05
    ref = lp + torch.randn(3, 5) * 0.05
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0])

    def run(lp_in, old_in):
        x = lp_in.clone().requires_grad_()
        loss, m = _loss(x, old_in, adv, mask, "sample", ref_logprobs=ref, kl_coef=0.1)
        loss.backward()
        return loss.detach(), x.grad, m

    base = run(lp, old)
    # garbage (even inf) in masked-out positions of the current and old logprobs
    lp2, old2 = lp.clone(), old.clone()
    lp2[~mask] = 100.0
    old2[~mask] = -float("inf")
    other = run(lp2, old2)
    assert torch.equal(base[0], other[0])
    assert torch.equal(base[1], other[1])
    assert (base[1][~mask] == 0).all()
    for k in base[2]:
        assert torch.equal(base[2][k], other[2][k]), k


def test_token_and_sample_aggregation_with_unequal_lengths():
    # sample 0: 2 tokens, A = 2, ratios (1.0, 1.1) -> per-token losses (-2.0, -2.2)
    # sample 1: 3 tokens, A = -1, ratios (0.9, 1.0, 1.2) -> (0.9, 1.0, 1.2) (all inside the clip range)
    ratios = torch.tensor([[1.0, 1.1, 1.0, 1.0], [1.0, 0.9, 1.0, 1.2]])
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)
    lp, old = ratios.log(), torch.zeros(2, 4)
    adv = torch.tensor([2.0, -1.0])
    token, _ = _loss(lp, old, adv, mask, "token")
    assert token.item() == pytest.approx((-2.0 - 2.2 + 0.9 + 1.0 + 1.2) / 5)
    sample, _ = _loss(lp, old, adv, mask, "sample")
    assert sample.item() == pytest.approx(((-2.0 - 2.2) / 2 + (0.9 + 1.0 + 1.2) / 3) / 2)
    # a global denominator replaces the local count (micro-batching)
    token_g, _ = _loss(lp, old, adv, mask, "token", denominator=10)
    assert token_g.item() == pytest.approx((-2.0 - 2.2 + 0.9 + 1.0 + 1.2) / 10)


def test_k3_kl_value():
    # ref - lp = log 2 -> k3 = 2 - log 2 - 1; ratio 1 and A = 0 leave only the KL term
    lp = torch.tensor([[-1.0]])
    ref = lp + math.log(2)
    loss, m = _loss(lp, lp.clone(), torch.zeros(1), torch.ones(1, 1), ref_logprobs=ref, kl_coef=0.5)
    k3 = 2 - math.log(2) - 1
    assert m["kl"].item() == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.5 * k3)
    # and 0 when the policy is the reference
    _, m0 = _loss(lp, lp.clone(), torch.zeros(1), torch.ones(1, 1), ref_logprobs=lp.clone(), kl_coef=0.5)
    assert m0["kl"].item() == 0.0


def _grad(lp, old, adv, **kw):
    lp = lp.clone().requires_grad_(True)
    loss, m = _loss(lp, old, adv, torch.ones_like(lp, dtype=torch.bool), **kw)
    loss.backward()
    return lp.grad, m


def test_one_mismatched_token_with_a_negative_advantage_cannot_set_the_step_direction():
    # token 0: the engine gave it logprob -10 where the trainer says 0 (ratio e^10); A = -1
    lp, old, adv = torch.tensor([[0.0, -1.0]]), torch.tensor([[-10.0, -1.0]]), torch.tensor([-1.0])
    unbounded, _ = _grad(lp, old, adv)
    assert unbounded[0, 0].item() == pytest.approx(math.exp(10) / 2)  # |A| r / tokens: the whole step's direction
    bounded, m = _grad(lp, old, adv, dual_clip=3.0)
    assert bounded[0, 0].item() == 0.0 and bounded[0, 1].item() == pytest.approx(0.5)  # the other token trains
    assert m["dual_clip_frac"].item() == 0.5 and m["mismatch_ratio_max"].item() == pytest.approx(math.exp(10))
    # a positive advantage is untouched by the dual clip (the PPO clip already bounds it)
    pos, _ = _grad(torch.tensor([[0.0]]), torch.tensor([[-0.1]]), torch.tensor([1.0]), dual_clip=3.0)
    assert pos[0, 0].item() == pytest.approx(-math.exp(0.1))


def test_recomputed_old_logprobs_weight_each_token_by_its_capped_behaviour_ratio():
    # the trainer's old = current (ratio 1); the engine sampled token 0 at logprob -3 and token 1 at -1.2
    lp, behaviour, adv = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-3.0, -1.2]]), torch.tensor([1.0])
    g, m = _grad(lp, lp.clone(), adv, behaviour_logprobs=behaviour, tis_cap=2.0)
    torch.testing.assert_close(g, torch.tensor([[-2.0 / 2, -math.exp(0.2) / 2]]))  # weights min(e^2, 2), e^0.2
    assert m["mismatch_ratio_max"].item() == pytest.approx(math.exp(2.0))
    d = torch.tensor([2.0, 0.2])
    assert m["mismatch_kl"].item() == pytest.approx(((d.exp() - 1 - d).sum() / 2).item())


def test_tokens_outside_the_mismatch_band_leave_the_loss_and_are_counted():
    lp, behaviour, adv = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-3.0, -1.2]]), torch.tensor([1.0])
    g, m = _grad(lp, lp.clone(), adv, behaviour_logprobs=behaviour, mismatch_band=2.0)
    assert g[0, 0].item() == 0.0 and g[0, 1].item() == pytest.approx(-1.0)  # the kept token is the whole mean
    assert m["mismatch_masked_frac"].item() == 0.5 and m["n_tokens"].item() == 1


def test_an_asymmetric_band_keeps_what_lies_between_its_own_bounds():
    """IcePop's [0.5, 5]: ratios (old / behaviour) 0.4 and 6 leave, 0.6 and 4 stay; the symmetric band 5 would
    keep 0.4 and a symmetric 2 would drop 4."""
    lp = torch.full((1, 4), -1.0)
    behaviour = lp - torch.log(torch.tensor([[0.4, 0.6, 4.0, 6.0]]))
    g, m = _grad(lp, lp.clone(), torch.tensor([1.0]), behaviour_logprobs=behaviour, mismatch_band=(0.5, 5.0))
    assert [x != 0.0 for x in g[0].tolist()] == [False, True, True, False]
    assert m["mismatch_masked_frac"].item() == 0.5 and m["n_tokens"].item() == 2


def test_a_reference_far_from_the_policy_gives_a_finite_bounded_kl():
    lp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[100.0, -1.0]])  # exp(100) is inf in fp32: the uncapped k3 made the loss inf
    loss, m = _loss(
        lp, lp.detach().clone(), torch.tensor([0.0]), torch.ones(1, 2, dtype=torch.bool), ref_logprobs=ref, kl_coef=0.1
    )
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all()
    assert m["kl"].item() == pytest.approx(10.0 / 2)  # capped at 10 per token, averaged over 2
