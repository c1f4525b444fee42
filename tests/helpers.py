"""Small shared pieces of the tests."""

from __future__ import annotations


def varied(prompts, completions, **_):
    """A reward with spread inside most groups: completion length mod 3."""
    return [float(len(c) % 3) for c in completions]
