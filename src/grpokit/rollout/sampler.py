"""The built-in sampler: G completions per prompt from a Hugging Face causal LM, with a KV cache.

What it does: left-pads the prompts, runs each prompt through the model **once**, repeats its KV
cache G times (the group shares the prefix), then decodes token by token with temperature /
top-k / top-p, stopping each row at EOS, a stop string, or ``max_new_tokens``. Rows that have
finished are dropped from the batch (and from the cache), so a group of mostly short answers
does not pay for its longest one. Seeded through an explicit ``torch.Generator``: same seed,
same completions.

Each token is drawn by inverse-CDF sampling from one uniform number per row and position, and the
uniforms of a whole (global) batch are drawn up front as one ``[max_new_tokens, num_rows_total]``
block. A row's completion therefore depends only on its own uniforms, not on which other rows
share its batch: under data parallelism (``row_offset``) each rank samples exactly the completions
a single process would have sampled for the same rows, and every rank's generator stays in step.

It records each sampled token's log-prob under the distribution it was actually drawn from
(``Rollout.sampler_logp``; top-k / top-p renormalised) and the policy version (the trainer's step):
the trainer compares them with its own recomputation every step (``logprob_mismatch``) and, with
top-k / top-p, uses them as pi_old.

What it deliberately does not do: compute training log-probs (the trainer recomputes them with
gradients), beam search, or speculative decoding. ``vllm_engine`` is the fast path on GPUs.

Shape legend: P prompts, G group size, B = P * G rows, L prompt length, T completion length, V vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from grpokit.errors import ConfigError, DataError
from grpokit.models.loading import accepts_kwarg
from grpokit.rollout.decode import decoder_for


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding. ``decode: auto`` runs grpokit's own
    forward with a preallocated KV cache (``rollout.decode``) for the families it serves (Llama,
    Qwen2/3, Mistral), else the HF forward; ``hf`` always the HF forward. Both sample the same tokens
    (tests/rollout/test_decode.py)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    # the built-in sampler's forward: auto (grpokit's own where rollout.decode serves the model) | hf
    decode: str = "auto"
    # own path on a CPU: large projections on oneDNN, weights reordered per call (rollout.reorder_weights)
    reorder_weights: bool = True
    # own path on a CPU: large prompts' keys kept once per group (rollout.share_prompts)
    share_prompts: bool = True


@dataclass
class Rollout:
    """Completions for P prompts x G samples, rows ordered group after group."""

    prompt_ids: torch.Tensor  # [P, L] left-padded
    prompt_mask: torch.Tensor  # [P, L] bool
    completion_ids: torch.Tensor  # [B, T] right-padded with the pad id
    completion_mask: torch.Tensor  # [B, T] bool: real completion tokens (EOS included)
    truncated: torch.Tensor  # [B] bool: hit max_new_tokens without EOS or a stop string
    completions: list[str]  # [B] decoded text (special tokens skipped)
    group_size: int
    # [B, T] float32: each sampled token's log-prob under the distribution it was drawn from
    # (temperature applied, renormalised over the tokens top-k / top-p kept; greedy: the plain
    # softmax), 0 at padding; None when the engine does not report it
    sampler_logp: torch.Tensor | None = None
    # [B] the trainer's step count when each row was sampled (every token of a row comes from it)
    policy_version: torch.Tensor | None = None
    # multi-turn episodes (rollout.episodes): [B, T] bool, True where the model wrote the token and
    # False where an environment inserted it (tool results, turn headers); None: the model wrote all
    model_mask: torch.Tensor | None = None
    episodes: list | None = None  # [B] rollout.episodes.Episode: the turns, the environment's reward

    @property
    def trained_mask(self) -> torch.Tensor:  # [B, T] bool: the model's own tokens (loss, KL, lengths)
        return self.completion_mask if self.model_mask is None else self.model_mask & self.completion_mask

    @property
    def num_rows(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:  # [B] tokens the model wrote
        return self.trained_mask.sum(dim=1)

    def completion_token_lists(self) -> list[list[int]]:
        """Each completion's token ids without padding (the ``completion_ids`` reward column)."""
        return [ids[m].tolist() for ids, m in zip(self.completion_ids, self.completion_mask, strict=True)]

    def take_groups(self, groups: list[int]) -> Rollout:
        """The rollout of a subset of its groups (prompts), in that order."""
        G = self.group_size
        rows = [g * G + j for g in groups for j in range(G)]
        return Rollout(
            self.prompt_ids[groups],
            self.prompt_mask[groups],
            self.completion_ids[rows],
            self.completion_mask[rows],
            self.truncated[rows],
            [self.completions[r] for r in rows],
            G,
            None if self.sampler_logp is None else self.sampler_logp[rows],
            None if self.policy_version is None else self.policy_version[rows],
            None if self.model_mask is None else self.model_mask[rows],
            None if self.episodes is None else [self.episodes[r] for r in rows],
        )


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Several rollouts as one: prompts re-left-padded, completions re-right-padded to common widths."""
    L = max(r.prompt_ids.shape[1] for r in parts)
    T = max(r.completion_ids.shape[1] for r in parts)

    def left(t: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([torch.full((t.shape[0], L - t.shape[1]), fill, dtype=t.dtype), t], dim=1)

    def right(t: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([t, torch.full((t.shape[0], T - t.shape[1]), fill, dtype=t.dtype)], dim=1)

    return Rollout(
        torch.cat([left(r.prompt_ids, pad_id) for r in parts]),
        torch.cat([left(r.prompt_mask, False) for r in parts]),
        torch.cat([right(r.completion_ids, pad_id) for r in parts]),
        torch.cat([right(r.completion_mask, False) for r in parts]),
        torch.cat([r.truncated for r in parts]),
        [c for r in parts for c in r.completions],
        parts[0].group_size,
        None
        if any(r.sampler_logp is None for r in parts)
        else torch.cat([right(r.sampler_logp, 0.0) for r in parts]),
        None
        if any(r.policy_version is None for r in parts)
        else torch.cat([r.policy_version for r in parts]),
        None
        if any(r.model_mask is None for r in parts)
        else torch.cat([right(r.model_mask, False) for r in parts]),
        None if any(r.episodes is None for r in parts) else [e for r in parts for e in r.episodes],
    )


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize and left-pad: returns ``(ids [P, L], mask [P, L] bool)``."""
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise DataError("a prompt encoded to zero tokens; give every prompt some text")
    width = max(len(e) for e in encoded)
    pad = pad_token_id(tokenizer)
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.bool)
    for i, e in enumerate(encoded):
        ids[i, width - len(e) :] = torch.tensor(e, dtype=torch.long)
        mask[i, width - len(e) :] = True
    return ids, mask


