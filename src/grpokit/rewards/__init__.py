"""Rewards: ``get(name, **options)`` returns the callable
``reward(prompts, completions, **columns) -> list[float | None]``.
"""

from grpokit.rewards.registry import WeightedReward, get, is_verifier, names, register, score

__all__ = ["WeightedReward", "get", "is_verifier", "names", "register", "score"]
