r"""Rollout-training mismatch: how far the sampler's log-probs are from the trainer's, and the
importance-sampling weights that correct for it.

The sampler (the built-in one in bf16, or vLLM) and the trainer compute the same policy with
different kernels and precisions, so the tokens were drawn from :math:`\pi_{\text{sampler}}` while
the loss takes :math:`\pi_{\text{old}}` (the trainer's recomputation) as the behaviour policy. The
per-token ratio :math:`\rho_t = \pi_{\text{old}}(y_t) / \pi_{\text{sampler}}(y_t)` measures the gap.

- ``mismatch_stats``: mean :math:`|\log\pi_{\text{old}} - \log\pi_{\text{sampler}}|` over the
  completion tokens and the share of tokens with :math:`\rho_t` outside ``[lo, hi]`` (default
  [0.9, 1.1]); logged every step as ``logprob_mismatch`` and ``logprob_ratio_outside``.
- ``correction_weights``: stop-gradient weights that multiply each token's policy-gradient term:

  * ``"token_truncated"`` -- truncated IS, TIS (Yao, Liu et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", fengyao.notion.site/off-policy-rl; NeurIPS 2025 ER
    workshop "On the Rollout-Training Mismatch in Modern RL Systems"):
    :math:`w_{i,t} = \min(\rho_{i,t}, C)`.
  * ``"sequence_masked"`` -- masked IS at the sequence level, Seq-MIS (Liu, Yao et al. 2025, "When
    Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"):
    :math:`\rho_i = \prod_t \rho_{i,t}`, :math:`w_{i,t} = \rho_i\,\mathbb{1}[\rho_i \le C]` -- a
    sequence whose whole-sequence ratio exceeds C is dropped from the gradient, the others are
    re-weighted by it.

Padded positions get weight 0 (they carry no loss anyway). Shape legend: B completions, T tokens.
"""

from __future__ import annotations

import torch

CORRECTIONS = ("token_truncated", "sequence_masked")


def mismatch_stats(
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    lo: float = 0.9,
    hi: float = 1.1,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    r"""``(sum |log pi_old - log pi_sampler|, number of tokens with rho outside [lo, hi], tokens)``
    over the masked ``[B, T]`` tokens: sums, so micro-batches and ranks add up; divide by the tokens
    for the means."""
    m = mask.bool()
    diff = (old_logp.detach().double() - sampler_logp.double())[m]
    ratio = torch.exp(diff)
    outside = ((ratio < lo) | (ratio > hi)).sum()
    return diff.abs().sum(), outside, int(m.sum())


def correction_weights(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> torch.Tensor:
    r"""``[B, T]`` importance weights (no gradient) for ``mode`` in :data:`CORRECTIONS` with cap
    ``C = cap`` (> 0); see the module docstring for the formulas. Computed in float64 and returned
    in ``old_logp``'s dtype; 0 at padded positions."""
    if mode not in CORRECTIONS:
        raise ValueError(f"mode must be one of {CORRECTIONS}, got {mode!r}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    if old_logp.shape != sampler_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"old_logp {tuple(old_logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [B, T] shape"
        )
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float64)
    log_rho = torch.where(m, old_logp.detach().double() - sampler_logp.double(), zero)
    if mode == "token_truncated":
        w = torch.exp(log_rho).clamp(max=cap)
    else:
        log_seq = log_rho.sum(dim=1, keepdim=True)  # log prod_t rho_t
        keep = log_seq <= torch.log(torch.tensor(cap, dtype=torch.float64))
        w = torch.where(keep, torch.exp(log_seq), torch.zeros_like(log_seq)).expand_as(log_rho)
    return torch.where(m, w, torch.zeros_like(w)).to(old_logp.dtype)
