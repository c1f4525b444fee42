"""Format and length rewards: think/answer format, tag counts, repetition, overlong and cosine length.

What it does: small, deterministic rewards over the completion text (and its token count, from
the ``completion_ids`` column the trainer passes to every reward):
``think_format`` (R1's ``<think>...</think><answer>...</answer>``, strict or soft), ``tag_count``,
``boxed_format`` (exactly one ``\\boxed{}`` holding a number),
``repetition`` (n-gram repetition penalty), ``overlong`` (DAPO's soft overlong punishment) and
``length`` (cosine length scaling of a correctness reward).

What it deliberately does not do: judge correctness itself; ``length`` asks another registered
verifier (``math_accuracy`` by default).
"""

from __future__ import annotations

import math
import re

from grpokit.errors import ConfigError
from grpokit.rewards.registry import get, register

_BODY = r"(?:(?!</?think>|</?answer>).)*"  # any text without another tag in it
_STRICT = re.compile(rf"<think>\n{_BODY}\n</think>\n<answer>\n{_BODY}\n</answer>", re.S)
_SOFT = re.compile(rf"<think>{_BODY}</think>\s*<answer>{_BODY}</answer>", re.S)


@register("think_format")
def think_format(mode: str = "strict"):
    """1.0 if the completion has R1's format, else 0.0.

    ``strict``: the whole completion is ``<think>\n...\n</think>\n<answer>\n...\n</answer>``;
    ``soft``: a ``<think>...</think>`` followed by ``<answer>...</answer>`` appears somewhere.
    """
    if mode not in ("strict", "soft"):
        raise ConfigError(f"think_format: mode must be 'strict' or 'soft', got {mode!r}")

    def reward(prompts, completions, **_):
        if mode == "strict":  # surrounding whitespace aside, the completion is exactly the format
            return [1.0 if _STRICT.fullmatch(c.strip()) else 0.0 for c in completions]
        return [1.0 if _SOFT.search(c) else 0.0 for c in completions]

    reward.__name__ = "think_format"
    return reward


@register("tag_count")
def tag_count():
    """0.25 for each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` that appears exactly once.

    A shaping reward that gives partial credit while the format is being learned.
    """

    def reward(prompts, completions, **_):
        tags = ("<think>", "</think>", "<answer>", "</answer>")
        return [sum(0.25 for t in tags if c.count(t) == 1) for c in completions]

    reward.__name__ = "tag_count"
    return reward


_BOXED_NUMBER = re.compile(r"\\boxed\{\s*-?\d[\d,]*(?:\.\d+)?\s*\}")


@register("boxed_format")
def boxed_format():
    r"""1.0 if the completion holds exactly one ``\boxed{...}`` and it is a plain number, else 0.0.

    The shaping reward of the ``word_problems`` task: it pays for the answer format the verifier
    reads first, whether or not the number is right (the verifier pays for that).
    """

    def reward(prompts, completions, **_):
        return [1.0 if c.count("\\boxed") == 1 and _BOXED_NUMBER.search(c) else 0.0 for c in completions]

    reward.__name__ = "boxed_format"
    return reward


def repetition_penalty(text: str, ngram: int, max_penalty: float) -> float:
    r"""``-max_penalty * (1 - unique / total)`` over the word n-grams of ``text`` (0 for < n words).

    Yeo et al. 2025, "Demystifying Long Chain-of-Thought Reasoning in LLMs", arXiv:2502.03373.
    """
    words = text.lower().split()
    grams = [tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)]
    if not grams:
        return 0.0
    return -max_penalty * (1.0 - len(set(grams)) / len(grams))


@register("repetition")
def repetition(ngram: int = 3, max_penalty: float = 1.0):
    """N-gram repetition penalty in [-max_penalty, 0]: 0 when no word n-gram repeats."""
    if ngram < 1 or max_penalty < 0:
        raise ConfigError(f"repetition: need ngram >= 1 and max_penalty >= 0, got {ngram}, {max_penalty}")

    def reward(prompts, completions, **_):
        return [repetition_penalty(c, ngram, max_penalty) for c in completions]

    reward.__name__ = "repetition"
    return reward


def cosine_scaled(
    correct: bool, length: int, max_len: int, correct_range=(0.5, 1.0), wrong_range=(-1.0, -0.5)
):
    r"""Yeo et al. 2025 (arXiv:2502.03373), eq. 1: :math:`r = \eta_{min} + \tfrac12(\eta_{max} - \eta_{min})
    (1 + \cos(\pi\, t / T))` with t = min(length, T).

    Correct: from ``correct_range[1]`` (short) down to ``correct_range[0]`` at T, so short right
    answers earn more; wrong: from ``wrong_range[0]`` (short) up to ``wrong_range[1]`` at T, so a
    wrong answer is penalised less when the model thought longer.
    """
    lo, hi = correct_range if correct else (wrong_range[1], wrong_range[0])
    t = min(length, max_len) / max_len
    return lo + 0.5 * (hi - lo) * (1.0 + math.cos(math.pi * t))


@register("length")
def length(
    max_len: int,
    verifier: str = "math_accuracy",
    correct_range=(0.5, 1.0),
    wrong_range=(-1.0, -0.5),
    **verifier_options,
):
    """Cosine length-scaled correctness: correctness from the ``verifier`` reward, scaled by token count."""
    if max_len < 1:
        raise ConfigError(f"length: max_len must be >= 1, got {max_len}")
    check = get(verifier, **verifier_options)

    def reward(prompts, completions, completion_ids, **columns):
        ok = check(prompts, completions, completion_ids=completion_ids, **columns)
        return [
            None
            if o is None
            else cosine_scaled(o == 1.0, len(ids), max_len, tuple(correct_range), tuple(wrong_range))
            for o, ids in zip(ok, completion_ids, strict=True)
        ]

    reward.__name__ = "length"
    return reward


def overlong_penalty(length: int, max_len: int, cache_len: int) -> float:
    r"""DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, sec. 3.4):

    :math:`0` if :math:`|y| \le L_{max} - L_{cache}`;
    :math:`((L_{max} - L_{cache}) - |y|) / L_{cache}` if :math:`L_{max} - L_{cache} < |y| \le L_{max}`;
    :math:`-1` if :math:`|y| > L_{max}`.
    """
    if not 0 < cache_len < max_len:
        raise ConfigError(
            f"overlong penalty needs 0 < cache_len < max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    free = max_len - cache_len
    if length <= free:
        return 0.0
    if length <= max_len:
        return (free - length) / cache_len
    return -1.0


@register("overlong")
def overlong(max_len: int, cache_len: int | None = None):
    """DAPO's length penalty as a reward, on the completions' token counts (``completion_ids``).

    ``cache_len`` defaults to ``max_len // 4``. With ``max_len = rollout.max_new_tokens`` a
    completion the sampler truncated has exactly ``max_len`` tokens and scores -1.
    """
    cache = max(1, max_len // 4) if cache_len is None else cache_len

    def reward(prompts, completions, completion_ids, **_):
        return [overlong_penalty(len(ids), max_len, cache) for ids in completion_ids]

    reward.__name__ = "overlong"
    return reward
