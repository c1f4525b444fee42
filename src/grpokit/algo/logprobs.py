"""Log-probabilities of given tokens without materialising a float32 log_softmax over [B, T, V].

What it does: ``token_logprobs`` takes logits and returns ``log softmax(logits / temperature)``
at the chosen token ids; ``hidden_token_logprobs`` takes the last hidden states and the LM head
and never forms the full logits at all. Both work block by block over tokens, in float32 (or
float64 for float64 inputs) inside a block, and have hand-written backward passes that recompute
each block's softmax, so neither the forward nor the backward holds more than one float32
``[block, V]`` at a time.

Why: with a 150k vocabulary, ``log_softmax(logits.float())`` on 32k completion tokens is 19 GB of
float32 before autograd saves it for backward. The formula is simply

    logp_t = z_t[y_t] / tau - logsumexp(z_t / tau)
    d logp_t / d z_t = (onehot(y_t) - softmax(z_t / tau)) / tau

What it deliberately does not do: model-specific logit transforms (Gemma-2 soft-capping, logit
scaling): apply those before ``token_logprobs``, or use it rather than the hidden-state variant.

Shape legend: B sequences, T tokens, V vocabulary, H hidden size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# dloss/dlogp for one block of tokens: (their flat positions [c], their log-probs [c]) -> [c]
LossGrad = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Rows of float32 [rows, V] per block: about 128 MiB per block whatever the vocabulary
# (220 tokens at 152k: the head's matmul runs 15% faster than at 64 MiB on this CPU).
DEFAULT_BLOCK_BYTES = 128 * 2**20
# Columns per piece of a block's exp when the entropy is wanted too (_block_lse_entropy): a
# [220, 151936] block took 35.8 ms in pieces of 4096, 52.2 at 16384, 39.7 with a second buffer.
ENTROPY_PIECE = 4096


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    block_tokens: int | None = None,
) -> torch.Tensor:
    r"""``log_softmax(logits / temperature).gather(-1, token_ids)`` computed block by block.

    Equal to the naive expression to float32 rounding; peak extra memory is one float32
    ``[block_tokens, V]`` block (forward and backward) instead of one or two ``[B, T, V]``.

    Args:
        logits: ``[B, T, V]`` (any float dtype; may require grad).
        token_ids: ``[B, T]`` integer ids in ``[0, V)``.
        temperature: divide the logits by this first (the sampling temperature, > 0).
        block_tokens: tokens per block; default: as many as fit in 128 MiB of float32.

    Returns:
        ``[B, T]`` log-probabilities in float32 (float64 for float64 logits), differentiable with
        respect to ``logits``.
    """
    _check(logits, token_ids, temperature)
    rows = _block_rows(logits.shape[-1], block_tokens)
    return _GatherLogSoftmax.apply(logits, token_ids, float(temperature), rows)


def hidden_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    block_tokens: int | None = None,
    mask: torch.Tensor | None = None,
    return_entropy: bool = False,
    loss_grad: LossGrad | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Token log-probs straight from hidden states and the LM head: logits never exist in full.

    Computes ``log_softmax((hidden @ weight.T + bias) / temperature).gather(-1, token_ids)`` one
    block of tokens at a time, and recomputes each block's logits in backward (the chunked
    cross-entropy idea of Liger-Kernel / Apple's Cut Cross-Entropy, here in plain PyTorch). Blocks
    run over the flattened ``B * T`` tokens, so each pass over the ``[V, H]`` head serves up to
    ``block_tokens`` tokens whatever the sequence length.

    Args:
        hidden: ``[B, T, H]`` last hidden states (after the final norm).
        weight: ``[V, H]`` the LM head (``model.get_output_embeddings().weight``).
        token_ids: ``[B, T]`` integer ids in ``[0, V)``.
        bias: optional ``[V]`` LM-head bias.
        temperature: divide the logits by this (> 0).
        block_tokens: tokens per block; default: as many as fit in 128 MiB of float32 logits.
        mask: optional ``[B, T]`` bool; only these tokens are projected (padding costs nothing):
            elsewhere the log-prob (and entropy) is 0 and no gradient flows.
        return_entropy: also return each token's entropy (no gradient), computed from the same
            block of logits as the log-prob (:func:`hidden_token_entropy` without a second pass).
        loss_grad: for a loss that is a sum of per-token terms, each depending on its own token's
            log-prob only, ``loss_grad(index_c, logp_c) -> dloss/dlogp_c`` for one block of tokens
            (``index_c``: their positions in the flattened ``B * T``). The head's gradients are
            then computed inside the forward blocks from the logits already there, and the
            backward has no block to recompute (Liger-Kernel's fused linear loss): three head
            matmuls per block instead of four. The backward checks that the gradient it receives
            equals, bit for bit, what ``loss_grad`` returned; otherwise it recomputes as without
            ``loss_grad``, so a wrong promise costs time, never a wrong gradient.

    Returns:
        ``[B, T]`` log-probabilities in float32 (float64 for float64 inputs), differentiable with
        respect to hidden, weight and bias; with ``return_entropy``, ``(logprobs, entropy)``.
    """
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [B, T, H] and weight [V, H]; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V]={tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
    _check_ids(token_ids, hidden.shape[:2], temperature)
    if mask is not None and (mask.shape != token_ids.shape or mask.dtype != torch.bool):
        raise ValueError(
            f"mask must be a bool [B, T]={tuple(token_ids.shape)}, got {mask.dtype} {tuple(mask.shape)}"
        )
    rows = _block_rows(weight.shape[0], block_tokens)
    B, T, H = hidden.shape
    h_NH, ids_N = hidden.reshape(B * T, H), token_ids.reshape(B * T)
    keep_K = None if mask is None else mask.reshape(B * T).nonzero().squeeze(-1)
    if keep_K is not None:
        h_NH, ids_N = h_NH.index_select(0, keep_K), ids_N.index_select(0, keep_K)
    index_N = None
    if loss_grad is not None:
        index_N = keep_K if keep_K is not None else torch.arange(B * T, device=ids_N.device)
    logp_N, ent_N = _LinearGatherLogSoftmax.apply(
        h_NH, weight, bias, ids_N, float(temperature), rows, return_entropy, loss_grad, index_N
    )

    def unflatten(x_K: torch.Tensor) -> torch.Tensor:  # masked-out positions hold 0
        return (x_K if keep_K is None else x_K.new_zeros(B * T).index_copy(0, keep_K, x_K)).view(B, T)

    return (unflatten(logp_N), unflatten(ent_N)) if return_entropy else unflatten(logp_N)


# --------------------------------------------------------------------------------------------


def _block_rows(vocab: int, block_tokens: int | None) -> int:
    if block_tokens is not None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        return block_tokens
    return max(1, DEFAULT_BLOCK_BYTES // (4 * vocab))


def _check(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    _check_ids(token_ids, logits.shape[:2], temperature)


def _check_ids(token_ids: torch.Tensor, bt: torch.Size, temperature: float) -> None:
    if token_ids.shape != bt:
        raise ValueError(f"token_ids must be [B, T]={tuple(bt)}, got {tuple(token_ids.shape)}")
    if token_ids.is_floating_point():
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _blocks(B: int, T: int, rows: int):
    """Yield (b, t0, t1) blocks covering [B, T], at most ``rows`` tokens each, row by row.

    Blocks stay inside one sequence so slicing a [B, T, V] view never copies, even when the
    caller passed a non-contiguous slice such as ``logits[:, prompt_len - 1 : -1]``.
    """
    step = max(1, min(rows, T))
    for b in range(B):
        for t0 in range(0, T, step):
            yield b, t0, min(t0 + step, T)


class _GatherLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_BTV, ids_BT, temperature, rows):
        B, T, _ = logits_BTV.shape
        acc = _acc_dtype(logits_BTV.dtype)
        out_BT = torch.empty(B, T, dtype=acc, device=logits_BTV.device)
        lse_BT = torch.empty_like(out_BT)
        z_buf = _block_buffer(min(rows, T), logits_BTV)
        for b, t0, t1 in _blocks(B, T, rows):
            z_cV = _tempered(logits_BTV[b, t0:t1], temperature, z_buf[: t1 - t0])
            picked_c = z_cV.gather(-1, ids_BT[b, t0:t1, None]).squeeze(-1)
            lse_BT[b, t0:t1] = _block_lse(z_cV)
            out_BT[b, t0:t1] = picked_c - lse_BT[b, t0:t1]
        ctx.save_for_backward(logits_BTV, ids_BT, lse_BT)
        ctx.temperature, ctx.rows = temperature, rows
        return out_BT

    @staticmethod
    def backward(ctx, grad_BT):
        logits_BTV, ids_BT, lse_BT = ctx.saved_tensors
        tau = ctx.temperature
        grad_logits_BTV = torch.empty_like(logits_BTV)
        B, T, _ = logits_BTV.shape
        z_buf = _block_buffer(min(ctx.rows, T), logits_BTV)
        for b, t0, t1 in _blocks(B, T, ctx.rows):
            g_c1 = grad_BT[b, t0:t1, None].to(lse_BT.dtype)
            z_cV = _tempered(logits_BTV[b, t0:t1], tau, z_buf[: t1 - t0])
            p_cV = z_cV.sub_(lse_BT[b, t0:t1, None]).exp_()
            g_cV = p_cV.mul_(-g_c1).scatter_add_(-1, ids_BT[b, t0:t1, None], g_c1)
            grad_logits_BTV[b, t0:t1] = g_cV if tau == 1.0 else g_cV.div_(tau)
        return grad_logits_BTV, None, None, None


class _LinearGatherLogSoftmax(torch.autograd.Function):
    """Over flattened tokens: hidden ``[N, H]``, ids ``[N]``, blocks of ``rows`` tokens. With
    ``loss_grad`` the forward also computes the head's gradients (see ``hidden_token_logprobs``)."""

    @staticmethod
    def forward(
        ctx, hidden_NH, weight_VH, bias_V, ids_N, temperature, rows, with_entropy, loss_grad, index_N
    ):
        N = hidden_NH.shape[0]
        acc = _acc_dtype(hidden_NH.dtype)
        out_N = torch.empty(N, dtype=acc, device=hidden_NH.device)
        lse_N = torch.empty_like(out_N)
        ent_N = torch.empty_like(out_N) if with_entropy else None
        z_buf = _block_buffer(min(rows, N), hidden_NH, weight_VH.shape[0])
        grads = _HeadGrads(hidden_NH, weight_VH, bias_V) if loss_grad is not None else None
        for t0 in range(0, N, rows):
            t1 = min(t0 + rows, N)
            z_cV = _block_logits(hidden_NH[t0:t1], weight_VH, bias_V, temperature, z_buf[: t1 - t0])
            picked_c = z_cV.gather(-1, ids_N[t0:t1, None]).squeeze(-1)
            if with_entropy:  # z_cV then holds exp(z - max), for the gradient below
                lse_c, ent_N[t0:t1], s_c = _block_lse_entropy(z_cV)
            else:
                lse_c, s_c = _block_lse_exp(z_cV)
            lse_N[t0:t1] = lse_c
            out_N[t0:t1] = picked_c - lse_c
            if grads is not None:  # softmax = e / s, already in the buffer
                g_c = loss_grad(index_N[t0:t1], out_N[t0:t1]).to(acc)
                grads.g_N[t0:t1] = g_c
                g_cV = z_cV.mul_((-g_c / s_c)[:, None]).scatter_add_(-1, ids_N[t0:t1, None], g_c[:, None])
                grads.add(t0, t1, g_cV if temperature == 1.0 else g_cV.div_(temperature))
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, ids_N, lse_N)
        ctx.temperature, ctx.rows, ctx.grads = temperature, rows, grads
        if with_entropy:
            ctx.mark_non_differentiable(ent_N)
        return out_N, ent_N

    @staticmethod
    def backward(ctx, grad_N, _grad_ent):
        hidden_NH, weight_VH, bias_V, ids_N, lse_N = ctx.saved_tensors
        grads, ctx.grads = ctx.grads, None
        need = ctx.needs_input_grad[:3]
        if grads is None or not torch.equal(grad_N.to(grads.g_N.dtype), grads.g_N):
            grads = _recompute_grads(hidden_NH, weight_VH, bias_V, ids_N, lse_N, grad_N, ctx.temperature,
                                     ctx.rows, need)  # fmt: skip
        return *grads.result(*need), None, None, None, None, None, None


def _recompute_grads(hidden_NH, weight_VH, bias_V, ids_N, lse_N, grad_N, tau, rows, need) -> _HeadGrads:
    """The head's gradients for the incoming ``grad_N``, each block's logits computed again."""
    grads = _HeadGrads(hidden_NH, weight_VH, bias_V, *need)
    N = hidden_NH.shape[0]
    z_buf = _block_buffer(min(rows, N), hidden_NH, weight_VH.shape[0])
    for t0 in range(0, N, rows):
        t1 = min(t0 + rows, N)
        g_c1 = grad_N[t0:t1, None].to(lse_N.dtype)
        z_cV = _block_logits(hidden_NH[t0:t1], weight_VH, bias_V, tau, z_buf[: t1 - t0])
        p_cV = z_cV.sub_(lse_N[t0:t1, None]).exp_()
        # d logp / d logits = (onehot - softmax) / tau, times the incoming gradient
        g_cV = p_cV.mul_(-g_c1).scatter_add_(-1, ids_N[t0:t1, None], g_c1)
        grads.add(t0, t1, g_cV if tau == 1.0 else g_cV.div_(tau))
    return grads


class _HeadGrads:
    """The gradients of hidden, head weight and bias, filled block by block from each block's
    ``d loss / d logits`` (``[c, V]``, the accumulation dtype)."""

    def __init__(self, hidden_NH, weight_VH, bias_V, need_h=None, need_w=None, need_b=None) -> None:
        self.hidden, self.weight = hidden_NH, weight_VH
        need_h = hidden_NH.requires_grad if need_h is None else need_h
        need_w = weight_VH.requires_grad if need_w is None else need_w
        need_b = bias_V is not None and (bias_V.requires_grad if need_b is None else need_b)
        acc = _acc_dtype(hidden_NH.dtype)
        self.g_N = torch.empty(hidden_NH.shape[0], dtype=acc, device=hidden_NH.device)
        self.h = torch.empty_like(hidden_NH) if need_h else None
        # Accumulate the LM-head gradient in float32 across blocks: summing bf16 partials loses bits.
        self.w = torch.zeros(weight_VH.shape, dtype=acc, device=weight_VH.device) if need_w else None
        self.b = torch.zeros(weight_VH.shape[0], dtype=acc, device=weight_VH.device) if need_b else None
        self.bias_dtype = None if bias_V is None else bias_V.dtype

    def add(self, t0: int, t1: int, g_cV: torch.Tensor) -> None:
        h_cH = self.hidden[t0:t1]
        if self.h is not None:
            self.h[t0:t1] = (g_cV.to(self.weight.dtype) @ self.weight).to(self.hidden.dtype)
        if self.w is not None:
            self.w.addmm_(g_cV.t(), h_cH.to(g_cV.dtype))
        if self.b is not None:
            self.b += g_cV.sum(dim=0)

    def result(self, need_h: bool, need_w: bool, need_b: bool) -> tuple:
        return (
            self.h if need_h else None,
            self.w.to(self.weight.dtype) if need_w and self.w is not None else None,
            self.b.to(self.bias_dtype) if need_b and self.b is not None else None,
        )


def _block_buffer(rows: int, like: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """One ``[rows, V]`` block (V: ``vocab``, else ``like``'s last dim) in the accumulation dtype of
    ``like``, reused by every block of a pass: a fresh block per iteration costs its page faults
    again on the CPU (tens of MiB are mmapped and returned by malloc each time), a third of the
    head's forward time at a 152k vocabulary."""
    shape = (rows, like.shape[-1] if vocab is None else vocab)
    return torch.empty(shape, dtype=_acc_dtype(like.dtype), device=like.device)


def _tempered(logits_cV: torch.Tensor, tau: float, out_cV: torch.Tensor) -> torch.Tensor:
    """``logits / tau`` in the accumulation dtype, written into ``out_cV`` (the upcast is exact, so
    this is ``logits.to(acc) / tau``)."""
    out_cV.copy_(logits_cV)
    return out_cV if tau == 1.0 else out_cV.div_(tau)


def _block_logits(
    h_cH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    tau: float,
    out_cV: torch.Tensor,
) -> torch.Tensor:
    """``(h @ W.T + b) / tau`` written into ``out_cV`` (``[c, V]``, the accumulation dtype)."""
    if h_cH.dtype == out_cV.dtype and weight_VH.dtype == out_cV.dtype:
        torch.matmul(h_cH, weight_VH.t(), out=out_cV)
    else:  # bf16/fp16: the matmul in the inputs' dtype, upcast into the buffer
        out_cV.copy_(h_cH @ weight_VH.t())
    if bias_V is not None:
        out_cV.add_(bias_V)
    return out_cV if tau == 1.0 else out_cV.div_(tau)


def _block_lse(z_cV: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` per row as ``m + log sum exp(z - m)``, the exp written over ``z_cV`` (which the
    caller no longer needs): ``torch.logsumexp`` computes the same but allocates a temporary of the
    block's size, 2.7x slower for a 128 MiB block on this CPU (page faults again)."""
    return _block_lse_exp(z_cV)[0]


def _block_lse_exp(z_cV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_block_lse` and ``s = sum exp(z - m)`` per row; ``z_cV`` then holds ``e = exp(z - m)``,
    so ``e / s`` is the block's softmax."""
    m_c1 = z_cV.amax(dim=-1, keepdim=True)
    s_c = z_cV.sub_(m_c1).exp_().sum(dim=-1)
    return m_c1.squeeze(-1) + s_c.log(), s_c


def _block_lse_entropy(z_cV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of a block of (tempered) logits, ``lse = m + log s``, the entropy
    ``H = log s - sum_v e_v (z_v - m) / s`` and ``s``, with ``m = max z``, ``e = exp(z - m)``,
    ``s = sum e``: one exp pass serves both. ``z_cV`` then holds ``e`` (``e / s`` is the block's
    softmax). The exp runs over column pieces of :data:`ENTROPY_PIECE`, each written back over its
    ``z - m`` once the entropy's sum has used it, so the block needs no second ``[c, V]`` buffer."""
    m_c1 = z_cV.amax(dim=-1, keepdim=True)
    zm_cV = z_cV.sub_(m_c1)
    c, V = zm_cV.shape
    s_c = zm_cV.new_zeros(c)
    dot_c = zm_cV.new_zeros(c)
    piece = zm_cV.new_empty((c, min(ENTROPY_PIECE, V)))
    lowest = torch.finfo(zm_cV.dtype).min
    for v0 in range(0, V, ENTROPY_PIECE):
        zm_cP = zm_cV[:, v0 : v0 + ENTROPY_PIECE]
        e_cP = torch.exp(zm_cP, out=piece[:, : zm_cP.shape[1]])
        s_c += e_cP.sum(dim=-1)
        # a -inf logit (a masked vocabulary entry) has e = 0 and adds 0 (0 log 0 = 0), not 0 * -inf
        dot_c += torch.linalg.vecdot(e_cP, zm_cP.clamp_(min=lowest))
        zm_cP.copy_(e_cP)
    log_s_c = s_c.log()
    return m_c1.squeeze(-1) + log_s_c, log_s_c - dot_c.div_(s_c), s_c


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Compute in float32 at least: bf16/fp16 inputs are upcast per block, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor, *, temperature: float = 1.0, block_tokens: int | None = None
) -> torch.Tensor:
    r"""Entropy of softmax(logits / temperature) per position, block by block, without gradients.

    :math:`H_t = \mathrm{logsumexp}(z_t) - \sum_v \mathrm{softmax}(z_t)_v z_{t,v}` with ``z = logits / tau``.
    A monitoring metric (entropy collapse), hence no backward.

    Args:
        logits: ``[B, T, V]``.

    Returns:
        ``[B, T]`` in float32 (float64 for float64 logits).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    B, T, V = logits.shape
    acc = _acc_dtype(logits.dtype)
    out_BT = torch.empty(B, T, dtype=acc, device=logits.device)
    rows = _block_rows(V, block_tokens)
    z_buf = _block_buffer(min(rows, T), logits)
    for b, t0, t1 in _blocks(B, T, rows):
        z_cV = _tempered(logits[b, t0:t1], temperature, z_buf[: t1 - t0])
        out_BT[b, t0:t1] = _block_lse_entropy(z_cV)[1]
    return out_BT


@torch.no_grad()
def hidden_token_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    block_tokens: int | None = None,
) -> torch.Tensor:
    r""":func:`token_entropy` of ``(hidden @ weight.T + bias) / temperature``, one block of tokens at a
    time, so the logits never exist in full (the companion of :func:`hidden_token_logprobs`).

    Returns ``[B, T]`` in float32 (float64 for float64 inputs); no gradient.
    """
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [B, T, H] and weight [V, H]; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    B, T, H = hidden.shape
    h_NH, rows = hidden.reshape(B * T, H), _block_rows(weight.shape[0], block_tokens)
    out_N = torch.empty(B * T, dtype=_acc_dtype(hidden.dtype), device=hidden.device)
    z_buf = _block_buffer(min(rows, B * T), h_NH, weight.shape[0])
    for t0 in range(0, B * T, rows):
        t1 = min(t0 + rows, B * T)
        z_cV = _block_logits(h_NH[t0:t1], weight, bias, temperature, z_buf[: t1 - t0])
        out_N[t0:t1] = _block_lse_entropy(z_cV)[1]
    return out_N.view(B, T)
