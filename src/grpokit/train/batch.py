"""From a scored rollout to gradients: micro-batch planning, collation, log-probs, accumulated backward.

What it does:
- ``plan_micro_batches`` groups rows of similar length (longest first) under a row cap and an
  optional padded-token budget, so padding costs little;
- ``collate`` lays one micro-batch out as ``[left pad | prompt | completion | right pad]``, or with
  ``packed`` (``train.packing``) padding-free: the rows' ``[prompt | completion]`` end to end in
  bins no longer than its longest row, positions restarting at 0 per sequence, no attention mask:
  the model's own mask builder (transformers' packed-sequence detection) then keeps every sequence
  to itself; packed gradients equal padded ones (tested in float64);
- ``completion_logprobs`` runs the model and returns the completion tokens' log-probs at the
  sampling temperature (logits only for completion positions; ``algo.token_logprobs``);
- ``accumulate_policy_gradient`` runs forward/backward over the plan with the loss normalised by
  the *whole batch's* sequence and token counts, so the accumulated gradient equals the
  full-batch gradient whatever the micro-batch split (tested).

Under torchrun (``dist``) the counts are summed over ranks and plans are padded to the longest
rank's with empty micro-batches (``[]``): a forward on a stand-in row that contributes nothing, so
every rank runs the same passes (train/distributed.py says why).

What it deliberately does not do: step the optimizer, sample, or score (the trainer sequences those).

Shape legend: B rows (completions), T completion width, b rows in a micro-batch, L prompt width.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from grpokit.algo import (
    LossSpec,
    hidden_token_logprobs,
    policy_loss,
    token_entropy,
    token_logprobs,
)
from grpokit.algo.correction import mismatch_stats
from grpokit.algo.logprobs import LossGrad
from grpokit.models.loading import SharingCosts, accepts_kwarg, head_returns_hidden
from grpokit.models.shared_prompts import SharedLayout, routed
from grpokit.rollout.sampler import Rollout
from grpokit.train.distributed import Dist, grad_sync

# Per-token metrics of a micro-batch, averaged over the batch weighted by token counts.
_TOKEN_METRICS = ("kl", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio_mean", "entropy")
_NAN = float("nan")


@dataclass(frozen=True)
class UpdateStats:
    """What one optimizer step's forward/backward passes measured. The token metrics are means over
    the step's loss tokens, NaN when it had none (e.g. every completion of the part truncated under
    ``algo.mask_truncated_completions``); ``loss`` is then 0."""

    loss: float
    num_tokens: int
    kl: float = _NAN
    clip_fraction: float = _NAN
    clip_fraction_low: float = _NAN
    clip_fraction_high: float = _NAN
    ratio_mean: float = _NAN
    ratio_max: float = _NAN
    entropy: float = _NAN
    grad_norm: float = 0.0
    # optimizer steps skipped because the gradient norm was NaN or inf (the weights were kept)
    nonfinite_grad_steps: int = 0
    # sampler vs trainer log-probs (``mismatch_logp``): sums over the compared tokens
    mismatch_abs_sum: float = 0.0
    mismatch_outside: float = 0.0
    mismatch_tokens: int = 0
    # rows trained (``rows``) and those of them whose micro-batch computed its prompt once
    # (``train.share_prompts``), over the ranks and optimizer steps
    rows: int = 0
    shared_rows: int = 0

    @staticmethod
    def combine(steps: list[UpdateStats]) -> UpdateStats:
        """One generation's steps as one: ``loss`` and ``grad_norm`` averaged over the steps, the
        token metrics weighted by each step's tokens (steps without tokens add nothing), ``ratio_max``
        the largest."""
        tokens = sum(s.num_tokens for s in steps)
        weighted = {
            key: sum(getattr(s, key) * s.num_tokens for s in steps if s.num_tokens) / tokens
            if tokens
            else _NAN
            for key in _TOKEN_METRICS
        }
        ratio_max = max((s.ratio_max for s in steps if s.num_tokens), default=_NAN)
        return UpdateStats(
            loss=sum(s.loss for s in steps) / len(steps),
            num_tokens=tokens,
            ratio_max=ratio_max,
            grad_norm=sum(s.grad_norm for s in steps) / len(steps),
            nonfinite_grad_steps=sum(s.nonfinite_grad_steps for s in steps),
            mismatch_abs_sum=sum(s.mismatch_abs_sum for s in steps),
            mismatch_outside=sum(s.mismatch_outside for s in steps),
            mismatch_tokens=sum(s.mismatch_tokens for s in steps),
            rows=sum(s.rows for s in steps),
            shared_rows=sum(s.shared_rows for s in steps),
            **weighted,
        )


@dataclass
class TrainBatch:
    """The rows one optimizer step trains on."""

    prompt_ids: list[torch.Tensor]  # [B] unpadded prompt ids of each row (shared within a group)
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] bool: tokens that get a loss (the model's own)
    advantages: torch.Tensor  # [B]
    # [B, T] bool: the tokens in the context (the model's and an environment's); None: completion_mask
    token_mask: torch.Tensor | None = None

    @classmethod
    def from_rollout(cls, rollout: Rollout, advantages: torch.Tensor, loss_mask: torch.Tensor | None = None):
        prompts = [ids[m] for ids, m in zip(rollout.prompt_ids, rollout.prompt_mask, strict=True)]
        rows = [prompts[i // rollout.group_size] for i in range(rollout.num_rows)]
        mask = rollout.trained_mask if loss_mask is None else loss_mask
        context = None if rollout.model_mask is None and loss_mask is None else rollout.completion_mask
        return cls(rows, rollout.completion_ids, mask, advantages, context)

    @property
    def num_rows(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def context_mask(self) -> torch.Tensor:  # [B, T] bool: the completion tokens the model sees
        return self.completion_mask if self.token_mask is None else self.token_mask

    def total_lengths(self) -> list[int]:
        comp = self.context_mask.sum(dim=1).tolist()
        return [len(p) + c for p, c in zip(self.prompt_ids, comp, strict=True)]


@dataclass
class MicroBatch:
    rows: torch.Tensor  # [b] indices into the TrainBatch
    input_ids: torch.Tensor  # [b, L + T'] (packed: [bins, N])
    # [b, L + T']; packed: None (positions delimit sequences); shared: an empty [groups, 1, 0, 0]
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor  # [b, L + T'] (packed: [bins, N], 0 at each sequence's start)
    prompt_width: int  # L
    completion_ids: torch.Tensor  # [b, T'] (T' = longest completion in this micro-batch)
    completion_mask: torch.Tensor  # [b, T'] bool
    # packed: [b, T'] where in the flattened [bins * N] positions completion token t is predicted
    gather: torch.Tensor | None = None
    layout: SharedLayout | None = None  # shared: where each prompt's and row's tokens sit

    @property
    def shared(self) -> bool:
        """Laid out by :func:`collate_shared`: each prompt once, ``layout`` keeping rows apart."""
        return self.layout is not None


def plan_micro_batches(lengths: list[int], max_rows: int, max_tokens: int | None = None) -> list[list[int]]:
    """Rows sorted by length (longest first, ties by index) and packed greedily.

    A micro-batch holds at most ``max_rows`` rows and, if ``max_tokens`` is set, at most
    ``max_tokens`` padded tokens (rows x its longest row). A single row longer than the budget
    gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    for i in order:
        cur = plan[-1] if plan else None
        fits = cur is not None and len(cur) < max_rows
        if fits and max_tokens is not None:
            fits = lengths[cur[0]] * (len(cur) + 1) <= max_tokens  # cur[0] is its longest row
        if fits:
            cur.append(i)
        else:
            plan.append([i])
    return plan


