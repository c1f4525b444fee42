"""token_logprobs / hidden_token_logprobs against log_softmax-gather and the float64 reference."""

from __future__ import annotations

import pytest
import torch

from grpokit.algo import hidden_token_logprobs, token_entropy, token_logprobs
from tests.algo import reference as ref


def naive(logits, ids, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)


def make(seed, B=3, T=5, V=11, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 4).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    return logits, ids


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block_tokens", [1, 2, 3, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_value_and_grad(seed, block_tokens, temperature):
    logits, ids = make(seed)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = token_logprobs(a, ids, temperature=temperature, block_tokens=block_tokens)
    want = naive(b, ids, temperature)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed))
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)


def test_token_logprobs_matches_python_reference_in_float64():
    logits, ids = make(3, dtype=torch.float64)
    got = token_logprobs(logits, ids, temperature=0.9)
    expected = [
        [ref.log_softmax_at(logits[b, t].tolist(), int(ids[b, t]), 0.9) for t in range(5)] for b in range(3)
    ]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def test_gradcheck_float64():
    logits, ids = make(4, B=2, T=3, V=5, dtype=torch.float64)
    logits.requires_grad_(True)
    fn = lambda x: token_logprobs(x, ids, temperature=1.3, block_tokens=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-7)


def test_non_contiguous_slice_and_bf16():
    logits, ids = make(5, T=8)
    sliced = logits[:, 2:7]  # what a caller does to drop prompt positions
    assert not sliced.is_contiguous()
    torch.testing.assert_close(
        token_logprobs(sliced, ids[:, 2:7]), naive(sliced, ids[:, 2:7]), atol=1e-6, rtol=0
    )
    lb = logits.bfloat16()
    got = token_logprobs(lb, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, naive(lb, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("block_tokens", [1, 4, None])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_hidden_token_logprobs_value_and_grads(with_bias, block_tokens, temperature):
    g = torch.Generator().manual_seed(11)
    B, T, H, V = 2, 6, 8, 13
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    bias = torch.randn(V, generator=g) if with_bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight) + ((bias,) if with_bias else ())]
    leaves_ref = [t.detach().clone().requires_grad_(True) for t in leaves]

    def split(ls):
        return ls[0], ls[1], ls[2] if with_bias else None

    h, w, b = split(leaves)
    got = hidden_token_logprobs(h, w, ids, bias=b, temperature=temperature, block_tokens=block_tokens)
    hr, wr, br = split(leaves_ref)
    logits = hr @ wr.t() + (br if with_bias else 0)
    want = naive(logits, ids, temperature)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    upstream = torch.randn(B, T, generator=g)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    for x, y in zip(leaves, leaves_ref, strict=True):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_tokens", [1, 5, None])