def pad_token_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token")
    return int(pad)


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompts: list[str],
    group_size: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    row_offset: int = 0,
    num_rows_total: int | None = None,
    policy_version: int = 0,
) -> Rollout:
    """Sample ``group_size`` completions for each prompt.

    Args:
        model: a Hugging Face causal LM (eval mode is the caller's choice; dropout changes samples).
        tokenizer: its tokenizer; ``eos_token_id`` ends a completion.
        prompts: P prompt strings (already templated).
        group_size: G >= 1.
        params: see :class:`SamplingParams`.
        generator: the random stream to sample from (on the model's device); None: torch's default.
        row_offset, num_rows_total: these B rows are rows ``[row_offset, row_offset + B)`` of a
            global batch of ``num_rows_total`` rows (data parallelism: every rank passes the same
            generator state and its own offset). Default: this call is the whole batch.
        policy_version: recorded per row (``Rollout.policy_version``): the trainer passes its step.

    Returns:
        A :class:`Rollout` with B = P * G rows, group after group.
    """
    if group_size < 1 or params.max_new_tokens < 1:
        raise ValueError(
            f"need group_size >= 1 and max_new_tokens >= 1, got {group_size}, {params.max_new_tokens}"
        )
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
    eos = tokenizer.eos_token_id
    pad = pad_token_id(tokenizer)
    B = len(prompts) * group_size
    total = B if num_rows_total is None else num_rows_total
    if not 0 <= row_offset <= total - B:
        raise ValueError(f"rows [{row_offset}, {row_offset + B}) do not fit a batch of {total} rows")
    out_BT = torch.full((B, params.max_new_tokens), pad, dtype=torch.long)
    logp_BT = torch.zeros((B, params.max_new_tokens), dtype=torch.float32)
    mask_BT = torch.zeros((B, params.max_new_tokens), dtype=torch.bool)
    truncated_B = torch.zeros(B, dtype=torch.bool)
    capacity = prompt_ids.shape[1] + params.max_new_tokens
    decoder = decoder_for(model, params.decode, capacity, params.reorder_weights, params.share_prompts)
    # the outputs above are ordinary tensors, written in place inside (see sampling_mode)
    with sampling_mode(model, decoder):
        u_TB = uniforms(params.max_new_tokens, total, row_offset, B, params.temperature, generator, device)
        logits_bV, state = decoder.prefill(
            prompt_ids.to(device), prompt_mask.to(device), group_size, capacity
        )
        u_TB = u_TB.double()  # (the draw's precision, converted once)
        scratch = draw_scratch(logits_bV)
        rows_b = torch.arange(B, device=device)  # the batch's rows, as indices into the B rows
        live_b = torch.ones(B, dtype=torch.bool, device=device)  # still decoding
        segment = _Segment(0)  # the steps since the batch last changed, written out when it changes
        for t in range(params.max_new_tokens):
            next_b, logp_b = _sample_next(logits_bV, params, u_TB[t], scratch)
            segment.add(next_b, logp_b, live_b)
            if eos is not None:
                live_b = live_b & (next_b != eos)
            if params.stop:
                segment.write(rows_b, out_BT, logp_BT, mask_BT, pad)
                segment = _Segment(t + 1)
                hit = _hits_stop(tokenizer, out_BT[rows_b[live_b].cpu(), : t + 1], params.stop)
                live_b = live_b.masked_scatter(live_b, ~hit.to(device))
            num_live = int(live_b.sum())
            if t == params.max_new_tokens - 1 or num_live == 0:
                break
            if len(rows_b) - num_live > decoder.keep_finished * len(rows_b):  # drop finished rows
                segment.write(rows_b, out_BT, logp_BT, mask_BT, pad)
                segment = _Segment(t + 1)
                keep_b = live_b.nonzero().flatten()
                decoder.select(state, keep_b)
                rows_b, next_b, live_b = rows_b[keep_b], next_b[keep_b], live_b[keep_b]
                u_TB = u_TB[:, keep_b]
            logits_bV = decoder.step(next_b, state)
        segment.write(rows_b, out_BT, logp_BT, mask_BT, pad)
        truncated_B[rows_b[live_b].cpu()] = True  # still decoding after the last step

    lengths = mask_BT.sum(dim=1).tolist()  # a row's real tokens are a prefix (it never resumes)
    T = max(lengths)
    out_BT, mask_BT, logp_BT = out_BT[:, :T], mask_BT[:, :T], logp_BT[:, :T]
    texts = [
        tokenizer.decode(row[:n], skip_special_tokens=True)
        for row, n in zip(out_BT.tolist(), lengths, strict=True)
    ]
    version_B = torch.full((B,), policy_version, dtype=torch.long)
    return Rollout(
        prompt_ids, prompt_mask, out_BT, mask_BT, truncated_B, texts, group_size, logp_BT, version_B
    )