def plan_groups(
    lengths: list[int], group_size: int, max_rows: int, max_tokens: int | None = None
) -> list[list[int]]:
    """Like :func:`plan_micro_batches`, but a prompt's rows (``group_size`` consecutive rows) stay
    in one micro-batch, so ``train.share_prompts`` computes the prompt once for all of them: groups,
    longest first, packed greedily under the same caps; a group of more than ``max_rows`` rows is
    cut into chunks of ``max_rows``."""
    chunks = []
    for g0 in range(0, len(lengths), group_size):
        rows = sorted(range(g0, min(g0 + group_size, len(lengths))), key=lambda i: (-lengths[i], i))
        chunks += [rows[c : c + max_rows] for c in range(0, len(rows), max_rows)]
    chunks.sort(key=lambda chunk: (-lengths[chunk[0]], chunk[0]))
    plan: list[list[int]] = []
    for chunk in chunks:
        cur = plan[-1] if plan else None
        fits = cur is not None and len(cur) + len(chunk) <= max_rows
        if fits and max_tokens is not None:
            fits = lengths[cur[0]] * (len(cur) + len(chunk)) <= max_tokens  # cur[0] is its longest row
        if fits:
            cur.extend(chunk)
        else:
            plan.append(list(chunk))
    return plan


def plan_optimizer_steps(
    lengths: list[int],
    group_size: int,
    steps: int,
    max_rows: int,
    max_tokens: int | None = None,
    *,
    keep_empty: bool = False,
    keep_groups: bool = False,
) -> list[list[list[int]]]:
    """One micro-batch plan per optimizer step of an inner epoch: the rows split into ``steps``
    parts of whole groups (``train.steps_per_generation``), each planned by ``plan_micro_batches``
    (``keep_groups``: by :func:`plan_groups`, for ``train.share_prompts``).

    ``keep_empty`` (under torchrun) keeps a part with no rows as an empty plan, padded later, so
    every rank makes the same number of optimizer steps."""
    groups, G = len(lengths) // group_size, group_size
    parts = [list(range(k * groups // steps * G, (k + 1) * groups // steps * G)) for k in range(steps)]
    plans = []
    for rows in (p for p in parts if p or keep_empty):
        part = [lengths[r] for r in rows]
        local = (
            plan_groups(part, G, max_rows, max_tokens)
            if keep_groups
            else plan_micro_batches(part, max_rows, max_tokens)
        )
        plans.append([[rows[i] for i in mb] for mb in local])
    return plans


def collate(
    batch: TrainBatch,
    rows: list[int],
    pad_id: int,
    device: torch.device,
    packed: bool = False,
    share: SharingCosts | None = None,
) -> MicroBatch:
    """Left-padded prompts + right-padded completions of ``rows``. Attention and positions follow the
    context mask (an episode's environment tokens are context); ``completion_mask`` is the loss mask.
    ``share`` (the model's costs, :func:`grpokit.models.loading.prompt_sharing_costs`): each prompt
    once (:func:`collate_shared`) where :func:`sharing_pays` and every row fits in the model's
    sliding window (the shared attention does not cut it); else ``packed``: padding-free
    (:func:`collate_packed`)."""
    if share is not None and _fits_window(batch, rows, share.window):
        groups = _prompt_groups(batch, rows)
        if sharing_pays(batch, rows, share, groups):
            return collate_shared(batch, rows, pad_id, device, groups)
    if packed:
        return collate_packed(batch, rows, pad_id, device)
    context = batch.context_mask[rows]
    width = max(int(context.sum(dim=1).max()), 1)
    comp_ids, context = batch.completion_ids[rows, :width], context[:, :width]
    comp_mask = batch.completion_mask[rows, :width]
    prompts = [batch.prompt_ids[r] for r in rows]
    L = max(len(p) for p in prompts)
    b = len(rows)
    input_ids = torch.full((b, L + width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, L + width), dtype=torch.long)
    for j, p in enumerate(prompts):
        input_ids[j, L - len(p) : L] = p
        attn[j, L - len(p) : L] = 1
    input_ids[:, L:] = torch.where(context, comp_ids, torch.full_like(comp_ids, pad_id))
    attn[:, L:] = context.long()
    positions = (attn.cumsum(dim=1) - 1).clamp(min=0)
    return MicroBatch(
        torch.tensor(rows),
        input_ids.to(device),
        attn.to(device),
        positions.to(device),
        L,
        comp_ids.to(device),
        comp_mask.to(device),
    )


def _prefix_completions(
    batch: TrainBatch, rows: list[int], layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the layouts that lay each row's context end to end (``layout`` names it in the error):
    the rows' context lengths ``[b]``, completion ids and loss mask ``[b, T']`` cut to the longest.
    Their context tokens must be a prefix of the completion (no gaps to skip)."""
    context = batch.context_mask[rows]
    lengths = context.sum(dim=1)
    width = max(int(lengths.max()), 1)
    if not bool((context[:, :width] == (torch.arange(width) < lengths[:, None])).all()):
        raise ValueError(f"{layout} needs each row's context tokens to be a prefix of its completion")
    return lengths, batch.completion_ids[rows, :width], batch.completion_mask[rows, :width]


def collate_packed(batch: TrainBatch, rows: list[int], pad_id: int, device: torch.device) -> MicroBatch:
    """``rows`` without padding: each row's ``[prompt | completion]`` laid end to end in bins of the
    longest row's length (first fit, longest first), position ids restarting at 0 for every sequence
    and counting up through the bin's unused tail (a sequence of its own, after every real token, so
    never attended). ``gather`` maps each completion token to the position that predicts it."""
    lengths, comp_ids, comp_mask = _prefix_completions(batch, rows, "packing")
    width = comp_ids.shape[1]
    seqs = [torch.cat([batch.prompt_ids[r], comp_ids[j, : int(lengths[j])]]) for j, r in enumerate(rows)]
    N = max(len(s) for s in seqs)
    bins: list[list[int]] = []
    used: list[int] = []
    for j in sorted(range(len(seqs)), key=lambda j: (-len(seqs[j]), j)):
        k = next((k for k, u in enumerate(used) if u + len(seqs[j]) <= N), len(bins))
        if k == len(bins):
            bins.append([])
            used.append(0)
        bins[k].append(j)
        used[k] += len(seqs[j])
    input_ids = torch.full((len(bins), N), pad_id, dtype=torch.long)
    positions = torch.zeros((len(bins), N), dtype=torch.long)
    gather = torch.zeros((len(rows), width), dtype=torch.long)  # beyond a row's length: masked anyway
    for k, members in enumerate(bins):
        at = 0
        for j in members:
            n, P = len(seqs[j]), len(batch.prompt_ids[rows[j]])
            input_ids[k, at : at + n] = seqs[j]
            positions[k, at : at + n] = torch.arange(n)
            gather[j, : n - P] = k * N + at + P - 1 + torch.arange(n - P)  # the logits before token t
            at += n
        positions[k, at:] = torch.arange(N - at)
    return MicroBatch(
        torch.tensor(rows),
        input_ids.to(device),
        None,
        positions.to(device),
        0,
        comp_ids.to(device),
        comp_mask.to(device),
        gather.to(device),
    )


def completion_logprobs(
    model,
    mb: MicroBatch,
    temperature: float,
    with_entropy: bool = False,
    fused_head: bool = False,
    loss_grad: LossGrad | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[b, T']`` of the completion tokens (and their entropies) under ``model``.

    The logits at position L-1+t predict completion token t; only those T' positions (plus the
    last) are projected to the vocabulary when the model supports ``logits_to_keep``. With
    ``fused_head`` (``models.loading.fused_head_reason`` says the model allows it) the head returns
    the hidden states instead and ``hidden_token_logprobs`` projects the completion-mask tokens
    block by block, in float32 outside autocast: the [b, T', V] logits and their gradient never
    exist, and the log-prob (and entropy) of a padded position is 0. ``loss_grad`` (fused head
    only; :func:`token_loss_grad`) computes the head's gradients in the same blocks.
    """
    T = mb.completion_ids.shape[1]
    kw = {"logits_to_keep": T + 1} if accepts_kwarg(model, "logits_to_keep") else {}
    if mb.gather is not None:  # packed: every position's output, then each completion token's own
        kw = {}
    if mb.layout is not None:  # shared: the layers' attention reads it (under models.shared_prompts.routed)
        kw["shared_layout"] = mb.layout
    with head_returns_hidden(model) if fused_head else contextlib.nullcontext() as head:
        out = model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            use_cache=False,
            **kw,
        ).logits
    if mb.gather is not None:
        out_bT = out.flatten(0, 1)[mb.gather]
    elif kw:
        out_bT = out[:, :T]
    else:
        out_bT = out[:, mb.prompt_width - 1 : mb.prompt_width - 1 + T]
    if not fused_head:
        logp = token_logprobs(out_bT, mb.completion_ids, temperature=temperature)
        entropy = token_entropy(out_bT.detach(), temperature=temperature) if with_entropy else None
        return logp, entropy
    weight, bias = head.weight, head.bias
    if type(weight.data) is not torch.Tensor:  # FSDP2 resharded its root unit after the forward
        raise RuntimeError(
            "the output head's weight is still sharded after the model's forward, so log-probs cannot "
            "be computed from the hidden states; set model.fused_logprobs: false"
        )
    with torch.autocast(out_bT.device.type, enabled=False):  # the head in float32, as keep_head_float32
        hidden = out_bT.to(weight.dtype)
        # only the loss's tokens are projected (padding costs nothing); entropy from the same blocks
        out = hidden_token_logprobs(
            hidden, weight, mb.completion_ids, bias=bias, temperature=temperature,
            mask=mb.completion_mask, return_entropy=with_entropy, loss_grad=loss_grad,
        )  # fmt: skip
    return out if with_entropy else (out, None)


@torch.no_grad()
def batch_logprobs(
    model,
    batch: TrainBatch,
    plan: list[list[int]],
    pad_id: int,
    temperature: float,
    dist: Dist | None = None,
    fused_head: bool = False,
    packed: bool = False,
    share: SharingCosts | None = None,
) -> torch.Tensor:
    """``[B, T]`` log-probs of every completion token under ``model`` (for pi_old and pi_ref), no grad."""
    param = next(model.parameters())
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.promote_types(param.dtype, torch.float32))
    for rows in (dist or Dist()).pad_plan(plan):
        mb = collate(batch, rows or [0], pad_id, param.device, packed, share)
        with routed(model) if mb.shared else contextlib.nullcontext():
            logp, _ = completion_logprobs(model, mb, temperature, fused_head=fused_head)
        if rows:  # an empty micro-batch only keeps the ranks' forward passes in step
            out[rows, : logp.shape[1]] = logp.cpu()
    return out