@pytest.mark.parametrize("tau", [0.7, 1.0])
@pytest.mark.parametrize("piece", [4, 4096])  # the entropy's exp over column pieces (a partial last one)
def test_hidden_token_logprobs_mask_and_entropy(block_tokens, tau, piece, monkeypatch):
    monkeypatch.setattr("grpokit.algo.logprobs.ENTROPY_PIECE", piece)
    # masked-out tokens are never projected: log-prob and entropy 0, no gradient; the kept ones equal
    # the float64 naive expression, and so does the entropy returned from the same blocks
    g = torch.Generator().manual_seed(13)
    B, T, H, V = 3, 7, 6, 17
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)[:, 1:]  # non-contiguous [3, 6, 6]
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T - 1), generator=g)
    mask = torch.rand(B, T - 1, generator=g) < 0.6
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, ent = hidden_token_logprobs(
        h, w, ids, temperature=tau, mask=mask, return_entropy=True, block_tokens=block_tokens
    )
    z = (hidden @ weight.t()) / tau
    want = torch.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)
    p = torch.softmax(z, -1)
    want_ent = -(p * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(logp, torch.where(mask, want, 0.0), atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, torch.where(mask, want_ent, 0.0), atol=1e-12, rtol=0)
    assert not ent.requires_grad
    logp.sum().backward()
    assert bool((h.grad[~mask] == 0).all()) and bool((h.grad[mask] != 0).all())
    hr, wr = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref_lp = torch.log_softmax((hr @ wr.t()) / tau, -1).gather(-1, ids[..., None]).squeeze(-1)
    ref_lp[mask].sum().backward()
    torch.testing.assert_close(h.grad, hr.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="mask must be a bool"):
        hidden_token_logprobs(h, w, ids, mask=mask.long())


def _separable_loss(logp_BT, adv_B, mask_BT):
    # a GRPO-like per-token loss: -(pi / sg(pi)) A + 0.3 k3(pi, ref) + 0.05 logp^2, log ref = sg(logp) - 0.2
    ratio = torch.exp(logp_BT - logp_BT.detach())
    log_ref = logp_BT.detach() - 0.2
    kl = torch.exp(log_ref - logp_BT) - (log_ref - logp_BT) - 1.0
    per_token = -ratio * adv_B[:, None] + 0.3 * kl + 0.05 * logp_BT**2
    return torch.where(mask_BT, per_token, 0.0).sum() / mask_BT.sum()


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("block_tokens", [1, 5, None])
@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("piece", [4, 4096])
def test_loss_grad_in_the_forward_blocks_equals_the_float64_reference(
    with_bias, block_tokens, tau, with_entropy, piece, monkeypatch
):
    # with loss_grad the head's gradients come out of the forward blocks (no recompute in backward):
    # the same values and gradients as autograd through the full float64 logits
    import grpokit.algo.logprobs as lp

    monkeypatch.setattr(lp, "_recompute_grads", None)  # the backward must not need it
    monkeypatch.setattr(lp, "ENTROPY_PIECE", piece)
    g = torch.Generator().manual_seed(21)
    B, T, H, V = 3, 6, 5, 19
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64) if with_bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    calls = []

    def loss_grad(index_c, logp_c):
        calls.append(index_c.clone())
        x = logp_c.detach().requires_grad_()
        with torch.enable_grad():
            full = torch.zeros(B * T, dtype=x.dtype).index_put((index_c,), x).view(B, T)
            (grad,) = torch.autograd.grad(_separable_loss(full, adv, mask), x)
        return grad

    leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
    h, w, b = leaves[0], leaves[1], leaves[2] if with_bias else None
    out = hidden_token_logprobs(h, w, ids, bias=b, temperature=tau, block_tokens=block_tokens, mask=mask,
                                return_entropy=with_entropy, loss_grad=loss_grad)  # fmt: skip
    logp = out[0] if with_entropy else out
    assert torch.equal(torch.cat(calls), mask.reshape(-1).nonzero().squeeze(-1))  # each kept token once
    refs = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
    z = (refs[0] @ refs[1].t() + (refs[2] if with_bias else 0)) / tau
    want = torch.where(mask, torch.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1), 0.0)
    torch.testing.assert_close(logp, want, atol=1e-12, rtol=0)
    _separable_loss(logp, adv, mask).backward()
    _separable_loss(want, adv, mask).backward()
    for x, y in zip(leaves, refs, strict=True):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-12, rtol=0)


def test_loss_grad_that_breaks_its_promise_still_gives_the_true_gradient(monkeypatch):
    # the backward compares the gradient it receives with the one loss_grad gave; a different loss
    # (here 2x it, and another) falls back to recomputing the blocks: the true gradient either way
    import grpokit.algo.logprobs as lp

    g = torch.Generator().manual_seed(22)
    hidden = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    weight = torch.randn(7, 3, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 7, (2, 4), generator=g)
    recomputed = []
    real = lp._recompute_grads
    monkeypatch.setattr(lp, "_recompute_grads", lambda *a: recomputed.append(1) or real(*a))
    promised = lambda index_c, logp_c: torch.ones_like(logp_c)  # noqa: E731  d(sum logp)/d logp
    for loss, fallback in [(lambda lp_: lp_.sum(), False), (lambda lp_: 2 * lp_.sum(), True),
                           (lambda lp_: (lp_**2).sum(), True)]:  # fmt: skip
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss(hidden_token_logprobs(h, w, ids, block_tokens=3, loss_grad=promised)).backward()
        hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss(torch.log_softmax(hr @ wr.t(), -1).gather(-1, ids[..., None]).squeeze(-1)).backward()
        torch.testing.assert_close(h.grad, hr.grad, atol=1e-12, rtol=0)
        torch.testing.assert_close(w.grad, wr.grad, atol=1e-12, rtol=0)
        assert recomputed == ([1] if fallback else [])
        recomputed.clear()


def test_hidden_gradcheck_float64():
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(1, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 6, (1, 3), generator=g)
    fn = lambda h, w, b: hidden_token_logprobs(h, w, ids, bias=b, block_tokens=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight, bias), eps=1e-6, atol=1e-7)