class _Segment:
    """Tokens sampled for a fixed batch of rows since step ``start``, kept as per-step tensors and
    written into the [B, T] outputs in one go when the batch changes (fewer operations per step)."""

    def __init__(self, start: int) -> None:
        self.start, self.tokens, self.logps, self.lives = start, [], [], []

    def add(self, next_b: torch.Tensor, logp_b: torch.Tensor, live_b: torch.Tensor) -> None:
        self.tokens.append(next_b)
        self.logps.append(logp_b)
        self.lives.append(live_b)

    def write(self, rows_b, out_BT, logp_BT, mask_BT, pad: int) -> None:
        if not self.tokens:
            return
        rows, steps = rows_b.cpu(), slice(self.start, self.start + len(self.tokens))
        live_bn = torch.stack(self.lives, dim=1).cpu()  # a row's tokens after it finished are not kept
        out_BT[rows, steps] = torch.stack(self.tokens, dim=1).cpu().masked_fill(~live_bn, pad)
        logp_BT[rows, steps] = torch.stack(self.logps, dim=1).float().cpu().masked_fill(~live_bn, 0.0)
        mask_BT[rows, steps] = live_bn


def _sample_next(
    logits_bV: torch.Tensor, params: SamplingParams, u_b: torch.Tensor, scratch: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / temperature), after top-k and top-p filtering, and its
    log-prob under that (renormalised) distribution (:func:`inverse_cdf`). ``scratch``: a float32
    buffer of at least the logits' rows (:func:`draw_scratch`) that every step reuses for its
    vocabulary-wide working tensor (the logits themselves are left as they are)."""
    if params.temperature == 0:
        index_b = logits_bV.argmax(dim=-1)
        return index_b, torch.log_softmax(logits_bV.float(), dim=-1).gather(-1, index_b[:, None]).squeeze(-1)
    z_bV = logits_bV.float()
    buffer_bV = None if scratch is None else scratch[: len(z_bV)]
    if params.temperature != 1.0:  # (a full pass over the vocabulary, skipped when it changes nothing)
        z_bV = torch.div(z_bV, params.temperature, out=buffer_bV)
    top_k = params.top_k if 0 < params.top_k < z_bV.shape[-1] else 0
    if top_k or params.top_p < 1.0:
        return _truncated_draw(z_bV, top_k, params.top_p, u_b)
    if z_bV is not logits_bV:  # a tensor made here: the draw may overwrite it
        return inverse_cdf(z_bV, u_b, out=z_bV)
    return inverse_cdf(z_bV, u_b, out=buffer_bV)


# the largest logits per row searched, in turn, for a top-p cut before a row's whole vocabulary is
# sorted (a sort of 32 x 49,152 took 43 ms here, topk of 64 / 1024 of them 1.2 / 5.2 ms)
TOP_P_CANDIDATES = (64, 1024)


def _truncated_draw(
    z_bV: torch.Tensor, top_k: int, top_p: float, u_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`inverse_cdf` over softmax(``z``) restricted to the tokens top-k (``top_k`` > 0) and then
    top-p (``top_p`` < 1, over the top-k distribution) keep: a token stays when its logit is at
    least the smallest kept one (:func:`_threshold`, so ties with it stay too). Rows whose kept
    tokens are all among their few largest logits (``topk`` of ``top_k + 1``, or of
    :data:`TOP_P_CANDIDATES`) draw from those alone, in vocabulary order; the other rows sort their
    whole vocabulary. The same draw as over the masked vocabulary, up to the sums' rounding. ``z``
    is left as it is."""
    b, V = z_bV.shape
    index_b = torch.empty(b, dtype=torch.long, device=z_bV.device)
    logp_b = torch.empty(b, dtype=torch.float32, device=z_bV.device)
    # top-p over the whole vocabulary: its normaliser, one pass (with top-k, the candidates' own)
    lse_b1 = torch.logsumexp(z_bV, dim=-1, keepdim=True) if top_p < 1.0 and not top_k else None
    rows_r = torch.arange(b, device=z_bV.device)  # the rows not drawn yet
    for K in (top_k + 1,) if top_k else TOP_P_CANDIDATES:  # k + 1: a tie at the k-th shows
        if K >= V:
            break
        z_rV = z_bV if len(rows_r) == b else z_bV[rows_r]
        vals_rK, idx_rK = torch.topk(z_rV, K, dim=-1)  # sorted, largest first
        t_r1 = _threshold(vals_rK, top_k, top_p, None if lse_b1 is None else lse_b1[rows_r])
        fits_r = vals_rK[:, -1] < t_r1[:, 0]  # nothing past the candidates is kept
        if bool(fits_r.any()):
            sel = rows_r[fits_r]
            idx_sK, order_sK = torch.sort(idx_rK[fits_r], dim=-1)  # vocabulary order, as the full draw
            zc_sK = vals_rK[fits_r].gather(-1, order_sK)
            zc_sK = zc_sK.masked_fill(zc_sK < t_r1[fits_r], float("-inf"))
            j_s, logp_b[sel] = inverse_cdf(zc_sK, u_b[sel])
            index_b[sel] = idx_sK.gather(-1, j_s[:, None]).squeeze(-1)
        rows_r = rows_r[~fits_r]
        if len(rows_r) == 0:
            return index_b, logp_b
    z_rV = z_bV[rows_r]  # a copy: masked in place
    sorted_rV = torch.sort(z_rV, dim=-1, descending=True).values
    t_r1 = _threshold(sorted_rV, top_k, top_p, None if lse_b1 is None else lse_b1[rows_r])
    z_rV.masked_fill_(z_rV < t_r1, float("-inf"))
    index_b[rows_r], logp_b[rows_r] = inverse_cdf(z_rV, u_b[rows_r], out=z_rV)
    return index_b, logp_b


