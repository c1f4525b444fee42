"""policy_loss against the float64 reference, analytic gradients, and accumulation exactness."""

from __future__ import annotations

import itertools

import pytest
import torch

from grpokit.algo import losses, policy_loss
from tests.algo import reference as ref

AGGS = ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]
L_MAX = 9


def random_batch(seed: int, B: int = 6, T: int = 7, spread: float = 0.4):
    """Right-padded completions with lengths 1..T, one fully masked row, ratios around 1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[B // 2] = 0  # an empty completion (e.g. masked as truncated): counts in no denominator
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old_logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old_logp + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    ref_logp = old_logp + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old_logp, ref_logp, adv, mask


def reference_loss(logp, old_logp, ref_logp, adv, mask, **kw):
    return ref.policy_loss(
        logp.tolist(), old_logp.tolist(), adv.tolist(), mask.int().tolist(), ref_logp=ref_logp.tolist(), **kw
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("beta,kl_kind", [(0.0, "k3"), (0.1, "k3"), (0.3, "k1"), (0.05, "k2")])
@pytest.mark.parametrize("clip_low,clip_high", [(0.2, None), (0.2, 0.28), (0.05, 0.1)])
def test_loss_matches_reference(seed, aggregation, ratio_level, beta, kl_kind, clip_low, clip_high):
    logp, old_logp, ref_logp, adv, mask = random_batch(seed)
    loss, _ = policy_loss(
        logp,
        old_logp,
        adv,
        mask,
        ref_logp=ref_logp,
        beta=beta,
        clip_low=clip_low,
        clip_high=clip_high,
        ratio_level=ratio_level,
        aggregation=aggregation,
        max_completion_length=L_MAX,
        kl_kind=kl_kind,
    )
    expected = reference_loss(
        logp,
        old_logp,
        ref_logp,
        adv,
        mask,
        beta=beta,
        clip_low=clip_low,
        clip_high=clip_low if clip_high is None else clip_high,
        ratio_level=ratio_level,
        aggregation=aggregation,
        max_completion_length=L_MAX,
        kl_kind=kl_kind,
    )
    assert abs(float(loss) - expected) < 1e-12


def token_weights(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """d loss / d (per-token term) for each aggregation: its denominator, written out."""
    lengths = mask.sum(1, keepdim=True).double()
    n_seq = int(mask.any(1).sum())
    if aggregation == "seq_mean_token_mean":
        w = 1.0 / (n_seq * lengths.clamp(min=1))
    elif aggregation == "token_mean":
        w = torch.full_like(lengths, 1.0 / int(mask.sum()))
    else:
        w = torch.full_like(lengths, 1.0 / (n_seq * L_MAX))
    return w.expand(mask.shape) * mask


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_unclipped_region_is_analytic(aggregation, seed):
    # spread 0.05 keeps every ratio inside [0.8, 1.2]: d/dlogp [-r A w] = -r A w
    logp, old_logp, _, adv, mask = random_batch(seed, spread=0.05)
    logp.requires_grad_(True)
    loss, m = policy_loss(logp, old_logp, adv, mask, aggregation=aggregation, max_completion_length=L_MAX)
    loss.backward()
    assert float(m["clip_fraction"]) == 0.0
    ratio = (logp - old_logp).exp().detach()
    expected = -ratio * adv[:, None] * token_weights(mask, aggregation)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-14)


def test_mu_one_gives_the_policy_gradient():
    # old_logp = logp.detach(): ratio 1, gradient -A / (N |o_i|) per token (REINFORCE with baseline)
    logp, _, _, adv, mask = random_batch(3)
    logp.requires_grad_(True)
    loss, m = policy_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    assert float(m["ratio_max"]) == 1.0 and float(m["ratio_min"]) == 1.0
    torch.testing.assert_close(logp.grad, -adv[:, None] * token_weights(mask, "seq_mean_token_mean"))


def test_clipped_tokens_get_exactly_zero_gradient():
    old_logp = torch.zeros(4, 2, dtype=torch.float64)
    # ratios: e^0.5 = 1.65 (above 1.2), e^-0.5 = 0.61 (below 0.8)
    logp = torch.tensor(
        [[0.5, 0.0], [0.5, 0.0], [-0.5, 0.0], [-0.5, 0.0]], dtype=torch.float64, requires_grad=True
    )
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.bool)
    loss, m = policy_loss(logp, old_logp, adv, mask)
    loss.backward()
    # row 0: r > 1+eps, A > 0 -> clipped; row 2: r < 1-eps, A < 0 -> clipped
    assert logp.grad[0, 0] == 0.0 and logp.grad[2, 0] == 0.0
    # row 1: r > 1+eps but A < 0 -> min picks the unclipped term, gradient -r A / (N |o|)
    assert logp.grad[1, 0] == pytest.approx(-(0.5**0 * torch.e**0.5) * -1.0 / (4 * 2))
    assert logp.grad[3, 0] == pytest.approx(-(torch.e**-0.5) * 1.0 / (4 * 2))
    assert float(m["clip_fraction_high"]) == pytest.approx(1 / 8)
    assert float(m["clip_fraction_low"]) == pytest.approx(1 / 8)
    assert float(m["clip_fraction"]) == pytest.approx(2 / 8)


def test_clip_high_widens_the_upper_bound_only():
    old_logp = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), 0.22, dtype=torch.float64, requires_grad=True)  # ratio 1.246
    adv = torch.ones(1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    _, symmetric = policy_loss(logp, old_logp, adv, mask, clip_low=0.2)
    _, higher = policy_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28)
    assert float(symmetric["clip_fraction_high"]) == 1.0 and float(higher["clip_fraction_high"]) == 0.0


def test_kl_term_pulls_logp_toward_ref():
    logp, old_logp, ref_logp, _, mask = random_batch(4)
    logp = logp.detach().requires_grad_(True)
    loss, m = policy_loss(
        logp, old_logp, torch.zeros(6, dtype=torch.float64), mask, ref_logp=ref_logp, beta=0.5
    )
    loss.backward()
    step = logp.detach() - 0.1 * logp.grad  # one gradient-descent step
    before = ((logp.detach() - ref_logp).abs())[mask]
    after = ((step - ref_logp).abs())[mask]
    assert (after < before).all()
    assert float(m["kl"]) > 0 and torch.isfinite(m["kl"])


def test_ref_without_beta_reports_kl_but_does_not_train_on_it():
    logp, old_logp, ref_logp, adv, mask = random_batch(5)
    with_ref, m = policy_loss(logp, old_logp, adv, mask, ref_logp=ref_logp, beta=0.0)
    without, m0 = policy_loss(logp, old_logp, adv, mask)
    assert float(with_ref) == float(without)
    assert float(m["kl"]) > 0 and torch.isnan(m0["kl"])


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_accumulation_over_micro_batches_is_exact(aggregation, ratio_level, micro):
    logp, old_logp, ref_logp, adv, mask = random_batch(6, B=8)
    kw = dict(
        ref_logp=ref_logp,
        beta=0.1,
        ratio_level=ratio_level,
        aggregation=aggregation,
        max_completion_length=L_MAX,
        clip_high=0.28,
    )
    full_logp = logp.clone().requires_grad_(True)
    full, _ = policy_loss(full_logp, old_logp, adv, mask, **kw)
    full.backward()

    acc_logp = logp.clone().requires_grad_(True)
    counts = dict(num_sequences=int(mask.any(1).sum()), num_tokens=int(mask.sum()))
    total = 0.0
    for s in range(0, 8, micro):
        sl = slice(s, s + micro)
        part, _ = policy_loss(
            acc_logp[sl], old_logp[sl], adv[sl], mask[sl], **{**kw, "ref_logp": ref_logp[sl]}, **counts
        )
        part.backward()
        total += float(part.detach())
    assert total == pytest.approx(float(full.detach()), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(acc_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-15)


def test_per_micro_batch_normalisation_would_differ():
    # the guard above is not vacuous: normalising each micro-batch by its own token count breaks it
    logp, old_logp, _, adv, mask = random_batch(6, B=8)
    full, _ = policy_loss(logp, old_logp, adv, mask, aggregation="token_mean")
    local = sum(
        float(
            policy_loss(
                logp[s : s + 2],
                old_logp[s : s + 2],
                adv[s : s + 2],
                mask[s : s + 2],
                aggregation="token_mean",
            )[0]
        )
        for s in range(0, 8, 2)
    )
    assert abs(local / 4 - float(full)) > 1e-3


def test_sequence_ratio_is_gspo():
    logp, old_logp, _, adv, mask = random_batch(7, spread=0.02)
    logp.requires_grad_(True)
    loss, m = policy_loss(logp, old_logp, adv, mask, ratio_level="sequence", clip_low=0.5)
    loss.backward()
    lengths = mask.sum(1).clamp(min=1)
    s = (((logp - old_logp) * mask).sum(1) / lengths).exp().detach()
    # GSPO gradient: -(1/N) s_i A_i (1/|o_i|) d logp_it
    n_seq = int(mask.any(1).sum())
    expected = -(s * adv / (n_seq * lengths))[:, None] * mask
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(m["ratio_max"], s[mask.any(1)].max())


def test_padding_garbage_never_leaks():
    logp, old_logp, ref_logp, adv, mask = random_batch(8)
    for t in (logp, old_logp, ref_logp):
        t[~mask] = float("-inf")
    logp[0, -1] = float("nan") if not mask[0, -1] else logp[0, -1]
    logp.requires_grad_(True)
    for aggregation, level in itertools.product(AGGS, ["token", "sequence"]):
        loss, metrics = policy_loss(
            logp,
            old_logp,
            adv,
            mask,
            ref_logp=ref_logp,
            beta=0.1,
            aggregation=aggregation,
            ratio_level=level,
            max_completion_length=L_MAX,
        )
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (aggregation, level)
        assert (grad[~mask] == 0).all()
        assert all(torch.isfinite(v) for v in metrics.values())


def test_empty_batch_is_zero_not_nan():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    assert float(loss.detach()) == 0.0 and int(m["num_tokens"]) == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"logp": torch.zeros(2, 3, 4)}, r"logp must be \[B, T\]"),
        ({"old_logp": torch.zeros(2, 4)}, "old_logp has shape"),
        ({"mask": torch.ones(3, 3)}, "mask has shape"),
        ({"advantages": torch.zeros(3)}, r"advantages must be \[B\]"),
        ({"beta": 0.1}, "beta > 0 needs ref_logp"),
        ({"beta": -0.1}, "beta must be >= 0"),
        ({"clip_low": 1.0}, r"clip_low must be in \[0, 1\)"),
        ({"clip_high": -0.1}, "clip_high must be >= 0"),
        ({"ratio_level": "seq"}, "ratio_level must be one of"),
        ({"aggregation": "mean"}, "aggregation must be one of"),
        ({"aggregation": "seq_mean_token_sum_norm"}, "needs max_completion_length"),
        ({"max_completion_length": 0}, "max_completion_length must be a positive int"),
        ({"ref_logp": torch.zeros(2, 2), "beta": 0.1}, "ref_logp has shape"),
    ],
)
def test_bad_inputs(kwargs, match):
    args = dict(
        logp=torch.zeros(2, 3), old_logp=torch.zeros(2, 3), advantages=torch.zeros(2), mask=torch.ones(2, 3)
    )
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(ValueError, match=match):
        policy_loss(args["logp"], args["old_logp"], args["advantages"], args["mask"], **kwargs)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "variant",
    [
        dict(surrogate="clip", delta=1.3),
        dict(surrogate="cispo", cispo_max_ratio=1.1),
        dict(surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05),
        dict(surrogate="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0),
    ],
)
@pytest.mark.parametrize("aggregation", AGGS)
def test_surrogate_variants_match_reference(seed, variant, aggregation):
    logp, old_logp, ref_logp, adv, mask = random_batch(seed, spread=0.6)
    g = torch.Generator().manual_seed(seed + 10)
    pg_mask = mask & (torch.rand(mask.shape, generator=g) > 0.3)
    loss, _ = policy_loss(
        logp,
        old_logp,
        adv,
        mask,
        ref_logp=ref_logp,
        beta=0.1,
        aggregation=aggregation,
        max_completion_length=L_MAX,
        pg_mask=pg_mask,
        **variant,
    )
    ref_kw = {
        "tau_pos": variant.get("sapo_tau_pos", 1.0),
        "tau_neg": variant.get("sapo_tau_neg", 1.05),
        **{k: v for k, v in variant.items() if not k.startswith("sapo_")},
    }
    expected = reference_loss(
        logp,
        old_logp,
        ref_logp,
        adv,
        mask,
        beta=0.1,
        clip_low=0.2,
        clip_high=0.2,
        ratio_level="token",
        aggregation=aggregation,
        max_completion_length=L_MAX,
        pg_mask=pg_mask.int().tolist(),
        **ref_kw,
    )
    assert abs(float(loss) - expected) < 1e-12


def test_cispo_keeps_a_gradient_where_the_clip_would_drop_it():
    old_logp = torch.zeros(2, 1, dtype=torch.float64)
    logp = torch.tensor([[0.5], [-0.5]], dtype=torch.float64, requires_grad=True)  # ratios 1.65, 0.61
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss, _ = policy_loss(logp, old_logp, adv, mask, surrogate="cispo", cispo_max_ratio=1.5)
    loss.backward()
    # d/dlogp [-sg(min(r, 1.5)) A logp] / N = -min(r, 1.5) A / 2: row 0 capped at 1.5, row 1 uncapped
    torch.testing.assert_close(
        logp.grad, torch.tensor([[-1.5 / 2], [torch.e**-0.5 / 2]], dtype=torch.float64)
    )
    clip_loss, _ = policy_loss(logp, old_logp, adv, mask)  # the PPO clip zeroes both
    (clip_grad,) = torch.autograd.grad(clip_loss, logp)
    assert (clip_grad == 0).all()


def test_sapo_equals_grpo_gradient_on_policy_and_decays_off_policy():
    logp, _, _, adv, mask = random_batch(9)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    torch.autograd.backward(policy_loss(a, a.detach(), adv, mask, surrogate="sapo")[0])
    torch.autograd.backward(policy_loss(b, b.detach(), adv, mask)[0])
    torch.testing.assert_close(a.grad, b.grad)  # f'(1) = 1
    far = logp.clone().requires_grad_(True)
    # r = e^3: d/dlogp of the gate is 4 s(1-s) r with s = sigmoid(tau (r-1)) ~ 1 -> almost nothing
    torch.autograd.backward(policy_loss(far, far.detach() - 3.0, adv, mask, surrogate="sapo")[0])
    assert (far.grad.abs() <= 1e-3 * a.grad.abs() + 1e-15).all()


def test_two_sided_clip_caps_negative_advantage_ratio():
    old_logp = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), 2.0, dtype=torch.float64, requires_grad=True)  # ratio e^2 = 7.39
    adv = torch.tensor([-1.0], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    plain, _ = policy_loss(logp, old_logp, adv, mask)
    capped, _ = policy_loss(logp, old_logp, adv, mask, delta=4.0)
    assert float(plain.detach()) == pytest.approx(torch.e**2) and float(capped.detach()) == pytest.approx(4.0)
    (g,) = torch.autograd.grad(capped, logp)
    assert g.item() == 0.0  # above delta the update is bounded: no gradient through the cap


def test_bnpo_is_the_mean_of_local_token_means():
    logp, old_logp, _, adv, mask = random_batch(10, B=8)
    parts = [(slice(0, 3)), (slice(3, 8))]
    total = sum(
        float(policy_loss(logp[s], old_logp[s], adv[s], mask[s], aggregation="bnpo", num_micro_batches=2)[0])
        for s in parts
    )
    local = [
        float(policy_loss(logp[s], old_logp[s], adv[s], mask[s], aggregation="token_mean")[0]) for s in parts
    ]
    assert total == pytest.approx(sum(local) / 2, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"surrogate": "ppo"}, "surrogate must be one of"),
        ({"delta": 0.5}, "delta .* must be > 1"),
        ({"pg_mask": torch.ones(3, 3)}, "pg_mask has shape"),
    ],
)
def test_bad_variant_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), **kwargs)


def test_loss_spec_refuses_misspelled_and_bad_options():
    from grpokit.algo import LossSpec

    with pytest.raises(TypeError, match="clip_lo"):
        LossSpec(clip_lo=0.2)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        LossSpec(aggregation="token_sum")
    with pytest.raises(ValueError, match="kl_kind must be one of"):
        LossSpec(kl_kind="k4")
    # each surrogate and aggregation declares exactly the options it takes: no ** sink accepts a typo
    from grpokit.algo.losses import AGGREGATION_COUNTS, SURROGATE_OPTIONS

    assert SURROGATE_OPTIONS == {
        "clip": ("clip_low", "clip_high", "delta"),
        "cispo": ("cispo_max_ratio",),
        "sapo": ("sapo_tau_pos", "sapo_tau_neg"),
    }
    assert AGGREGATION_COUNTS["token_mean"] == ("num_tokens",)
    with pytest.raises(TypeError):
        losses.clipped_surrogate(
            torch.ones(1, 1), torch.zeros(1, 1), torch.ones(1, 1), clip_low=0.2, clip_high=0.2, clip_hi=1
        )
