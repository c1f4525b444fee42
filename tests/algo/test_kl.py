"""KL estimators: hand values, float64 reference, and which gradient each gives as a loss term."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algo import kl_penalty, kl_shaped_rewards
from tests.algo import reference as ref


def test_hand_values_and_k3_gradient():
    logp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    ref_logp = torch.full((2, 3), -1.5, dtype=torch.float64)
    # log_ratio = ref - logp = -0.5
    torch.testing.assert_close(kl_penalty(logp, ref_logp, "k1"), torch.full((2, 3), 0.5, dtype=torch.float64))
    torch.testing.assert_close(
        kl_penalty(logp, ref_logp, "k2"), torch.full((2, 3), 0.125, dtype=torch.float64)
    )
    k3 = kl_penalty(logp, ref_logp, "k3")  # e^-0.5 + 0.5 - 1
    torch.testing.assert_close(k3, torch.full((2, 3), 0.10653065971263342, dtype=torch.float64))
    k3.sum().backward()
    # d k3 / d logp = 1 - pi_ref / pi_theta = 1 - e^-0.5
    torch.testing.assert_close(logp.grad, torch.full((2, 3), 0.3934693402873666, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_and_signs(kind, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 6
    ref_logp = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 6
    got = kl_penalty(logp, ref_logp, kind)
    expected = [
        [ref.kl(a, b, kind) for a, b in zip(ra, rb, strict=True)]
        for ra, rb in zip(logp.tolist(), ref_logp.tolist(), strict=True)
    ]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    if kind != "k1":
        assert (got >= 0).all()


def test_k3_is_accurate_near_zero():
    # exp(x) - x - 1 loses every digit at x = 1e-9 in float32; expm1 keeps them (value ~ x^2 / 2)
    logp = torch.zeros(1, 1)
    ref_logp = torch.full((1, 1), 1e-3)
    torch.testing.assert_close(
        kl_penalty(logp, ref_logp, "k3"), torch.full((1, 1), 5.001667e-7), rtol=1e-4, atol=0
    )


def test_ref_is_treated_as_constant():
    logp = torch.zeros(1, 2, requires_grad=True)
    ref_logp = torch.full((1, 2), -0.3, requires_grad=True)
    kl_penalty(logp, ref_logp).sum().backward()
    assert ref_logp.grad is None


def _expected_gradient(kind: str, theta: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """E_{x ~ pi_theta}[grad_theta k(x)] computed exactly over a small vocabulary (on-policy)."""
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    ref_logp = torch.log_softmax(ref_logits, -1)
    weights = logp.detach().exp()  # sampling distribution: constant, as in the loss term
    (weights * kl_penalty(logp, ref_logp, kind)).sum().backward()
    return theta.grad


def _true_gradient(theta: torch.Tensor, ref_logits: torch.Tensor, direction: str) -> torch.Tensor:
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    ref_logp = torch.log_softmax(ref_logits, -1)
    if direction == "reverse":  # KL(pi_theta || pi_ref)
        value = (logp.exp() * (logp - ref_logp)).sum()
    else:  # KL(pi_ref || pi_theta)
        value = (ref_logp.exp() * (ref_logp - logp)).sum()
    value.backward()
    return theta.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradients_as_loss_terms_match_docs(seed):
    """docs/algorithms.md: on-policy, k1's expected gradient is 0, k2's is the reverse-KL gradient,
    k3's is the forward-KL(ref || pi) gradient, not the reverse-KL one."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(7, generator=g, dtype=torch.float64)
    ref_logits = torch.randn(7, generator=g, dtype=torch.float64)
    reverse = _true_gradient(theta, ref_logits, "reverse")
    forward = _true_gradient(theta, ref_logits, "forward")

    torch.testing.assert_close(
        _expected_gradient("k1", theta, ref_logits), torch.zeros(7, dtype=torch.float64)
    )
    torch.testing.assert_close(_expected_gradient("k2", theta, ref_logits), reverse)
    k3 = _expected_gradient("k3", theta, ref_logits)
    torch.testing.assert_close(k3, forward)
    assert (k3 - reverse).abs().max() > 1e-3


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(2, 3), torch.zeros(3, 2), "k3"), "must have one shape"),
        ((torch.zeros(2), torch.zeros(2), "k4"), "kind must be one of"),
    ],
)
def test_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        kl_penalty(*args)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_shaped_rewards_match_reference_with_padding(kind):
    g = torch.Generator().manual_seed(7)
    B, T = 6, 9
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ref_logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lengths = torch.tensor([9, 1, 4, 0, 7, 3])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp[~mask] = float("-inf")  # padding must never leak into the sum
    ref_logp[~mask] = 5.0
    rewards = torch.randn(B, generator=g, dtype=torch.float64)
    got = kl_shaped_rewards(rewards, logp, ref_logp, mask, 0.3, kind)
    want = ref.kl_shaped_rewards(rewards.tolist(), logp.tolist(), ref_logp.tolist(), mask.tolist(), 0.3, kind)
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert got[3] == rewards[3]  # an empty completion keeps its reward


def test_kl_shaped_rewards_hand_value():
    # one sequence, tokens (logp, ref) = (-1, -1.5) and (-2, -2): k1 = 0.5 + 0, beta 0.1 -> r - 0.05
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref_logp = torch.tensor([[-1.5, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True]])
    out = kl_shaped_rewards(torch.tensor([1.0], dtype=torch.float64), logp, ref_logp, mask, 0.1, "k1")
    assert out.item() == pytest.approx(0.95, abs=1e-15)
    k3 = kl_shaped_rewards(torch.tensor([1.0], dtype=torch.float64), logp, ref_logp, mask, 0.1, "k3")
    assert k3.item() == pytest.approx(1.0 - 0.1 * (math.exp(-0.5) - 0.5), abs=1e-15)
