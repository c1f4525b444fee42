"""Group-relative advantages: turn each group's rewards into per-completion advantages.

What it does: for a batch of ``B = N * G`` rewards laid out group after group (the G completions
of prompt 0, then the G of prompt 1, ...), subtract a per-group baseline and optionally divide by
a standard deviation. That is the whole of GRPO's "critic".

What it deliberately does not do: combine several reward functions (the reward layer sums them
before this), look at tokens, or broadcast to tokens (the loss does that).

Shape legend: N groups, G completions per group, B = N * G.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce")
SCALES = ("group", "batch", "none")

# The scale each estimator uses when the caller does not choose one (scale=None).
_DEFAULT_SCALE = {"grpo": "group", "dr_grpo": "none", "rloo": "none", "reinforce": "none"}

# Ties are detected on the rewards themselves, not on the std, because float32 means leave
# residuals: twelve rewards of 0.7 give r - mean of about 6e-8, and (r - mean) / (std + eps)
# would hand every member a spurious non-zero advantage. Rewards within this relative spread
# of each other count as equal.
TIE_RTOL = 1e-6


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    estimator: str = "grpo",
    scale: str | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    r"""Per-completion advantages relative to each completion's own group.

    Baselines (``estimator``):

    - ``"grpo"`` (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, eq. for outcome supervision):
      :math:`A_i = (r_i - \mathrm{mean}(r_{1..G})) / (\mathrm{std}(r_{1..G}) + \epsilon)`,
      std unbiased (``torch.std`` default, divisor G - 1).
    - ``"dr_grpo"`` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783): :math:`A_i = r_i - \mathrm{mean}(r)`;
      dividing by the std is exactly the question-level difficulty bias that paper removes.
    - ``"rloo"`` (REINFORCE Leave-One-Out, Ahmadian et al. 2024, arXiv:2402.14740):
      :math:`A_i = r_i - \frac{1}{G-1}\sum_{j \ne i} r_j = \frac{G}{G-1}(r_i - \mathrm{mean}(r))`.
    - ``"reinforce"`` (Williams 1992, no baseline): :math:`A_i = r_i`. Not a GRPO method: the
      baseline-free control of the hacking lab (``grpokit lab hacking``), where group
      normalisation's effect is measured against it. Tied groups are *not* zeroed here.

    Divisor (``scale``):

    - ``"group"``: the group's unbiased std plus ``eps``;
    - ``"batch"``: the unbiased std of all B rewards plus ``eps`` (the baseline stays per group;
      "Tricks or Traps", Liu et al. 2025, arXiv:2508.08221);
    - ``"none"``: no division;
    - ``None`` (default): the estimator's own choice -- ``"group"`` for grpo, ``"none"`` for
      dr_grpo and rloo. ``dr_grpo`` with a std scale is GRPO itself and is refused.

    A group whose rewards are all equal (spread ``max - min <= 1e-6 * max(1, max|r|)``) carries no
    learning signal and gets advantage exactly 0, never NaN and never float residue.

    Args:
        rewards: float ``[B]``, ordered group after group.
        group_size: G, completions per prompt (>= 2).
        estimator: ``"grpo" | "dr_grpo" | "rloo"``.
        scale: ``"group" | "batch" | "none" | None``.
        eps: added to the std before dividing (>= 0).

    Returns:
        ``[B]`` advantages in ``rewards.dtype``. Computed in float64 internally.

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
        tensor([ 0.7070, -0.7070,  0.0000,  0.0000])
    """
    _check_inputs(rewards, group_size, estimator, scale, eps)
    scale = _DEFAULT_SCALE[estimator] if scale is None else scale

    r_NG = rewards.to(torch.float64).reshape(-1, group_size)
    if estimator == "reinforce":  # no baseline at all: every reward is its own advantage
        return _scaled(r_NG, scale, eps).reshape(-1).to(rewards.dtype)
    mean_N1 = r_NG.mean(dim=1, keepdim=True)
    centered_NG = r_NG - mean_N1
    if estimator == "rloo":
        # r_i - (sum - r_i) / (G - 1) == G / (G - 1) * (r_i - mean)
        centered_NG = centered_NG * (group_size / (group_size - 1))

    if scale == "group":
        adv_NG = centered_NG / (r_NG.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        adv_NG = centered_NG / (r_NG.std() + eps)
    else:
        adv_NG = centered_NG

    spread_N1 = r_NG.amax(dim=1, keepdim=True) - r_NG.amin(dim=1, keepdim=True)
    tol_N1 = TIE_RTOL * r_NG.abs().amax(dim=1, keepdim=True).clamp(min=1.0)
    adv_NG = torch.where(spread_N1 <= tol_N1, torch.zeros_like(adv_NG), adv_NG)
    return adv_NG.reshape(-1).to(rewards.dtype)


def _scaled(x_NG: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
    if scale == "group":
        return x_NG / (x_NG.std(dim=1, keepdim=True) + eps)
    if scale == "batch":
        return x_NG / (x_NG.std() + eps)
    return x_NG


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool ``[N]``: which groups have all-equal rewards (same tie rule as :func:`group_advantages`).

    The fraction of such groups is the "no learning signal" metric (``zero_std_fraction``) and
    what DAPO's dynamic sampling filters on.
    """
    _check_inputs(rewards, group_size, "grpo", "group", 0.0)
    r_NG = rewards.to(torch.float64).reshape(-1, group_size)
    spread_N = r_NG.amax(dim=1) - r_NG.amin(dim=1)
    return spread_N <= TIE_RTOL * r_NG.abs().amax(dim=1).clamp(min=1.0)


