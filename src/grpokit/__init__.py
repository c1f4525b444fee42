"""grpokit: post-train causal language models with GRPO (Group Relative Policy Optimization).

The math lives in :mod:`grpokit.algo` (pure torch, tested against float64 references).
"""

__version__ = "0.1.0"