def accumulate_policy_gradient(
    model,
    batch: TrainBatch,
    plan: list[list[int]],
    pad_id: int,
    *,
    temperature: float,
    loss: LossSpec,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy_top_q: float | None = None,
    is_weights: torch.Tensor | None = None,
    mismatch_logp: torch.Tensor | None = None,
    dump_path: Path | None = None,
    dist: Dist | None = None,
    fused_head: bool = False,
    packed: bool = False,
    share: SharingCosts | None = None,
) -> UpdateStats:
    """Forward + backward over every micro-batch of ``plan``; gradients accumulate in ``.grad``.

    The loss of each micro-batch is normalised by the counts of *all the rows of the plan* (one
    optimizer step), so the accumulated gradient is the gradient of that step's full loss.

    Args:
        loss: the loss's options (clip, beta, aggregation, ...), :class:`grpokit.algo.LossSpec`.
        old_logp: ``[B, T]`` sampling-policy log-probs; None means pi_old is the current policy
            (one inner step per generation) and ``logp.detach()`` is used: no extra forward pass.
        ref_logp: ``[B, T]`` reference log-probs, or None.
        entropy_top_q: train only on this top fraction of each micro-batch's tokens by entropy
            ("Beyond the 80/20 rule", Wang et al. 2025, arXiv:2506.01939); the denominators still
            count every token. None: all tokens.
        is_weights: ``[B, T]`` rollout-correction weights multiplying each token's policy-gradient
            term (``algo.correction_weights``), or None.
        mismatch_logp: ``[B, T]`` the sampler's log-probs, compared with this pass's own (which are
            pi_old when the plan is the generation's only optimizer step): the sums go into the
            returned ``mismatch_*`` fields. None: not measured here.
        dump_path: write the first micro-batch's inputs and loss here (``train.dump_tensors``).
        fused_head: log-probs from hidden states and the head (:func:`completion_logprobs`).
        packed: padding-free micro-batches (:func:`collate_packed`, ``train.packing``).
        share: each prompt computed once per micro-batch where it pays (:func:`collate`,
            ``train.share_prompts``).
        dist: under torchrun, ``model`` is the DDP / FSDP module: counts and metrics are summed over
            ranks, gradients are synchronised once (in the last micro-batch's backward), and the
            loss is scaled by the world size because DDP and FSDP average gradients over ranks.

    Returns:
        :class:`UpdateStats`: token-weighted means over the batch (all ranks) of the loss metrics
        and ``entropy`` (NaN without loss tokens), and ``loss`` (the full loss: the sum of the
        globally normalised micro-batch losses).
    """
    d = dist or Dist()
    mask_all = batch.completion_mask[[r for rows in plan for r in rows]]
    num_sequences, num_tokens, num_micro_batches = d.sum(
        [float(mask_all.any(dim=1).sum()), float(mask_all.sum()), float(sum(1 for rows in plan if rows))]
    )
    counts = dict(
        num_sequences=int(num_sequences), num_tokens=int(num_tokens), num_micro_batches=int(num_micro_batches)
    )
    plan = d.pad_plan(plan)
    sums = dict.fromkeys(_TOKEN_METRICS, 0.0)
    loss_total, ratio_max, tokens = 0.0, float("-inf"), 0
    mismatch = [0.0, 0.0, 0.0]  # |diff| sum, tokens outside [0.9, 1.1], tokens
    layout = [0.0, 0.0]  # rows, rows in a shared-prompt micro-batch
    for k, rows in enumerate(plan):
        sync = grad_sync(model, enabled=k == len(plan) - 1)
        # a micro-batch that is not shared passes no layout: transformers' SDPA attention then
        with sync, routed(model) if share else contextlib.nullcontext():
            stats = _micro_batch_backward(
                model, batch, rows, pad_id, temperature, loss, counts, old_logp, ref_logp,
                entropy_top_q, is_weights, mismatch_logp, dump_path if k == 0 else None, d.world_size,
                fused_head, packed, share,
            )  # fmt: skip
        if stats is None:
            continue
        layout = [layout[0] + len(rows), layout[1] + stats.pop("shared") * len(rows)]
        mismatch = [a + b for a, b in zip(mismatch, stats.pop("mismatch"), strict=True)]
        loss_total += stats.pop("loss")
        n = int(stats.pop("num_tokens"))
        tokens += n
        ratio_max = max(ratio_max, stats.pop("ratio_max"))
        for key in _TOKEN_METRICS:
            sums[key] += stats[key] * n
    loss_total, tokens, *values = d.sum(
        [loss_total, float(tokens), *layout, *mismatch, *(sums[key] for key in _TOKEN_METRICS)]
    )
    layout, mismatch, values = values[:2], values[2:5], values[5:]
    ratio_max, tokens = d.max(ratio_max), int(tokens)
    seen = dict(mismatch_abs_sum=mismatch[0], mismatch_outside=mismatch[1], mismatch_tokens=int(mismatch[2]))
    seen.update(rows=int(layout[0]), shared_rows=int(layout[1]))
    if not tokens:
        return UpdateStats(loss=loss_total, num_tokens=0, **seen)
    means = {key: v / tokens for key, v in zip(_TOKEN_METRICS, values, strict=True)}
    return UpdateStats(loss=loss_total, num_tokens=tokens, ratio_max=ratio_max, **means, **seen)


