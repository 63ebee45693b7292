"""GRPO advantages and the PPO-clip loss (pure torch)."""

import pytest
import torch

from disagg.trainer.grpo import group_advantages, ppo_clip_loss, token_logprobs


def test_advantages_are_normalised_within_each_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.4, 0.6, 0.8], [0.5, 0.5, 0.5, 0.5]])
    a = group_advantages(r, eps=0.0 + 1e-12)
    assert torch.allclose(a.mean(dim=1), torch.zeros(3), atol=1e-6)
    assert torch.allclose(a[:2].std(dim=1, unbiased=False), torch.ones(2), atol=1e-5)
    assert torch.equal(a[2], torch.zeros(4))  # no signal in a flat group
    assert a[0, 0] > 0 > a[0, 1]
    # Each group is normalised on its own: the second group's ordering is kept.
    assert torch.all(a[1, 1:] > a[1, :-1])


def test_advantages_without_std_scaling_are_centred_rewards():
    r = torch.tensor([[3.0, 1.0]])
    assert torch.equal(group_advantages(r, scale_by_std=False), torch.tensor([[1.0, -1.0]]))


def test_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.tensor([[1.0], [2.0]]))


def _loss_grad(logp, old, adv, clip=0.2):
    logp = logp.clone().requires_grad_(True)
    mask = torch.ones_like(logp)
    out = ppo_clip_loss(logp, old, adv, mask, clip, normaliser=logp.numel())
    out.loss.backward()
    return out, logp.grad


def test_on_policy_gradient_raises_logp_of_positive_advantage_tokens():
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    out, g = _loss_grad(logp, logp.detach(), torch.tensor([1.0, -1.0]))
    # Descending the loss increases logp where advantage > 0, decreases where < 0.
    assert torch.all(g[0] < 0) and torch.all(g[1] > 0)
    assert out.clip_frac.item() == 0
    assert out.ratio_sum.item() == pytest.approx(4.0)
    # On-policy PPO loss equals -mean(advantage) over tokens.
    assert out.loss.item() == pytest.approx(0.0)


def test_clipped_tokens_get_no_gradient():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.8, 0.55]]))  # ratio 1.6 (clipped) and 1.1 (not)
    out, g = _loss_grad(logp, old, torch.tensor([1.0]))
    assert g[0, 0].item() == 0.0 and g[0, 1].item() < 0
    assert out.clip_frac.item() == 1.0


def test_negative_advantage_clip_uses_the_pessimistic_bound():
    old = torch.log(torch.tensor([[0.5]]))
    logp = torch.log(torch.tensor([[0.2]]))  # ratio 0.4 < 1 - eps with A < 0: clipped, no gradient
    _, g = _loss_grad(logp, old, torch.tensor([-1.0]))
    assert g.item() == 0.0
    logp = torch.log(torch.tensor([[0.9]]))  # ratio 1.8 with A < 0: unclipped term is the min, gradient flows
    _, g = _loss_grad(logp, old, torch.tensor([-1.0]))
    assert g.item() > 0


def test_mask_and_normaliser():
    logp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([2.0]), mask, 0.2, normaliser=4.0)
    assert out.loss.item() == pytest.approx(-2.0 * 2 / 4)
    assert out.num_tokens.item() == 2
    out.loss.backward()
    assert logp.grad[0, 2].item() == 0.0


def test_kl_penalty_is_zero_at_the_reference_and_positive_away_from_it():
    logp = torch.log(torch.tensor([[0.3, 0.6]]))
    mask = torch.ones_like(logp)
    same = ppo_clip_loss(logp, logp, torch.tensor([0.0]), mask, 0.2, 2.0, ref_logp=logp, kl_coef=1.0)
    assert same.kl_ref_sum.item() == pytest.approx(0.0, abs=1e-7)
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    away = ppo_clip_loss(logp, logp, torch.tensor([0.0]), mask, 0.2, 2.0, ref_logp=ref, kl_coef=1.0)
    assert away.kl_ref_sum.item() > 0 and away.loss.item() > 0


def test_token_logprobs_apply_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    t = torch.tensor([[0]])
    hot = token_logprobs(logits, t, 2.0)
    assert hot.item() == pytest.approx(torch.log_softmax(torch.tensor([1.0, 0.0]), 0)[0].item())