def test_frozen_weight_gets_no_grad():
    hidden = torch.randn(1, 2, 3, requires_grad=True)
    weight = torch.randn(5, 3)
    hidden_token_logprobs(hidden, weight, torch.zeros(1, 2, dtype=torch.long)).sum().backward()
    assert hidden.grad is not None and weight.grad is None


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)),
            r"logits must be \[B, T, V\]",
        ),
        (
            lambda: token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long)),
            "token_ids must be",
        ),
        (lambda: token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2)), "integer tensor"),
        (
            lambda: token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0),
            "temperature must be > 0",
        ),
        (
            lambda: token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), block_tokens=0),
            "block_tokens must be >= 1",
        ),
        (
            lambda: hidden_token_logprobs(
                torch.zeros(1, 2, 3), torch.zeros(4, 5), torch.zeros(1, 2, dtype=torch.long)
            ),
            "weight",
        ),
        (
            lambda: hidden_token_logprobs(
                torch.zeros(1, 2, 3),
                torch.zeros(4, 3),
                torch.zeros(1, 2, dtype=torch.long),
                bias=torch.zeros(3),
            ),
            r"bias must be \[V\]",
        ),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("block_tokens", [1, None])
@pytest.mark.parametrize("piece", [3, 4096])
def test_token_entropy_matches_definition(block_tokens, piece, monkeypatch):
    monkeypatch.setattr("grpokit.algo.logprobs.ENTROPY_PIECE", piece)
    logits, _ = make(6, dtype=torch.float64)
    got = token_entropy(logits, temperature=0.8, block_tokens=block_tokens)
    p = torch.softmax(logits / 0.8, -1)
    torch.testing.assert_close(got, -(p * p.log()).sum(-1), rtol=1e-12, atol=1e-12)
    uniform = token_entropy(torch.zeros(1, 2, 7))
    torch.testing.assert_close(uniform, torch.full((1, 2), torch.log(torch.tensor(7.0)).item()))


@pytest.mark.parametrize("block_tokens", [1, 4, None])
def test_hidden_token_entropy_equals_the_naive_float64_entropy(block_tokens):
    from grpokit.algo import hidden_token_entropy

    g = torch.Generator().manual_seed(14)
    hidden = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(9, 4, generator=g, dtype=torch.float64)
    bias = torch.randn(9, generator=g, dtype=torch.float64)
    z = (hidden @ weight.t() + bias) / 1.3
    want = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    got = hidden_token_entropy(hidden, weight, bias=bias, temperature=1.3, block_tokens=block_tokens)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(token_entropy(z * 1.3, temperature=1.3), want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("block_tokens", [1, 3, None])
def test_masked_vocabulary_entries_are_exact(block_tokens):
    """Logits with -inf entries (a vocabulary mask): the log-probs of the tokens left equal the
    float64 log_softmax, with gradients; the blocks' logsumexp is taken in place over each block."""
    g = torch.Generator().manual_seed(21)
    B, T, V = 2, 5, 19
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 4
    logits[torch.rand(B, T, V, generator=g) < 0.4] = float("-inf")
    logits[..., 0] = 1.0  # every row keeps a token
    ids = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            kept = torch.isfinite(logits[b, t]).nonzero().flatten()
            ids[b, t] = kept[torch.randint(len(kept), (1,), generator=g)]
    x = logits.clone().requires_grad_(True)
    got = token_logprobs(x, ids, temperature=0.9, block_tokens=block_tokens)
    xr = logits.clone().requires_grad_(True)
    want = torch.log_softmax(xr / 0.9, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("piece", [4, 4096])
def test_entropy_of_a_masked_vocabulary_is_finite_and_exact(piece, monkeypatch):
    # -inf logits (masked entries, here also through a -inf head bias) have probability 0 and add
    # 0 log 0 = 0 to the entropy, not 0 * -inf = NaN; float64 reference over the finite entries
    from grpokit.algo import hidden_token_entropy

    monkeypatch.setattr("grpokit.algo.logprobs.ENTROPY_PIECE", piece)
    g = torch.Generator().manual_seed(23)
    hidden = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(19, 4, generator=g, dtype=torch.float64)
    bias = torch.randn(19, generator=g, dtype=torch.float64)
    bias[torch.rand(19, generator=g) < 0.4] = float("-inf")
    bias[0] = 0.0
    z = (hidden @ weight.t() + bias) / 0.9
    kept = torch.isfinite(z)
    p = torch.softmax(z, -1)
    want = -torch.where(kept, p * torch.log_softmax(z, -1), 0.0).sum(-1)
    ids = torch.zeros(2, 5, dtype=torch.long)
    for got in (
        token_entropy(z * 0.9, temperature=0.9),
        hidden_token_entropy(hidden, weight, bias=bias, temperature=0.9),
        hidden_token_logprobs(hidden, weight, ids, bias=bias, temperature=0.9, return_entropy=True)[1],
    ):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
