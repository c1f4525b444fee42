"""Rollout: turn prompts into G completions each. ``sampler`` is the built-in engine."""

from grpokit.rollout.sampler import Rollout, SamplingParams, sample

__all__ = ["Rollout", "SamplingParams", "sample"]
