"""The GRPO policy loss, composed from small pieces: importance ratio, clipped surrogate, KL term,
aggregation over tokens and sequences.

What it does: given per-token log-probs of the completions under the current policy (``logp``),
the sampling policy (``old_logp``) and optionally the reference (``ref_logp``), the per-completion
advantages and the completion mask, return the scalar loss to minimise and a dict of metrics.

What it deliberately does not do: run a model, compute advantages, or pick hyper-parameters.
Variants are not branches inside one function: each piece below is a function with its own
formula, and ``policy_loss`` selects them through tables (``RATIO_LEVELS``, ``AGGREGATIONS``).

Exact gradient accumulation: every aggregation is a *sum* over tokens divided by a denominator
that depends only on counts (sequences, tokens, ``max_completion_length``). Pass the step's
global ``num_sequences`` / ``num_tokens`` and the micro-batch losses add up to the full-batch
loss exactly, whatever the micro-batch split.

Masked (padding) positions are removed with ``torch.where``, never by multiplying, so an inf or
NaN computed at a padded position cannot leak into the loss or its gradient.

Shape legend: B completions, T completion tokens (right-padded; ``mask_BT`` marks real tokens).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from grpokit.algo.kl import KL_KINDS, kl_penalty

# --------------------------------------------------------------------------------------------
# Importance ratio: log(pi_theta / pi_old), per token or per sequence.
# --------------------------------------------------------------------------------------------


def token_log_ratio(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    r"""Per-token log importance ratio (PPO, GRPO):

    :math:`\log r_{i,t} = \log\pi_\theta(o_{i,t}) - \log\pi_{old}(o_{i,t})`.

    Returns ``[B, T]``; padded positions are 0 (ratio 1).
    """
    return torch.where(mask_BT, logp_BT - old_logp_BT, torch.zeros_like(logp_BT))


def sequence_log_ratio(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    r"""Sequence-level log ratio broadcast to tokens (GSPO, Zheng et al. 2025, arXiv:2507.18071, sec. 4):

    :math:`\log s_i = \frac{1}{|o_i|}\sum_t (\log\pi_\theta(o_{i,t}) - \log\pi_{old}(o_{i,t}))`,
    the log of the length-normalised sequence likelihood ratio. Every token of completion i carries
    :math:`\log s_i`, so with ``seq_mean_token_mean`` aggregation the loss is GSPO's per-sequence
    objective and its gradient is GSPO's (each token gets :math:`s_i A_i / |o_i|`).

    Returns ``[B, T]``; padded positions are 0.
    """
    diff_BT = token_log_ratio(logp_BT, old_logp_BT, mask_BT)
    len_B1 = mask_BT.sum(dim=1, keepdim=True).clamp(min=1)
    seq_B1 = diff_BT.sum(dim=1, keepdim=True) / len_B1
    return torch.where(mask_BT, seq_B1.expand_as(diff_BT), torch.zeros_like(diff_BT))


RATIO_LEVELS: dict[str, Callable[..., torch.Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
}

# --------------------------------------------------------------------------------------------
# Surrogate.
# --------------------------------------------------------------------------------------------


def clipped_surrogate(
    ratio_BT: torch.Tensor,
    logp_BT: torch.Tensor,
    adv_B1: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    r"""PPO's clipped surrogate as a per-token loss (negated, to minimise):

    :math:`-\min\big(\tilde r A,\ \mathrm{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high})\,A\big)`

    (PPO, Schulman et al. 2017, arXiv:1707.06347, eq. 7; asymmetric "clip-higher" bounds from
    DAPO, Yu et al. 2025, arXiv:2503.14476, sec. 3.1). Where the clip is active -- ratio below
    1 - clip_low with A < 0, or above 1 + clip_high with A > 0 -- the gradient is exactly 0.

    ``delta`` (two-sided clipping, INTELLECT-2, Prime Intellect 2025, arXiv:2505.07291):
    :math:`\tilde r = \min(r, \delta)` when A < 0, so a token whose ratio exploded cannot make an
    unbounded negative-advantage update; otherwise :math:`\tilde r = r`.

    Returns ``[B, T]``.
    """
    unclipped_ratio_BT = (
        ratio_BT if delta is None else torch.where(adv_B1 < 0, ratio_BT.clamp(max=delta), ratio_BT)
    )
    clipped_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_B1
    return -torch.minimum(unclipped_ratio_BT * adv_B1, clipped_BT)


def cispo_surrogate(
    ratio_BT: torch.Tensor,
    logp_BT: torch.Tensor,
    adv_B1: torch.Tensor,
    *,
    cispo_max_ratio: float = 5.0,
) -> torch.Tensor:
    r"""CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance *weight*, not the update:

    :math:`-\,\mathrm{sg}\big(\min(r, \epsilon^{IS}_{max})\big)\,A\,\log\pi_\theta`

    Every token keeps a gradient (no token is dropped by a clip), weighted by its stop-gradient
    ratio capped at ``cispo_max_ratio`` (an absolute cap on r, default 5.0 -- not 1 + clip_low).
    At r = 1 the gradient equals GRPO's.

    Returns ``[B, T]``.
    """
    weight_BT = ratio_BT.detach().clamp(max=cispo_max_ratio)
    return -weight_BT * adv_B1 * logp_BT


def sapo_surrogate(
    ratio_BT: torch.Tensor,
    logp_BT: torch.Tensor,
    adv_B1: torch.Tensor,
    *,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> torch.Tensor:
    r"""SAPO (Soft Adaptive Policy Optimization, arXiv:2511.20347): a smooth gate instead of a hard clip:

    :math:`-f_\tau(r)\,A`, :math:`f_\tau(r) = \frac{4}{\tau}\,\sigma\big(\tau (r - 1)\big)`, with
    :math:`\tau = \tau_{pos}` for A > 0 and :math:`\tau_{neg}` for A < 0.

    :math:`f'(1) = 1`, so on-policy the gradient is GRPO's; off-policy it decays smoothly as r leaves 1
    (faster for negative advantages, tau_neg > tau_pos).

    Returns ``[B, T]``.
    """
    tau_B1 = torch.where(
        adv_B1 > 0, torch.full_like(adv_B1, sapo_tau_pos), torch.full_like(adv_B1, sapo_tau_neg)
    )
    gate_BT = torch.sigmoid(tau_B1 * (ratio_BT - 1.0)) * (4.0 / tau_B1)
    return -gate_BT * adv_B1


SURROGATES: dict[str, Callable[..., torch.Tensor]] = {
    "clip": clipped_surrogate,
    "cispo": cispo_surrogate,
    "sapo": sapo_surrogate,
}


# --------------------------------------------------------------------------------------------
# Aggregation: per-token values [B, T] -> scalar. Each is  sum(x over valid tokens) / denominator.
# --------------------------------------------------------------------------------------------


def seq_mean_token_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor, *, num_sequences: int) -> torch.Tensor:
    r"""DeepSeekMath GRPO (arXiv:2402.03300, eq. 3): :math:`\frac{1}{N}\sum_i \frac{1}{|o_i|}\sum_t x_{i,t}`.

    Denominator: ``num_sequences`` (N, completions with at least one token) times each
    completion's own length. Long completions' tokens weigh less -- the length bias Dr. GRPO names.
    """
    len_B = mask_BT.sum(dim=1).clamp(min=1)
    per_seq_B = torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum(dim=1) / len_B
    return per_seq_B.sum() / max(num_sequences, 1)


def token_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor, *, num_tokens: int) -> torch.Tensor:
    r"""DAPO token-level loss (arXiv:2503.14476, sec. 3.3):

    :math:`\frac{1}{\sum_i |o_i|}\sum_i\sum_t x_{i,t}`.

    Denominator: ``num_tokens``, so every token of the batch weighs the same.
    """
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum() / max(num_tokens, 1)


def seq_mean_token_sum_norm(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, *, num_sequences: int, max_completion_length: int | None
) -> torch.Tensor:
    r"""Dr. GRPO (arXiv:2503.20783, sec. 3): :math:`\frac{1}{N \cdot L_{max}}\sum_i\sum_t x_{i,t}`.

    Denominator: ``num_sequences * max_completion_length``, a constant, so no length bias.
    """
    if max_completion_length is None:
        raise ValueError(
            "aggregation='seq_mean_token_sum_norm' needs max_completion_length (the rollout's max_new_tokens)"
        )
    total = torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum()
    return total / (max(num_sequences, 1) * max_completion_length)


def bnpo(x_BT: torch.Tensor, mask_BT: torch.Tensor, *, num_micro_batches: int = 1) -> torch.Tensor:
    r"""BNPO / TRL's ``bnpo``: token mean over the *local micro-batch*, averaged over micro-batches:

    :math:`\frac{1}{M}\,\frac{1}{\sum_{i \in mb} |o_i|}\sum_{i \in mb}\sum_t x_{i,t}`.

    Denominator: this micro-batch's own token count, times ``num_micro_batches``. Unlike the other
    aggregations its value depends on how the batch is split -- that is the definition, kept for
    parity with trainers that use it.
    """
    local = int(mask_BT.sum())
    return torch.where(mask_BT, x_BT, torch.zeros_like(x_BT)).sum() / (max(local, 1) * num_micro_batches)


AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "seq_mean_token_mean": seq_mean_token_mean,
    "token_mean": token_mean,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
    "bnpo": bnpo,
}


def _keyword_options(fn: Callable) -> tuple[str, ...]:
    return tuple(n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY)


# What each piece is passed: exactly the keyword-only parameters it declares (no ``**`` sinks, so
# an option a piece does not take is never silently accepted).
SURROGATE_OPTIONS = {name: _keyword_options(fn) for name, fn in SURROGATES.items()}
AGGREGATION_COUNTS = {name: _keyword_options(fn) for name, fn in AGGREGATIONS.items()}


@dataclass(frozen=True)
class LossSpec:
    """The policy loss's options for a run: built once (the trainer builds it from ``algo``),
    validated on construction, passed to :func:`policy_loss` as ``**spec.kwargs()``. A misspelled
    option is a ``TypeError`` here rather than a silently ignored keyword."""

    beta: float = 0.0
    clip_low: float = 0.2
    clip_high: float | None = None
    ratio_level: str = "token"
    aggregation: str = "seq_mean_token_mean"
    max_completion_length: int | None = None
    kl_kind: str = "k3"
    surrogate: str = "clip"
    delta: float | None = None
    cispo_max_ratio: float = 5.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05

    def __post_init__(self) -> None:
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta!r}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low!r}")
        if self.clip_high is not None and not self.clip_high >= 0:
            raise ValueError(f"clip_high must be >= 0 or None (= clip_low), got {self.clip_high!r}")
        for option, value, table in (
            ("ratio_level", self.ratio_level, RATIO_LEVELS),
            ("aggregation", self.aggregation, AGGREGATIONS),
            ("surrogate", self.surrogate, SURROGATES),
            ("kl_kind", self.kl_kind, KL_KINDS),
        ):
            if value not in table:
                raise ValueError(f"{option} must be one of {tuple(table)}, got {value!r}")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(
                f"max_completion_length must be a positive int, got {self.max_completion_length!r}"
            )
        if self.delta is not None and not self.delta > 1:
            raise ValueError(f"delta (two-sided clipping) must be > 1 or None, got {self.delta!r}")

    def kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def token_separable(self) -> bool:
        """Whether the loss is a sum of per-token terms, each a function of its own token's log-prob
        (and constants): every option except GSPO's sequence ratio, which couples a completion's
        tokens. Such a loss's gradient can be taken block by block
        (``hidden_token_logprobs(loss_grad=...)``)."""
        return self.ratio_level == "token"


# --------------------------------------------------------------------------------------------
# The loss.
# --------------------------------------------------------------------------------------------


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    ratio_level: str = "token",
    aggregation: str = "seq_mean_token_mean",
    max_completion_length: int | None = None,
    kl_kind: str = "k3",
    num_sequences: int | None = None,
    num_tokens: int | None = None,
    surrogate: str = "clip",
    delta: float | None = None,
    cispo_max_ratio: float = 5.0,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    num_micro_batches: int = 1,
    pg_mask: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""GRPO-family policy loss (to minimise), DeepSeekMath eq. 3 and its variants:

    :math:`\mathcal{L} = \mathrm{agg}_{i,t}\Big[-\min\big(r_{i,t}A_i,\
    \mathrm{clip}(r_{i,t},1-\epsilon_{low},1+\epsilon_{high})A_i\big) + \beta\,\mathrm{KL}_{i,t}\Big]`

    with :math:`r_{i,t} = \pi_\theta/\pi_{old}` per token (``ratio_level="token"``) or GSPO's
    sequence ratio :math:`s_i` (``"sequence"``), KL the per-token estimator ``kl_kind``
    (:func:`grpokit.algo.kl.kl_penalty`), and ``agg`` one of :data:`AGGREGATIONS`. The bracketed
    surrogate is PPO's clip by default; ``surrogate`` picks another from :data:`SURROGATES`
    (``cispo``, ``sapo``). With a single inner epoch ``old_logp`` is ``logp.detach()``: the ratio
    is 1 but its gradient is the policy gradient.

    Args:
        logp: ``[B, T]`` current policy log-probs of the completion tokens (differentiable).
        old_logp: ``[B, T]`` sampling-policy log-probs (constant).
        advantages: ``[B]`` per-completion advantages (constant).
        mask: ``[B, T]`` 1/True for real completion tokens, 0/False for padding.
        ref_logp: ``[B, T]`` reference-model log-probs; required when ``beta > 0``; when given
            with ``beta == 0`` the KL is still reported.
        beta: KL coefficient (>= 0).
        clip_low: epsilon_low, the ratio is clipped below at 1 - clip_low (0 <= clip_low < 1).
        clip_high: epsilon_high, clipped above at 1 + clip_high; ``None`` means ``clip_low``.
        ratio_level: ``"token"`` or ``"sequence"`` (GSPO).
        aggregation: ``"seq_mean_token_mean" | "token_mean" | "seq_mean_token_sum_norm"``.
        max_completion_length: L_max for ``seq_mean_token_sum_norm``.
        kl_kind: ``"k1" | "k2" | "k3"``.
        num_sequences: the denominator's N; default: completions in this batch with >= 1 token.
            Pass the whole step's count when accumulating gradients over micro-batches.
        num_tokens: the denominator of ``token_mean``; default: valid tokens in this batch.
        surrogate: ``"clip" | "cispo" | "sapo"`` (:data:`SURROGATES`).
        delta: two-sided clipping cap on the ratio for A < 0 (``clip`` only); None disables.
        cispo_max_ratio: CISPO's cap on the stop-gradient importance weight.
        sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for A > 0 and A < 0.
        num_micro_batches: M of the ``bnpo`` aggregation (ignored by the others).
        pg_mask: ``[B, T]`` subset of ``mask`` whose tokens get the policy-gradient term (e.g. the
            high-entropy tokens); the denominators still count every token of ``mask``. None: all.
        is_weights: ``[B, T]`` constant weights multiplying each token's surrogate before aggregation:
            a rollout-training mismatch correction (:func:`grpokit.algo.correction.correction_weights`,
            truncated or masked IS). None: 1.

    Returns:
        ``(loss, metrics)``: the scalar loss, and detached 0-d tensors over this batch's valid
        tokens: ``pg_loss`` and ``kl_loss`` (the two aggregated terms before beta; loss =
        pg_loss + beta * kl_loss), ``kl`` (token-mean KL estimate; NaN when no ``ref_logp``),
        ``clip_fraction``, ``clip_fraction_low``, ``clip_fraction_high`` (fraction of tokens whose
        gradient the clip zeroes), ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``num_tokens``.
    """
    spec = LossSpec(beta, clip_low, clip_high, ratio_level, aggregation, max_completion_length, kl_kind,
                    surrogate, delta, cispo_max_ratio, sapo_tau_pos, sapo_tau_neg)  # fmt: skip
    mask_BT = _check_loss_inputs(logp, old_logp, advantages, mask, ref_logp, beta)
    if pg_mask is not None and pg_mask.shape != mask.shape:
        raise ValueError(f"pg_mask has shape {tuple(pg_mask.shape)} but mask has {tuple(mask.shape)}")
    if is_weights is not None and is_weights.shape != mask.shape:
        raise ValueError(f"is_weights has shape {tuple(is_weights.shape)} but mask has {tuple(mask.shape)}")
    clip_high = clip_low if clip_high is None else clip_high

    batch_tokens = int(mask_BT.sum())
    available = {
        "num_sequences": int(mask_BT.any(dim=1).sum()) if num_sequences is None else num_sequences,
        "num_tokens": batch_tokens if num_tokens is None else num_tokens,
        "max_completion_length": max_completion_length,
        "num_micro_batches": num_micro_batches,
    }
    counts = {k: available[k] for k in AGGREGATION_COUNTS[aggregation]}
    aggregate = AGGREGATIONS[aggregation]

    # Zero the padded positions of every input first: a where() downstream blocks the value, but
    # the backward of e.g. exp(-inf - -inf) would still multiply its zero gradient by NaN.
    zeros_BT = torch.zeros_like(logp)
    logp = torch.where(mask_BT, logp, zeros_BT)
    old_logp = torch.where(mask_BT, old_logp.detach(), zeros_BT)
    ref_logp = None if ref_logp is None else torch.where(mask_BT, ref_logp.detach(), zeros_BT)

    adv_B1 = advantages.detach().to(logp.dtype).unsqueeze(1)
    log_ratio_BT = RATIO_LEVELS[ratio_level](logp, old_logp, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT)
    options = {**spec.kwargs(), "clip_high": clip_high}
    surrogate_BT = SURROGATES[surrogate](
        ratio_BT, logp, adv_B1, **{k: options[k] for k in SURROGATE_OPTIONS[surrogate]}
    )
    if is_weights is not None:
        surrogate_BT = surrogate_BT * torch.where(mask_BT, is_weights.detach().to(logp.dtype), zeros_BT)
    if pg_mask is not None:
        surrogate_BT = torch.where(pg_mask.bool(), surrogate_BT, torch.zeros_like(surrogate_BT))
    pg_loss = aggregate(surrogate_BT, mask_BT, **counts)

    if ref_logp is not None:
        kl_BT = kl_penalty(logp, ref_logp, kl_kind)
        kl_loss = aggregate(kl_BT, mask_BT, **counts)
        loss = pg_loss + beta * kl_loss if beta > 0 else pg_loss
    else:
        kl_BT, kl_loss, loss = None, torch.zeros((), dtype=logp.dtype), pg_loss

    with torch.no_grad():
        metrics = _loss_metrics(ratio_BT, adv_B1, mask_BT, kl_BT, clip_low, clip_high, batch_tokens)
        metrics["pg_loss"] = pg_loss.detach()
        metrics["kl_loss"] = kl_loss.detach()
    return loss, metrics


