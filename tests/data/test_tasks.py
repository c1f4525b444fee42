"""Built-in tasks: exact verifiers on right and wrong answers, a safe evaluator, seeded streams."""

from __future__ import annotations

from fractions import Fraction

import pytest

from grpokit.data.tasks import TASKS, TaskSource, evaluate_arithmetic, load_task
from grpokit.rewards import get


def verify(task, prompt, completion, answer=""):
    return TASKS[task].verify(prompt, completion, answer)


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("46", 1.0),
        (" 46\n", 1.0),
        ("46 ", 1.0),
        ("046", 0.0),
        ("45", 0.0),
        ("46.0", 0.0),
        ("4 6", 0.0),
        ("", 0.0),
        ("46=46", 0.0),
        ("the answer is 46", 0.0),
        ("46\n47", 0.0),
    ],
)
def test_addition_is_exact(completion, expected):
    assert verify("addition", "12+34=", completion, "46") == expected


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("112345", 1.0),
        ("12345", 0.0),
        ("543211", 0.0),
        ("1123456", 0.0),
        ("11234", 0.0),
        ("", 0.0),
        ("112 345", 0.0),
    ],
)
def test_sort_is_exact(completion, expected):
    prompt, answer = "sort:514231=", "112345"
    assert verify("sort", prompt, completion, answer) == expected


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("3*5+7", 1.0),  # 22
        ("7+5*3", 1.0),  # precedence: 7 + 15
        ("(7+5)*3", 0.0),  # 36
        ("3*5+7 ", 1.0),
        ("3*(5)+7", 1.0),
        ("15+7", 0.0),  # right value, wrong numbers
        ("3*5+7+0", 0.0),  # an extra number
        ("3*5*7", 0.0),
        ("3*5+7)", 0.0),  # unbalanced
        ("3**5", 0.0),
        ("__import__('os')", 0.0),
        ("22", 0.0),
        ("", 0.0),
        ("3*5+7=22", 0.0),
    ],
)
def test_countdown_checks_numbers_and_value(completion, expected):
    assert verify("countdown", "22 from 3 5 7=", completion) == expected


def test_countdown_division_is_exact_and_by_zero_is_wrong():
    assert verify("countdown", "2 from 8 4 1=", "8/4*1") == 1.0
    assert verify("countdown", "3 from 7 2 1=", "7/2+1") == 0.0  # 4.5, no rounding
    assert verify("countdown", "1 from 1 1 0=", "1/(1-1)+0") == 0.0
    assert verify("countdown", "garbage", "1+1") == 0.0


@pytest.mark.parametrize(
    "expr,value",
    [
        ("1+2*3", Fraction(7)),
        ("(1+2)*3", Fraction(9)),
        ("7/2", Fraction(7, 2)),
        ("8-3-2", Fraction(3)),
        ("8/4/2", Fraction(1)),
        ("((((1))))", Fraction(1)),
        ("1/0", None),
        ("1+", None),
        ("2**3", None),
        ("-1", None),
        ("1e3", None),
        ("(" * 40 + "1" + ")" * 40, None),
        ("+".join(["1"] * 40), None),
    ],
)
def test_evaluator_is_a_parser_not_eval(expr, value):
    assert evaluate_arithmetic(expr) == value


@pytest.mark.parametrize("task", list(TASKS))
def test_streams_are_seeded_held_out_and_solvable(task):
    a, b = TaskSource(task, seed=3), TaskSource(task, seed=3)
    assert [a.row(i) for i in range(50)] == [b.row(i) for i in range(50)]
    assert [a.row(i) for i in range(20)] != [TaskSource(task, seed=4).row(i) for i in range(20)]
    held = TaskSource(task, split="eval")
    assert len(held) == 500 and len({held.row(i)["prompt"] for i in range(500)}) == 500
    held_prompts = {held.row(i)["prompt"] for i in range(500)}
    assert not held_prompts & {a.row(i)["prompt"] for i in range(2000)}
    # the reference answer of every row verifies, so every problem is solvable
    for i in range(200):
        row = a.row(i)
        assert verify(task, row["prompt"], row["answer"], row["answer"]) == 1.0


def test_difficulty_knob_and_load_task():
    assert len(TaskSource("sort", difficulty=9).row(0)["answer"]) == 9
    assert TaskSource("countdown", difficulty=4).row(0)["prompt"].count(" ") == 5  # "T from a b c d="
    loaded = load_task("addition", difficulty=3, eval_size=50)
    assert len(loaded.eval_rows) == 50
    row = loaded.train.row(0)
    assert loaded.reward([row["prompt"]] * 2, [row["answer"], "x"], answer=[row["answer"]] * 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match="unknown task 'chess'; built-in tasks: addition, sort, countdown"):
        load_task("chess")
    with pytest.raises(ValueError, match="difficulty must be >= 1"):
        TaskSource("sort", difficulty=0)


def test_task_verifier_is_a_registered_verifier_reward():
    reward = get("task_verifier", task="sort")
    assert reward(["sort:21="], ["12"], answer=["12"]) == [1.0]
