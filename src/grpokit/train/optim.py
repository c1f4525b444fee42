"""The optimizer and its learning-rate schedule.

What it does: ``build_optimizer`` makes torch's AdamW over the trainable parameters;
``learning_rate(k, t)`` is the rate of optimizer step k (0-based) of a run with ``train`` section
``t``: linear warm-up over ``warmup_steps``, then constant or cosine to 0 over every optimizer
step of the run (``max_steps * mu * steps_per_generation``).

What it deliberately does not do: step, clip or zero gradients (the trainer's update does).
"""

from __future__ import annotations

import math

import torch


def build_optimizer(params: list[torch.nn.Parameter], t) -> torch.optim.Optimizer:
    """AdamW with ``t.lr`` and ``t.weight_decay`` over ``params`` (those with ``requires_grad``)."""
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)


def learning_rate(k: int, t) -> float:
    """Learning rate of optimizer step ``k`` (0-based): linear warm-up, then constant or cosine to 0."""
    total = t.max_steps * t.mu * t.steps_per_generation
    if k < t.warmup_steps:
        return t.lr * (k + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    progress = (k - t.warmup_steps) / max(1, total - t.warmup_steps)
    return t.lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
