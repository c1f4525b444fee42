"""grpokit: post-train causal language models with GRPO (Group Relative Policy Optimization).

Public API::

    from grpokit import GRPOConfig, GRPOTrainer, load_config, load_task, rewards

The math lives in :mod:`grpokit.algo` (pure torch, tested against float64 references). Names are
imported on first use, so ``import grpokit`` stays cheap (no transformers import).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "GRPOConfig": ("grpokit.config", "GRPOConfig"),
    "load_config": ("grpokit.config", "load_config"),
    "GRPOTrainer": ("grpokit.train.trainer", "GRPOTrainer"),
    "load_task": ("grpokit.data.tasks", "load_task"),
    "rewards": ("grpokit.rewards", None),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'grpokit' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    return mod if attr is None else getattr(mod, attr)
