"""Per-token estimators of KL(pi_theta || pi_ref) from sampled tokens (Schulman, "Approximating KL
Divergence", 2020, http://joschu.net/blog/kl-approx.html).

What it does: given the log-probabilities of the *sampled* tokens under the policy and under the
frozen reference, return one of the k1 / k2 / k3 estimators per token.

What it deliberately does not do: mask, average or weight by beta (the loss does that), or clamp
the value (a silent clamp would change the objective; masked padding is handled with
``torch.where`` by the caller, so a huge value at a padded position never turns into NaN).

With ``log_ratio = ref_logp - logp = log(pi_ref / pi_theta)`` and tokens sampled from pi_theta:

- k1 = -log_ratio                          unbiased for the KL value, high variance, can be < 0
- k2 = log_ratio**2 / 2                    biased, low variance, >= 0
- k3 = exp(log_ratio) - log_ratio - 1      unbiased, low variance, >= 0 (DeepSeekMath eq. 4)

Their gradients as loss terms differ from their values' properties; docs/algorithms.md states
which gradient each one gives.

Shape legend: B sequences, T completion tokens (any shape works: the estimators are elementwise).
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    r"""Per-token KL estimator between the policy and the reference model.

    Args:
        logp: ``[B, T]`` log pi_theta of the sampled tokens (differentiable).
        ref_logp: ``[B, T]`` log pi_ref of the same tokens (treated as a constant).
        kind: ``"k1"``: :math:`\log\pi_\theta - \log\pi_{ref}`;
            ``"k2"``: :math:`\tfrac12(\log\pi_\theta - \log\pi_{ref})^2`;
            ``"k3"``: :math:`\frac{\pi_{ref}}{\pi_\theta} - \log\frac{\pi_{ref}}{\pi_\theta} - 1`
            (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, eq. 4).

    Returns:
        ``[B, T]`` estimator per token, same dtype as ``logp``.

    Example:
        ``logp = -1.0``, ``ref_logp = -1.5`` gives k1 = 0.5, k2 = 0.125, k3 = e^{-0.5} - 0.5 = 0.106531,
        and d k3 / d logp = 1 - pi_ref / pi_theta = 0.393469.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} must have one shape")
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    log_ratio = ref_logp.detach() - logp  # log(pi_ref / pi_theta)
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(log_ratio) - log_ratio  # exp(x) - 1 - x, accurate for small x


def kl_shaped_rewards(
    rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    kind: str = "k1",
) -> torch.Tensor:
    r"""The reward with the KL penalty folded in (``algo.kl_placement: reward``):
    :math:`\tilde r_i = r_i - \beta \sum_{t \in o_i} \mathrm{KL}_{kind,t}`, summed over the
    completion's real tokens only.

    The RLHF placement of the KL term (Ziegler et al. 2019, arXiv:1909.08593; Ouyang et al. 2022)
    that the RLOO paper uses with k1 (Ahmadian et al. 2024, arXiv:2402.14740, sec. 3); k2 and k3
    are honoured as the per-token estimator. No gradient flows: it is part of the reward.

    Args:
        rewards: ``[B]`` rewards.
        logp, ref_logp: ``[B, T]`` log-probs of the sampled tokens under pi_old and pi_ref.
        mask: ``[B, T]`` bool, the completion's real tokens.
        beta: the KL coefficient.
        kind: ``k1`` | ``k2`` | ``k3`` (see :func:`kl_penalty`).

    Returns:
        ``[B]`` shaped rewards in the dtype of ``rewards``.
    """
    per_token = kl_penalty(logp.detach(), ref_logp, kind)
    kl_seq = torch.where(mask, per_token, torch.zeros_like(per_token)).sum(dim=-1)
    return rewards - beta * kl_seq.to(rewards.dtype)