def _loss_metrics(
    ratio_BT: torch.Tensor,
    adv_B1: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    batch_tokens: int,
) -> dict[str, torch.Tensor]:
    n = max(batch_tokens, 1)
    low_BT = (ratio_BT < 1.0 - clip_low) & (adv_B1 < 0) & mask_BT
    high_BT = (ratio_BT > 1.0 + clip_high) & (adv_B1 > 0) & mask_BT
    ratio_valid = ratio_BT[mask_BT]
    empty = ratio_valid.numel() == 0
    nan = torch.tensor(float("nan"), dtype=ratio_BT.dtype)
    return {
        "clip_fraction_low": low_BT.sum() / n,
        "clip_fraction_high": high_BT.sum() / n,
        "clip_fraction": (low_BT | high_BT).sum() / n,
        "ratio_mean": nan if empty else ratio_valid.mean(),
        "ratio_min": nan if empty else ratio_valid.min(),
        "ratio_max": nan if empty else ratio_valid.max(),
        "kl": nan if kl_BT is None or empty else kl_BT[mask_BT].mean(),
        "num_tokens": torch.tensor(batch_tokens),
    }


def _check_loss_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    beta: float,
) -> torch.Tensor:
    """Validate shapes (:class:`LossSpec` validates the options); return the mask as bool ``[B, T]``."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T] (completion tokens), got shape {tuple(logp.shape)}")
    named = {"old_logp": old_logp, "mask": mask} | ({"ref_logp": ref_logp} if ref_logp is not None else {})
    for name, t in named.items():
        if t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logp has {tuple(logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(logp.shape[:1])}, got {tuple(advantages.shape)}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (reference-model log-probs); pass them or set beta=0")
    return mask.bool()
