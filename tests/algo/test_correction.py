"""Rollout-training mismatch: the statistics and the TIS / Seq-MIS weights against float64
references (tests/algo/reference.py), and the weights reaching the loss."""

from __future__ import annotations

import pytest
import torch

from grpokit.algo import policy_loss
from grpokit.algo.correction import correction_weights, mismatch_stats
from tests.algo import reference as ref
from tests.algo.test_losses import AGGS, L_MAX, random_batch


def sampler_side(old_logp: torch.Tensor, seed: int, spread: float) -> torch.Tensor:
    """The sampler's log-probs: the trainer's plus noise (bf16 kernels, another engine); some rows
    far off so that every cap binds somewhere."""
    g = torch.Generator().manual_seed(seed + 100)
    noise = torch.randn(old_logp.shape, generator=g, dtype=torch.float64) * spread
    noise[0] *= 8
    return old_logp + noise


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("spread", [0.01, 0.1, 0.5])
def test_mismatch_stats_match_reference(seed, spread):
    _, old_logp, _, _, mask = random_batch(seed)
    sampler = sampler_side(old_logp, seed, spread)
    abs_sum, outside, n = mismatch_stats(old_logp, sampler, mask)
    want = ref.mismatch(old_logp.tolist(), sampler.tolist(), mask.int().tolist())
    assert abs(float(abs_sum) - want[0]) < 1e-12 and int(outside) == want[1] and n == want[2]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["token_truncated", "sequence_masked"])
@pytest.mark.parametrize("cap", [0.5, 1.0, 2.0, 10.0])
def test_correction_weights_match_reference(seed, mode, cap):
    _, old_logp, _, _, mask = random_batch(seed)
    sampler = sampler_side(old_logp, seed, 0.3)
    w = correction_weights(old_logp, sampler, mask, mode, cap)
    want = ref.correction_weights(old_logp.tolist(), sampler.tolist(), mask.int().tolist(), mode, cap)
    assert torch.allclose(w, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert not w.requires_grad and bool((w[~mask] == 0).all())


def test_weights_are_one_without_mismatch_and_masking_drops_whole_sequences():
    _, old_logp, _, _, mask = random_batch(3)
    for mode in ("token_truncated", "sequence_masked"):
        w = correction_weights(old_logp, old_logp.clone(), mask, mode, 2.0)
        assert torch.equal(w, mask.double())
    sampler = old_logp.clone()
    sampler[1, 0] -= 3.0  # row 1: rho = e^3 > C -> dropped entirely
    w = correction_weights(old_logp, sampler, mask, "sequence_masked", 2.0)
    assert bool((w[1] == 0).all()) and torch.equal(w[0], mask[0].double())


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("mode", ["token_truncated", "sequence_masked"])
def test_weights_scale_the_policy_gradient_term_in_the_loss(seed, aggregation, mode):
    logp, old_logp, ref_logp, adv, mask = random_batch(seed, spread=0.3)
    w = correction_weights(old_logp, sampler_side(old_logp, seed, 0.2), mask, mode, 2.0)
    kw = dict(beta=0.1, aggregation=aggregation, max_completion_length=L_MAX)
    loss, _ = policy_loss(logp, old_logp, adv, mask, ref_logp=ref_logp, is_weights=w, **kw)
    expected = ref.policy_loss(
        logp.tolist(), old_logp.tolist(), adv.tolist(), mask.int().tolist(), ref_logp=ref_logp.tolist(),
        clip_low=0.2, clip_high=0.2, ratio_level="token", is_weights=w.tolist(), **kw,
    )  # fmt: skip
    assert abs(float(loss) - expected) < 1e-12


def test_bad_arguments_are_refused():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="mode must be one of"):
        correction_weights(x, x, m, "tis", 2.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        correction_weights(x, x, m, "token_truncated", 0.0)
    with pytest.raises(ValueError, match="same"):
        correction_weights(x, torch.zeros(2, 2), m, "token_truncated", 2.0)
