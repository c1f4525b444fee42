"""Format, repetition, overlong and cosine-length rewards; the error policy and failure count."""

from __future__ import annotations

import math

import pytest

from grpokit.rewards import get, score
from grpokit.rewards.format import cosine_scaled, repetition_penalty
from grpokit.rewards.registry import WeightedReward

GOOD = "<think>\nadd them\n</think>\n<answer>\n7\n</answer>"


@pytest.mark.parametrize(
    "completion,strict,soft",
    [
        (GOOD, 1.0, 1.0),
        ("  " + GOOD + "\n", 1.0, 1.0),
        ("<think>add</think><answer>7</answer>", 0.0, 1.0),  # no newlines: soft only
        ("preamble " + GOOD, 0.0, 1.0),
        ("<answer>\n7\n</answer>\n<think>\nx\n</think>", 0.0, 0.0),  # wrong order
        ("<think>\na\n</think>\n<answer>\n7\n</answer>\n<answer>\n8\n</answer>", 0.0, 1.0),  # two answers
        ("<think>\na <think> b\n</think>\n<answer>\n7\n</answer>", 0.0, 1.0),  # soft finds the inner pair
        ("7", 0.0, 0.0),
    ],
)
def test_think_format(completion, strict, soft):
    assert get("think_format")(["p"], [completion]) == [strict]
    assert get("think_format", mode="soft")(["p"], [completion]) == [soft]


def test_tag_count_partial_credit():
    reward = get("tag_count")
    assert reward(["p"] * 3, [GOOD, "<think></think>", "<think><think></think>"]) == [1.0, 0.5, 0.25]


def test_repetition_penalty_by_hand():
    assert repetition_penalty("a b c d e", 3, 1.0) == 0.0  # 3 distinct trigrams
    # "a b a b a b": trigrams aba, bab, aba, bab -> 2 unique of 4 -> -0.5
    assert repetition_penalty("a b a b a b", 3, 1.0) == pytest.approx(-0.5)
    assert repetition_penalty("too short", 3, 1.0) == 0.0
    assert get("repetition", ngram=2, max_penalty=0.5)(["p"], ["x y x y"]) == [
        pytest.approx(-0.5 * (1 - 2 / 3))
    ]


def test_cosine_length_scaling_by_hand():
    assert cosine_scaled(True, 0, 100) == pytest.approx(1.0)
    assert cosine_scaled(True, 100, 100) == pytest.approx(0.5)
    assert cosine_scaled(True, 50, 100) == pytest.approx(0.75)
    assert cosine_scaled(False, 0, 100) == pytest.approx(-1.0)
    assert cosine_scaled(False, 100, 100) == pytest.approx(-0.5)
    assert cosine_scaled(False, 500, 100) == pytest.approx(-0.5)  # capped at T
    reward = get("length", max_len=10, use_math_verify=False)
    got = reward(
        ["q", "q"], [r"\boxed{4}", r"\boxed{5}"], answer=["4", "4"], completion_ids=[[1] * 5, [1] * 5]
    )
    assert got == [pytest.approx(0.5 + 0.25 * (1 + math.cos(math.pi / 2))), pytest.approx(-0.75)]


def test_overlong_reward_reads_token_counts():
    reward = get("overlong", max_len=8)  # cache 2: free up to 6
    assert reward(["p"] * 3, ["a", "b", "c"], completion_ids=[[1] * 6, [1] * 7, [1] * 8]) == [0.0, -0.5, -1.0]


def _raises(prompts, completions, **_):
    raise KeyError("missing column")


def test_error_policy_raise_names_the_reward_and_zero_counts_failures():
    ok = WeightedReward("ok", lambda p, c, **_: [1.0] * len(c))
    with pytest.raises(RuntimeError, match=r"reward 'bad' raised KeyError.*set error: zero"):
        score([ok, WeightedReward("bad", _raises)], ["p"] * 2, ["a", "b"], {})
    s = score([ok, WeightedReward("bad", _raises, error="zero")], ["p"] * 2, ["a", "b"], {})
    assert s.total.tolist() == [1.0, 1.0] and s.num_failed == 2


def test_bad_options_are_clear():
    with pytest.raises(ValueError, match="mode must be 'strict' or 'soft'"):
        get("think_format", mode="loose")
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        get("length", max_len=0)
    with pytest.raises(ValueError, match=r"unknown reward 'nope'; registered rewards: .*math_accuracy"):
        get("nope")
