"""Attention for micro-batches that hold each prompt once (``train.share_prompts``).

What it does: ``train.batch.collate_shared`` lays the rows of one prompt out as one sequence
``[prompt | completion_1 | ... | completion_k | padding]``. A completion token must see the prompt
and the earlier tokens of its own completion only. A dense ``[S, S]`` mask over that sequence says
so, but the attention kernel then scores every query against every key of all ``k`` completions
(on SmolLM2's recipe, 8 rows of 96 tokens after a 90-token prompt: 858^2 pairs, 4.9x the ones
computed below, and 26% of a training forward + backward in the profile). :class:`SharedLayout`
instead indexes where each prompt's and each row's tokens sit, and :func:`shared_prompt_attention`
computes two smaller attentions from it, each through ``F.scaled_dot_product_attention``:

- each prompt's tokens, causally among themselves, once per prompt: ``[groups, P, P]`` pairs;
- each row's completion tokens against ``[its prompt | its own tokens]``, causal within its own:
  ``[rows, W, P + W]`` pairs, the padded layout's pairs less the prompt's queries repeated per row.

Every real token's softmax runs over the keys the dense mask allows, so the outputs are the dense
mask's (tested in float64, with their gradients, through the trainer's loss). The grouped-query
heads of one key head are one block of queries (``[rows, K, rep * W, D]``), so keys and values are
never repeated per head.

How it is used: :func:`routed` switches a model's attention implementation to this one for the
forward and backward of a shared micro-batch (gradient checkpointing recomputes inside the
backward), and the model is called with ``shared_layout=`` among its keyword arguments, which
transformers' Llama-family layers pass on to the attention function. Any other call (no layout)
goes to transformers' own SDPA attention unchanged.

What it deliberately does not do: apply a sliding window (the caller shares only rows that fit in
it, so the window cuts nothing), dropout patterns equal to the dense path's, or any attention
implementation but SDPA.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

IMPLEMENTATION = "grpokit_shared_prompts"


class SharedLayout:
    """Where the tokens of a shared micro-batch ``[groups, S]`` sit, as flat indices ``g * S + s``.

    ``prompt_lengths[g]``: prompt ``g`` fills positions ``[0, P_g)`` of its sequence; ``rows[j]``
    = ``(g, start, n)``: row ``j``'s ``n`` completion tokens fill ``[start, start + n)`` of sequence
    ``g``. Positions that are neither are padding: their attention output is 0, and no real token
    attends to them. Shapes: P the longest prompt, W the longest completion (at least 1), R rows.
    """

    def __init__(self, prompt_lengths: list[int], rows: list[tuple[int, int, int]], S: int) -> None:
        g, R = len(prompt_lengths), len(rows)
        P, W = max(prompt_lengths), max([1] + [n for *_, n in rows])
        lengths_g = torch.tensor(prompt_lengths)
        group_r, start_r, n_r = (torch.tensor(col, dtype=torch.long) for col in zip(*rows, strict=True))
        p, t = torch.arange(P), torch.arange(W)
        prompt_ok = p < lengths_g[:, None]  # [g, P]
        # padded slots point at a real token of the same sequence (masked, or their output dropped)
        self.prompt_index = torch.arange(g)[:, None] * S + torch.where(prompt_ok, p, 0)  # [g, P]
        causal_P = torch.ones(P, P, dtype=torch.bool).tril()
        # [g, 1, P, P]; a padded query sees itself, so no softmax row is empty
        self.prompt_mask = (causal_P & (prompt_ok[:, None, :] | torch.eye(P, dtype=torch.bool)))[:, None]
        own_ok = t < n_r[:, None]  # [R, W]
        self.row_index = group_r[:, None] * S + torch.where(own_ok, start_r[:, None] + t, 0)  # [R, W]
        self.key_index = torch.cat([self.prompt_index[group_r], self.row_index], dim=1)  # [R, P + W]
        prompt_keys = prompt_ok[group_r][:, None, :].expand(R, W, P)
        own_keys = torch.ones(W, W, dtype=torch.bool).tril().expand(R, W, W)
        self.row_mask = torch.cat([prompt_keys, own_keys], dim=2)[:, None]  # [R, 1, W, P + W]
        # each position's output: a prompt's [g * P], then the rows' [R * W], then a zero (padding)
        inverse = torch.full((g * S,), g * P + R * W, dtype=torch.long)
        inverse[self.prompt_index[prompt_ok]] = (torch.arange(g)[:, None] * P + p)[prompt_ok]
        inverse[self.row_index[own_ok]] = (torch.arange(R)[:, None] * W + g * P + t)[own_ok]
        self.inverse = inverse
        self._masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def to(self, device: torch.device) -> SharedLayout:
        for name in ("prompt_index", "prompt_mask", "row_index", "key_index", "row_mask", "inverse"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def masks(self, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt and row masks for ``rep`` query heads per key head (their queries stacked,
        head-major), built once per micro-batch and reused by every layer."""
        if rep not in self._masks:
            self._masks[rep] = (self.prompt_mask.repeat(1, 1, rep, 1), self.row_mask.repeat(1, 1, rep, 1))
        return self._masks[rep]


def shared_prompt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    shared_layout: SharedLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[g, H, S, D]``, ``key`` and ``value``
    ``[g, K, S, D]``; returns ``[g, S, H, D]``. Without ``shared_layout``: transformers' SDPA
    attention, as if this module were not there."""
    if shared_layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    layout = shared_layout
    g, H, S, D = query.shape
    K = key.shape[1]
    rep = H // K
    # token-major [g * S, heads, D]: views of the projections' own layout (HF transposed them)
    q, k, v = (x.transpose(1, 2).reshape(g * S, x.shape[1], D) for x in (query, key, value))
    prompt_mask, row_mask = layout.masks(rep)

    def attend(index_q: torch.Tensor, index_kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The queries at ``index_q`` [n, L] against the keys and values at ``index_kv``; [n * L, H, D]."""
        n, L = index_q.shape
        q_nLKrD = q.index_select(0, index_q.flatten()).view(n, L, K, rep, D)
        q_nKQD = q_nLKrD.permute(0, 2, 3, 1, 4).reshape(n, K, rep * L, D)  # Q = rep * L, head-major
        keys = index_kv.flatten()
        k_nKLD, v_nKLD = (x.index_select(0, keys).view(n, -1, K, D).transpose(1, 2) for x in (k, v))
        out = F.scaled_dot_product_attention(q_nKQD, k_nKLD, v_nKLD, mask, dropout, scale=scaling)
        return out.view(n, K, rep, L, D).permute(0, 3, 1, 2, 4).reshape(n * L, H, D)

    prompts = attend(layout.prompt_index, layout.prompt_index, prompt_mask)
    rows = attend(layout.row_index, layout.key_index, row_mask)
    flat = torch.cat([prompts, rows, rows.new_zeros(1, H, D)])
    return flat.index_select(0, layout.inverse).view(g, S, H, D), None


@contextlib.contextmanager
def routed(model):
    """Within this context ``model``'s attention layers call :func:`shared_prompt_attention`
    (registered with transformers' ``AttentionInterface`` on first use, with SDPA's mask builder
    for the calls that pass no layout); the implementation it had is restored on exit. Cover the
    backward as well as the forward: gradient checkpointing runs the layers again inside it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from grpokit.models.loading import hf_model

    AttentionInterface.register(IMPLEMENTATION, shared_prompt_attention)
    # the masks of calls without a layout are SDPA's (a shared call's empty 4D mask is returned as is)
    AttentionMaskInterface.register(IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config = hf_model(model).config
    before = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = before
