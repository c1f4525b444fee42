"""Format and length rewards. So far: DAPO's soft overlong punishment.

What it does: ``overlong_penalty`` maps completion lengths (in tokens) to DAPO's length penalty;
the ``overlong`` reward applies it to a batch (it reads the ``completion_ids`` column the trainer
passes to every reward).

What it deliberately does not do (yet): the <think>/<answer> format rewards, tag counts and the
repetition penalty -- issue #5.
"""

from __future__ import annotations

from grpokit.rewards.registry import register


def overlong_penalty(length: int, max_len: int, cache_len: int) -> float:
    r"""DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, sec. 3.4):

    :math:`0` if :math:`|y| \le L_{max} - L_{cache}`;
    :math:`((L_{max} - L_{cache}) - |y|) / L_{cache}` if :math:`L_{max} - L_{cache} < |y| \le L_{max}`;
    :math:`-1` if :math:`|y| > L_{max}`.
    """
    if not 0 < cache_len < max_len:
        raise ValueError(
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