def _threshold(vals_rK: torch.Tensor, top_k: int, top_p: float, lse_r1: torch.Tensor | None) -> torch.Tensor:
    """[r, 1]: each row's smallest kept logit, from its K largest logits ``vals`` (sorted, largest
    first, K > ``top_k``). Top-k keeps the logits at least the k-th largest. Top-p then keeps
    the largest tokens while the mass before each (under the top-k distribution, or under the
    whole vocabulary's softmax, whose log-normaliser ``lse`` is, without top-k) is below ``top_p``,
    the first always. Where the mass before the K-th is still below ``top_p``, that is the K-th
    (the cut lies further: the caller looks wider)."""
    t_r1 = vals_rK[:, top_k - 1 : top_k] if top_k else None
    if top_p < 1.0:
        if t_r1 is not None:  # the top-k distribution, ties with the k-th included
            vals_rK = vals_rK.masked_fill(vals_rK < t_r1, float("-inf"))
            lse_r1 = torch.logsumexp(vals_rK, dim=-1, keepdim=True)
        p_rK = torch.exp((vals_rK - lse_r1).double())
        kept_r1 = ((p_rK.cumsum(dim=-1) - p_rK) < top_p).sum(dim=-1, keepdim=True)  # >= 1
        cut_r1 = vals_rK.gather(-1, kept_r1 - 1)
        t_r1 = cut_r1 if t_r1 is None else torch.maximum(t_r1, cut_r1)
    return t_r1


