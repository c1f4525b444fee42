"""Small shared pieces of the tests."""

from __future__ import annotations

# metrics.jsonl keys that measure the machine, not the run: left out where runs are compared
TIME_KEYS = {"time_sampling_s", "time_scoring_s", "time_training_s", "tokens_per_s"}


def varied(prompts, completions, **_):
    """A reward with spread inside most groups: completion length mod 3."""
    return [float(len(c) % 3) for c in completions]