def test_tis_gradient_is_the_truncated_importance_weighted_policy_gradient() -> None:
    torch.manual_seed(0)
    behaviour = torch.log(torch.rand(2, 4) * 0.5 + 0.1)
    logp = (behaviour + torch.tensor([[-1.0, 0.0, 0.5, 2.0], [0.1, -0.3, 1.5, 0.0]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([1.5, -0.5])
    cap = 2.0
    out = ppo_clip_loss(logp, behaviour, adv, mask, 0.2, normaliser=7.0, mode="tis", is_cap=cap)
    out.loss.backward()
    weight = torch.clamp(torch.exp(logp.detach() - behaviour), max=cap)
    expected = -weight * adv[:, None] * mask / 7.0
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    # Truncated weights are counted: exp(2.0) and exp(1.5) exceed the cap of 2.
    assert out.clip_frac.item() == 2.0


def test_decoupled_ppo_weights_by_proximal_over_behaviour_and_clips_to_the_proximal_policy() -> None:
    behaviour = torch.log(torch.tensor([[0.2, 0.4, 0.3]]))
    prox = torch.log(torch.tensor([[0.3, 0.2, 0.3]]))  # the policy before this update
    mask = torch.ones(1, 3)
    adv = torch.tensor([1.0])
    # First mini-batch: current == proximal, so r = 1 and the gradient is -w * A per token.
    logp = prox.clone().requires_grad_(True)
    ppo_clip_loss(logp, behaviour, adv, mask, 0.2, 3.0, mode="decoupled", proximal_logp=prox, is_cap=1.2).loss.backward()
    w = torch.clamp(torch.exp(prox - behaviour), max=1.2)  # 1.5 -> 1.2 (truncated), 0.5, 1.0
    assert torch.allclose(logp.grad, -w * adv / 3.0, atol=1e-6)
    # Later mini-batch: a token whose ratio to the proximal policy left the clip range
    # with a positive advantage gets no gradient; the others keep theirs.
    logp2 = (prox + torch.tensor([[0.5, 0.0, -0.5]])).requires_grad_(True)
    out = ppo_clip_loss(logp2, behaviour, adv, mask, 0.2, 3.0, mode="decoupled", proximal_logp=prox, is_cap=1.2)
    out.loss.backward()
    assert logp2.grad[0, 0].item() == 0.0
    assert logp2.grad[0, 1].item() < 0 and logp2.grad[0, 2].item() < 0
    assert out.clip_frac.item() == 2.0  # r = e^0.5 and e^-0.5 are both outside [0.8, 1.2]


def test_decoupled_needs_the_proximal_policy_and_unknown_modes_fail() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="proximal"):
        ppo_clip_loss(x, x, torch.zeros(1), torch.ones(1, 2), 0.2, 1.0, mode="decoupled")
    with pytest.raises(ValueError, match="off_policy"):
        ppo_clip_loss(x, x, torch.zeros(1), torch.ones(1, 2), 0.2, 1.0, mode="vtrace")


def test_mismatch_stats_measure_the_engine_trainer_gap_over_masked_tokens_only():
    from disagg.trainer.grpo import mismatch_stats, mismatch_summary

    trainer = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.1, -0.2, 0.0, 0.0]])
    engine = torch.tensor([[-1.1, -2.0, -2.0, 0.0], [-0.1, -0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # the -9 vs 0 token is padding: not counted
    s = mismatch_stats(trainer, engine, mask, is_cap=2.0)
    assert s.num_tokens == 5
    assert s.abs_sum == pytest.approx(0.1 + 0.0 + 1.5 + 0.0 + 0.1)
    assert s.abs_max == pytest.approx(1.5)
    assert s.over_cap == 1  # exp(-0.5 - -2.0) = 4.5 > 2; exp(0.1) is not
    exact = mismatch_stats(trainer, trainer.clone(), mask, is_cap=2.0)
    assert (exact.abs_sum, exact.abs_max, exact.over_cap) == (0.0, 0.0, 0.0)
    # two ranks' sums make one step's figures; a step with no tokens measured has none
    outs = [{"mismatch_abs_sum": s.abs_sum, "mismatch_abs_max": s.abs_max, "mismatch_over_cap": s.over_cap,
             "mismatch_tokens": s.num_tokens},
            {"mismatch_abs_sum": 0.3, "mismatch_abs_max": 0.3, "mismatch_over_cap": 0.0, "mismatch_tokens": 1.0}]
    got = mismatch_summary(outs)
    assert got["logprob_mismatch_mean"] == pytest.approx((1.7 + 0.3) / 6)
    assert got["logprob_mismatch_max"] == pytest.approx(1.5)
    assert got["is_over_cap_frac"] == pytest.approx(1 / 6)
    assert mismatch_summary([{**outs[1], "mismatch_tokens": 0.0}]) == {}