def draw_scratch(logits_bV: torch.Tensor) -> torch.Tensor | None:
    """The float32 buffer :func:`_sample_next` draws in for every step of a call whose first logits
    are ``logits_bV``; None where the draw makes no vocabulary-wide tensor (at most ``CDF_BLOCK``
    entries). A fresh tensor per step would be memory the allocator hands back to the system when
    it is freed and page-faults in again at the next step (39 MB at 64 rows x 151,936)."""
    if logits_bV.shape[-1] <= CDF_BLOCK:
        return None
    return torch.empty(logits_bV.shape, dtype=torch.float32, device=logits_bV.device)


CDF_BLOCK = 1024  # vocabulary entries per block of the two-level inverse CDF


def inverse_cdf(
    z_bV: torch.Tensor, u_b: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token of each row of softmax(``z``) at uniform ``u`` (the first index whose cumulative
    probability exceeds ``u * total``) and its log-prob.

    Two levels, so no full-width cumulative sum is built: the unnormalised probabilities
    ``e = exp(z - max z)`` (1 at the maximum) are summed per block of ``CDF_BLOCK`` entries, the
    block is found on the (short, float64) cumulative sum of those sums, then the token inside it
    on that one block's float64 cumulative sum. A zero-probability token is never drawn (the index
    is kept within the chosen block's first and last tokens with mass); the log-prob is
    ``log e_i - log total``, finite for every drawn token (it has mass). ``out``: where ``e`` is
    written (z's shape and dtype; ``z`` itself when the caller no longer needs it), else a new
    tensor. At a 152k vocabulary and 64 rows this takes about a sixth of a full softmax + float64
    cumsum + log_softmax (``benchmarks/bench_rollout.py --draw``). A vocabulary of at most one
    block is one level: its float64 cumulative sum is the whole CDF, and ``out`` is not used.
    """
    b, V = z_bV.shape
    if V <= CDF_BLOCK:  # few operators per token: small models' decode steps are cheap
        cdf_bV = torch.softmax(z_bV, dim=-1).double().cumsum(dim=-1)
        total_b = cdf_bV[:, -1]
        # The first index whose (sequential, non-decreasing) cumulative sum exceeds a target >= 0
        # is where the sum rose: a token with mass, without _first_above's clamps. Capped just
        # below the total (which only u = 1 reaches), it is never past the last token with mass.
        below_b = torch.nextafter(total_b, torch.zeros_like(total_b))
        target_b = torch.minimum(u_b.double() * total_b, below_b)
        index_b = torch.searchsorted(cdf_bV, target_b[:, None], right=True).squeeze(-1)
        return index_b, torch.log_softmax(z_bV, dim=-1).gather(-1, index_b[:, None]).squeeze(-1)
    e_bV = torch.sub(z_bV, z_bV.amax(dim=-1, keepdim=True), out=out).exp_()
    full = V // CDF_BLOCK * CDF_BLOCK
    sums = [e_bV[:, :full].reshape(b, -1, CDF_BLOCK).sum(dim=-1)]
    if full < V:
        sums.append(e_bV[:, full:].sum(dim=-1, keepdim=True))
    mass_bN = torch.cat(sums, dim=1).double()
    cdf_bN = mass_bN.cumsum(dim=-1)
    total_b = cdf_bN[:, -1]
    target_b = u_b.double() * total_b
    block_b = _first_above(cdf_bN, target_b)
    before_b = (cdf_bN - mass_bN).gather(-1, block_b[:, None]).squeeze(-1)
    cols_bK = block_b[:, None] * CDF_BLOCK + torch.arange(CDF_BLOCK, device=e_bV.device)
    inner_bK = (
        e_bV.gather(-1, cols_bK.clamp(max=V - 1)).masked_fill(cols_bK >= V, 0.0).double().cumsum(dim=-1)
    )
    index_b = block_b * CDF_BLOCK + _first_above(inner_bK, target_b - before_b)
    e_b = e_bV.gather(-1, index_b[:, None]).squeeze(-1).double()
    return index_b, (e_b.log() - total_b.log()).float()


def _first_above(cdf_bK: torch.Tensor, target_b: torch.Tensor) -> torch.Tensor:
    """Per row, the first index where the non-decreasing ``cdf`` exceeds ``target``, kept between
    the first and the last index where it rises (entries with mass), whatever the rounding."""
    index_b = torch.searchsorted(cdf_bK, target_b[:, None], right=True).squeeze(-1)
    first_b = (cdf_bK <= 0).sum(dim=-1)
    last_b = (cdf_bK < cdf_bK[:, -1:]).sum(dim=-1)
    return torch.minimum(torch.maximum(index_b, first_b), last_b)


@contextlib.contextmanager
def sampling_mode(model, decoder=None):
    """``torch.inference_mode()`` for a sampling loop: no autograd bookkeeping on the hundreds of
    small tensors a decode step makes (a fifth of a call at the shipped model, 6% of a bfloat16
    SmolLM2 step). Tensors made inside must not leave it; on the way out (error or not), the buffers
    a forward registered inside are replaced by ordinary copies: HF's dynamic rope registers a new
    ``inv_freq`` when the sequence outgrows it, and an inference tensor left on the model could not
    be updated in place (DDP's buffer broadcast) or saved for backward.

    Under autocast it is ``torch.no_grad()`` instead, unless ``decoder`` (made before, outside it)
    casts no weight itself (``casts_weights`` False: the own path's packed or once-cast copies and
    a float32 head): autocast keeps its casts of the weights for the rest of its context only
    outside inference mode, and inside it every linear would cast its weight again at every step
    (two fifths of a bfloat16 SmolLM2 call; docs/benchmarks.md)."""
    device_type = next(model.parameters()).device.type
    casts = decoder is None or decoder.casts_weights
    grad_off = torch.no_grad() if torch.is_autocast_enabled(device_type) and casts else torch.inference_mode()
    try:
        with grad_off:
            yield
    finally:
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_inference():
                    module._buffers[name] = buf.clone()


def _hits_stop(tokenizer, ids_bt: torch.Tensor | list[list[int]], stop: tuple[str, ...]) -> torch.Tensor:
    """[b] bool: does each row's text (special tokens skipped) contain one of the ``stop`` strings?"""
    ids = ids_bt.tolist() if isinstance(ids_bt, torch.Tensor) else ids_bt
    texts = batch_decode(tokenizer, ids) if ids else []
    return torch.tensor([any(s in text for s in stop) for text in texts], dtype=torch.bool)


def batch_decode(tokenizer, ids: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(ids, skip_special_tokens=True)``: the same texts.

    A fast tokenizer whose decode is transformers' own and cleans up no spaces decodes in one call
    to its Rust backend, which is all transformers' decode does after checking every id's type in
    Python: the stop check runs at every step for every running row (128 rows of 5-40 tokens:
    0.2 ms against 0.9 ms). Any other tokenizer goes through ``batch_decode``."""
    if _backend_decodes(tokenizer):
        return tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=True)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def _backend_decodes(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` is exactly its backend's ``decode``: a fast tokenizer whose class
    keeps transformers' ``_decode`` (the backend's decode, then the optional space clean-up) with
    ``clean_up_tokenization_spaces`` off."""
    from transformers import PreTrainedTokenizerFast

    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    )


def _positions(mask_PL: torch.Tensor) -> torch.Tensor:
    """Position ids under left padding: 0 at each row's first real token."""
    return (mask_PL.long().cumsum(dim=1) - 1).clamp(min=0)


def _step(model, ids, attn, positions, cache):
    """One forward returning the last position's logits [b, V] and the cache (transformers 4.x and 5.x)."""
    logits, new_cache = cached_forward(model, ids, attn, positions, cache, last_only=True)
    return logits[:, -1], new_cache


def cached_forward(model, ids, attn, positions, cache, last_only: bool = False):
    """One forward over ``ids`` [b, w] after ``cache`` (None: none yet): the logits [b, w, V] (with
    ``last_only``, where the model allows it, only the last position's) and the new cache, under
    transformers 4.x's ``past_key_values`` and 5.x's ``cache`` alike."""
    kw = {"logits_to_keep": 1} if last_only and accepts_kwarg(model, "logits_to_keep") else {}
    if cache is not None:
        kw["cache" if accepts_kwarg(model, "cache") else "past_key_values"] = cache
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, **kw)
    return out.logits, (out.cache if "cache" in out else out.past_key_values)


def uniforms(
    K: int, total: int, row_offset: int, B: int, temperature: float, generator, device
) -> torch.Tensor:
    """[K, B]: one uniform per (token index, global row) for rows [row_offset, row_offset + B) of
    ``total``, drawn up front, so the generator advances by the same amount on every rank and for
    every batch composition. Greedy decoding (temperature 0) touches no random stream."""
    if temperature == 0:
        return torch.zeros((K, B), device=device)
    u_KT = torch.rand((K, total), generator=generator, device=device)
    return u_KT[:, row_offset : row_offset + B]


def prompt_pass(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int, device):
    """Run each prompt once, then repeat its cache for the G members of its group. Returns the
    next-token logits [P*G, V], the cache and the attention mask so far [P*G, L]."""
    ids_PL, mask_PL = prompt_ids.to(device), prompt_mask.to(device)
    logits_PV, cache = _step(model, ids_PL, mask_PL.long(), _positions(mask_PL), None)
    cache.batch_repeat_interleave(group_size)
    logits_bV = logits_PV.repeat_interleave(group_size, dim=0)
    return logits_bV, cache, mask_PL.long().repeat_interleave(group_size, dim=0)