def _micro_batch_backward(
    model, batch, rows, pad_id, temperature, spec, counts, old_logp, ref_logp, entropy_top_q,
    is_weights, mismatch_logp, dump_path, world_size, fused_head, packed, share,
) -> dict | None:  # fmt: skip
    """Forward + backward of one micro-batch; its metrics, or None when it has no tokens. An empty
    ``rows`` runs a stand-in row with its loss multiplied by 0 (the ranks' passes stay in step)."""
    device = next(model.parameters()).device
    dummy = not rows
    rows = rows or [0]
    mb = collate(batch, rows, pad_id, device, packed, share)
    T = mb.completion_ids.shape[1]
    old = None if old_logp is None else old_logp[rows, :T].to(device)
    ref = None if ref_logp is None else ref_logp[rows, :T].to(device)
    adv = batch.advantages[rows].to(device)
    weights = None if is_weights is None else is_weights[rows, :T].to(device)
    # DDP / FSDP average the ranks' gradients; each rank's loss is already normalised by the global
    # counts, so scaling by the world size makes the average the whole batch's gradient.
    scale = 0.0 if dummy else float(world_size)
    # the entropy-top-q mask needs every token's entropy before any gradient: no fused loss then
    fused_loss = fused_head and spec.token_separable and entropy_top_q is None
    loss_grad = None
    if fused_loss:
        loss_grad = token_loss_grad(spec, counts, mb.completion_mask, old, ref, adv, weights, scale)
    logp, entropy = completion_logprobs(
        model, mb, temperature, with_entropy=True, fused_head=fused_head, loss_grad=loss_grad
    )
    old = logp.detach() if old is None else old
    pg_mask = None
    if entropy_top_q is not None and bool(mb.completion_mask.any()):
        threshold = torch.quantile(entropy[mb.completion_mask].float(), 1.0 - entropy_top_q)
        pg_mask = mb.completion_mask & (entropy >= threshold)
    loss, m = policy_loss(
        logp, old, adv, mb.completion_mask, ref_logp=ref, pg_mask=pg_mask, is_weights=weights,
        **spec.kwargs(), **counts,
    )  # fmt: skip
    if dump_path is not None and not dummy:
        torch.save(
            {
                "logp": logp.detach().cpu(),
                "old_logp": old.cpu(),
                "advantages": adv.cpu(),
                "mask": mb.completion_mask.cpu(),
                "ref_logp": None if ref is None else ref.cpu(),
                "pg_mask": None if pg_mask is None else pg_mask.cpu(),
                "is_weights": None if weights is None else weights.cpu(),
                "loss": loss.detach().cpu(),
                "loss_spec": spec.kwargs(),
                "counts": counts,
                "rows": list(rows),
            },
            dump_path,
        )
    (loss * scale).backward()
    n = int(m["num_tokens"])
    if dummy or n == 0:
        return None
    m["entropy"] = entropy[mb.completion_mask].float().mean()
    mismatch = (0.0, 0.0, 0.0)
    if mismatch_logp is not None:
        abs_sum, outside, compared = mismatch_stats(
            logp.detach(), mismatch_logp[rows, :T].to(device), mb.completion_mask
        )
        mismatch = (float(abs_sum), float(outside), float(compared))
    return {
        "shared": mb.shared,
        "mismatch": mismatch,
        "loss": float(loss.detach()),
        "num_tokens": n,
        "ratio_max": float(m["ratio_max"]),
        **{key: float(m[key]) for key in _TOKEN_METRICS},
    }


