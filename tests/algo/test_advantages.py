"""group_advantages against the hand-worked example and the float64 reference."""

from __future__ import annotations

import pytest
import torch

from grpokit.algo import decoupled_advantages, group_advantages, zero_std_groups
from tests.algo import reference as ref


def random_rewards(seed: int, n_groups: int, G: int) -> torch.Tensor:
    """Mixed rewards: continuous groups, 0/1 groups, and all-equal groups."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for k in range(n_groups):
        kind = k % 3
        if kind == 0:
            groups.append(torch.randn(G, generator=g, dtype=torch.float64) * 3 + 1)
        elif kind == 1:
            groups.append(torch.randint(0, 2, (G,), generator=g).double())
        else:
            groups.append(torch.full((G,), float(torch.rand((), generator=g, dtype=torch.float64))))
    return torch.cat(groups)


def test_worked_example_signs_sum_and_values():
    r = torch.tensor([9.1, 9.2, 9.0, 9.3, 9.1, 9.2, 9.0, 9.1])
    adv = group_advantages(r, 8)
    # mean 9.125; squared deviations sum to 0.075; unbiased std sqrt(0.075 / 7) = 0.1035098
    expected = torch.tensor([-0.24129, 0.72387, -1.20645, 1.68903, -0.24129, 0.72387, -1.20645, -0.24129])
    torch.testing.assert_close(adv, expected, atol=5e-5, rtol=0)
    assert (adv[(r == 9.0) | (r == 9.1)] < 0).all()
    assert (adv[(r == 9.2) | (r == 9.3)] > 0).all()
    assert abs(float(adv.sum())) < 1e-5


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("G", [2, 3, 8])
@pytest.mark.parametrize(
    "estimator,scale",
    [
        ("grpo", "group"),
        ("grpo", "batch"),
        ("grpo", "none"),
        ("dr_grpo", "none"),
        ("rloo", "none"),
        ("rloo", "group"),
        ("rloo", "batch"),
    ],
)
def test_matches_float64_reference(seed, G, estimator, scale):
    r = random_rewards(seed, n_groups=6, G=G)
    expected = ref.advantages(r.tolist(), G, estimator, scale, eps=1e-4)
    got = group_advantages(r, G, estimator=estimator, scale=scale, eps=1e-4)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_default_scale_follows_estimator():
    r = random_rewards(7, n_groups=4, G=4)
    torch.testing.assert_close(group_advantages(r, 4), group_advantages(r, 4, scale="group"))
    torch.testing.assert_close(
        group_advantages(r, 4, estimator="dr_grpo"), group_advantages(r, 4, estimator="grpo", scale="none")
    )
    torch.testing.assert_close(
        group_advantages(r, 4, estimator="rloo"),
        torch.tensor(ref.advantages(r.tolist(), 4, "rloo", "none", 0.0), dtype=torch.float64),
    )


def test_rloo_is_leave_one_out_by_hand():
    # group [1, 0, 0]: 1 - (0+0)/2 = 1 ; 0 - (1+0)/2 = -0.5 twice
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, estimator="rloo")
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5]))


def test_tied_groups_are_exactly_zero_in_float32():
    # twelve rewards of 0.7: float32 r - mean is ~6e-8, which (r-mean)/(std+eps) would blow up
    r = torch.full((12,), 0.7, dtype=torch.float32)
    assert (r - r.mean()).abs().max() > 0  # the residual is real in float32 ...
    for estimator, scale in [("grpo", "group"), ("grpo", "batch"), ("dr_grpo", None), ("rloo", "group")]:
        adv = group_advantages(r, 12, estimator=estimator, scale=scale, eps=1e-8)
        assert torch.equal(adv, torch.zeros(12)), (estimator, scale)  # ... and removed here


def test_nearly_tied_group_counts_as_tied_and_others_unchanged():
    a = 0.1 + 0.2  # 0.30000000000000004
    r = torch.tensor([a, 0.3, 0.3, a, 1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    adv = group_advantages(r, 4)
    assert torch.equal(adv[:4], torch.zeros(4, dtype=torch.float64))
    assert zero_std_groups(r, 4).tolist() == [True, False]
    torch.testing.assert_close(adv[4:], group_advantages(r[4:], 4))


def test_batch_scale_uses_whole_batch_std():
    r = torch.tensor([0.0, 2.0, 10.0, 10.0])
    adv = group_advantages(r, 2, scale="batch", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0]) / r.std())


def test_dtype_is_preserved_and_no_grad_needed():
    r = torch.tensor([1.0, 0.0], dtype=torch.bfloat16)
    assert group_advantages(r, 2).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "rewards,G,kwargs,match",
    [
        (torch.zeros(7), 2, {}, "not a positive multiple of group_size=2"),
        (torch.zeros(0), 2, {}, "not a positive multiple"),
        (torch.zeros(4), 1, {}, "group_size must be an int >= 2"),
        (torch.zeros(4), 2.0, {}, "group_size must be an int >= 2"),
        (torch.tensor([0.0, float("nan")]), 2, {}, r"NaN or inf at positions \[1\]"),
        (torch.tensor([float("inf"), 0.0]), 2, {}, r"NaN or inf at positions \[0\]"),
        (torch.zeros(2, 2), 2, {}, r"1-D tensor \[B\]"),
        (torch.zeros(4, dtype=torch.long), 2, {}, "floating-point"),
        (torch.zeros(4), 2, {"estimator": "ppo"}, "estimator must be one of"),
        (torch.zeros(4), 2, {"scale": "std"}, "scale must be one of"),
        (torch.zeros(4), 2, {"estimator": "dr_grpo", "scale": "group"}, "means no std scaling"),
        (torch.zeros(4), 2, {"eps": -1.0}, "eps must be >= 0"),
    ],
)
def test_bad_inputs_raise_clear_errors(rewards, G, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, G, **kwargs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_advantages_match_reference(seed):
    g = torch.Generator().manual_seed(seed)
    correct = torch.randint(0, 2, (16,), generator=g).double()
    fmt = torch.randint(0, 3, (16,), generator=g).double() / 2
    got = decoupled_advantages(torch.stack([correct, fmt]), [1.0, 0.5], 4)
    expected = ref.decoupled([correct.tolist(), fmt.tolist()], [1.0, 0.5], 4, 1e-4)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_decoupled_keeps_apart_what_sum_then_normalize_collapses():
    # two binary rewards, G=4. Group 1: a=[1,0,0,0], b=[0,1,0,0] (each completion meets one goal);
    # group 2: a=b=[1,1,0,0] (two completions meet both). Summed: [1,1,0,0] vs [2,2,0,0], which one
    # joint normalisation maps to the same advantages (up to eps); GDPO keeps group 2's larger.
    a = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    b = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    joint = group_advantages(a + b, 4)
    torch.testing.assert_close(joint[:4], joint[4:], rtol=1e-3, atol=0)  # sum-then-normalize: alike
    sep = decoupled_advantages(torch.stack([a, b]), [1.0, 1.0], 4)
    assert not torch.allclose(sep[:4], sep[4:])  # normalize-then-sum tells them apart
    assert torch.equal(decoupled_advantages(torch.ones(2, 8), [1.0, 1.0], 4), torch.zeros(8))
    with pytest.raises(ValueError, match=r"\[K, B\]"):
        decoupled_advantages(torch.ones(8), [1.0], 4)


def test_reinforce_has_no_baseline():
    r = torch.tensor([1.0, 0.0, 0.7, 0.7])
    torch.testing.assert_close(group_advantages(r, 2, estimator="reinforce"), r)  # ties are not zeroed
    torch.testing.assert_close(
        group_advantages(r, 2, estimator="reinforce", scale="batch", eps=0.0), r / r.std()
    )