def _check_inputs(
    rewards: torch.Tensor, group_size: int, estimator: str, scale: str | None, eps: float
) -> None:
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D tensor [B], got {shape}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got {rewards.dtype}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2 (a group of one has no relative advantage), got {group_size!r}"
        )
    if rewards.numel() == 0 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} elements, which is not a positive multiple of "
            f"group_size={group_size}; lay rewards out as n_groups * group_size, group after group"
        )
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten()[:5].tolist()
        raise ValueError(f"rewards contain NaN or inf at positions {bad}; fix the reward function")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if scale is not None and scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES} or None, got {scale!r}")
    if estimator == "dr_grpo" and scale in ("group", "batch"):
        raise ValueError(
            f"estimator='dr_grpo' means no std scaling, but scale={scale!r} was given; "
            "use scale='none' (or None), or estimator='grpo' to scale by the std"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


def decoupled_advantages(
    rewards_KB: torch.Tensor,
    weights: list[float],
    group_size: int,
    *,
    estimator: str = "grpo",
    scale: str | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    r"""Multi-reward "normalize then sum" (GDPO, Liu et al. 2026, arXiv:2601.05242):

    :math:`\tilde A_i = \sum_k w_k\,A^{(k)}_i` with :math:`A^{(k)}` = :func:`group_advantages` of
    reward k alone, then batch normalisation
    :math:`A_i = (\tilde A_i - \mathrm{mean}(\tilde A)) / (\mathrm{std}(\tilde A) + \epsilon)`.

    Normalising each reward inside its group before summing keeps reward combinations that a
    joint normalisation would collapse onto the same advantage apart (GDPO sec. 3); the final batch
    normalisation keeps the scale independent of the number of rewards. A batch whose summed
    advantages are all 0 stays exactly 0.

    Args:
        rewards_KB: ``[K, B]`` one row per reward function, completions group after group.
        weights: K weights.

    Returns:
        ``[B]`` advantages in ``rewards_KB.dtype``.
    """
    if rewards_KB.dim() != 2 or rewards_KB.shape[0] != len(weights):
        raise ValueError(
            f"rewards_KB must be [K, B] with K = len(weights) = {len(weights)}, got {tuple(rewards_KB.shape)}"
        )
    summed_B = torch.zeros(rewards_KB.shape[1], dtype=torch.float64)
    for r_B, w in zip(rewards_KB, weights, strict=True):
        summed_B += w * group_advantages(r_B, group_size, estimator=estimator, scale=scale, eps=eps).double()
    if bool((summed_B == 0).all()):
        return summed_B.to(rewards_KB.dtype)
    return ((summed_B - summed_B.mean()) / (summed_B.std() + eps)).to(rewards_KB.dtype)