def token_loss_grad(
    spec: LossSpec,
    counts: dict,
    mask_BT: torch.Tensor,
    old_BT: torch.Tensor | None,
    ref_BT: torch.Tensor | None,
    adv_B: torch.Tensor,
    weights_BT: torch.Tensor | None,
    scale: float,
) -> LossGrad:
    """``loss_grad`` for :func:`grpokit.algo.hidden_token_logprobs`: the gradient of ``scale x``
    :func:`policy_loss` (the same call :func:`_micro_batch_backward` then makes) with respect to one
    block of completion tokens' log-probs, for a ``spec.token_separable`` loss. The block's
    log-probs go into a ``[B, T]`` tensor whose other tokens hold placeholders (pi_old's log-prob,
    ratio 1): each token's term depends on its own log-prob only, so their values do not matter,
    and every tensor has the layout of the final call, so the gradient is the same bit for bit
    (the head's backward checks that)."""
    B, T = mask_BT.shape

    def loss_grad(index_c: torch.Tensor, logp_c: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x_c = logp_c.detach().requires_grad_()
            base = logp_c.new_zeros(B * T) if old_BT is None else old_BT.reshape(-1).to(logp_c.dtype)
            logp_BT = base.index_put((index_c,), x_c).view(B, T)
            old = logp_BT.detach() if old_BT is None else old_BT
            loss, _ = policy_loss(
                logp_BT, old, adv_B, mask_BT, ref_logp=ref_BT, is_weights=weights_BT,
                **spec.kwargs(), **counts,
            )  # fmt: skip
            (g_c,) = torch.autograd.grad(loss * scale, x_c)
        return g_c

    return loss_grad


def collate_shared(
    batch: TrainBatch,
    rows: list[int],
    pad_id: int,
    device: torch.device,
    groups: list[list[int]] | None = None,
) -> MicroBatch:
    """``rows`` with each prompt computed once: the rows of one prompt become one sequence
    ``[prompt | completion_1 | ... | completion_k]``, each completion's position ids continuing from
    the prompt's length, and a :class:`~grpokit.models.shared_prompts.SharedLayout` by which a
    completion token attends to the prompt and the earlier tokens of its own completion only.
    Every token's attention and positions are those of the padded layout, so the log-probs and
    gradients are the same; the prompt's forward and backward run once per group instead of once
    per row. ``gather`` maps each completion token to the position that predicts it. The attention
    mask is an empty ``[groups, 1, 0, 0]``: no attention kernel accepts it, so a forward outside
    :func:`~grpokit.models.shared_prompts.routed` fails instead of attending across rows.
    ``groups``: :func:`_prompt_groups` of ``rows``, if already computed."""
    lengths, comp_ids, comp_mask = _prefix_completions(batch, rows, "prompt sharing")
    width = comp_ids.shape[1]
    groups = _prompt_groups(batch, rows) if groups is None else groups
    sizes = [len(batch.prompt_ids[rows[m[0]]]) + sum(int(lengths[j]) for j in m) for m in groups]
    S = max(sizes)
    input_ids = torch.full((len(groups), S), pad_id, dtype=torch.long)
    positions = torch.zeros((len(groups), S), dtype=torch.long)
    gather = torch.zeros((len(rows), width), dtype=torch.long)  # beyond a row's length: masked anyway
    prompt_lengths, spans = [], [(0, 0, 0)] * len(rows)  # spans[j]: (group, start, length) of row j
    for g, members in enumerate(groups):
        prompt = batch.prompt_ids[rows[members[0]]]
        P = len(prompt)
        input_ids[g, :P], positions[g, :P] = prompt, torch.arange(P)
        prompt_lengths.append(P)
        at = P
        for j in members:
            n = int(lengths[j])
            input_ids[g, at : at + n] = comp_ids[j, :n]
            positions[g, at : at + n] = P + torch.arange(n)
            spans[j] = (g, at, n)
            if n:  # token 0 is predicted by the prompt's last position, token t by token t - 1
                gather[j, 0] = g * S + P - 1
                gather[j, 1:n] = g * S + at + torch.arange(n - 1)
            at += n
    return MicroBatch(
        torch.tensor(rows),
        input_ids.to(device),
        torch.ones((len(groups), 1, 0, 0), dtype=torch.bool, device=device),
        positions.to(device),
        0,
        comp_ids.to(device),
        comp_mask.to(device),
        gather.to(device),
        SharedLayout(prompt_lengths, spans, S).to(device),
    )


def _prompt_groups(batch: TrainBatch, rows: list[int]) -> list[list[int]]:
    """Indices into ``rows`` grouped by identical prompt, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for j, r in enumerate(rows):
        groups.setdefault(tuple(batch.prompt_ids[r].tolist()), []).append(j)
    return list(groups.values())


def _fits_window(batch: TrainBatch, rows: list[int], window: int | None) -> bool:
    """Whether every row's prompt + context is at most ``window`` tokens (None: no window), so that
    a sliding window would cut none of its keys (one token stricter than needed: a row's last token
    is no query the loss reads)."""
    if window is None:
        return True
    lengths = batch.context_mask[rows].sum(dim=1).tolist()
    return max(len(batch.prompt_ids[r]) + n for r, n in zip(rows, lengths, strict=True)) <= window


def sharing_pays(
    batch: TrainBatch,
    rows: list[int],
    costs: SharingCosts,
    groups: list[list[int]] | None = None,
) -> bool:
    """Whether :func:`collate_shared` does less work than :func:`collate`'s padded rows, with
    ``costs`` = (per token: the layers' matmuls, per attended query-key pair), every pair counted on
    both sides (an explicit mask runs them all): shared, each prompt's tokens once and the pairs of
    :class:`~grpokit.models.shared_prompts.SharedLayout` (``groups x P^2`` for the prompts,
    ``rows x W x (P + W)`` for the completions), against every row's ``P + W`` tokens and their
    ``(P + W)^2`` pairs. Sequences padded to the longest group can cost more than they save when
    groups are uneven; a micro-batch in which no prompt has two rows has nothing to share.
    ``groups``: :func:`_prompt_groups` of ``rows``, if already computed."""
    token_cost, pair_cost = costs.token, costs.pair
    lengths = batch.context_mask[rows].sum(dim=1).tolist()
    groups = _prompt_groups(batch, rows) if groups is None else groups
    if all(len(m) < 2 for m in groups):
        return False
    S = max(len(batch.prompt_ids[rows[m[0]]]) + sum(lengths[j] for j in m) for m in groups)
    P, W = max(len(batch.prompt_ids[r]) for r in rows), max(max(lengths), 1)
    shared = len(groups) * (S * token_cost + P * P * pair_cost) + len(rows) * W * (P + W) * pair_cost
    padded = len(rows) * ((P + W) * token_cost + (P + W) ** 2 * pair_cost)
    return shared < padded
