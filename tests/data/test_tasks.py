"""Built-in tasks: exact verifiers on right and wrong answers, a safe evaluator, seeded streams."""

from __future__ import annotations

import re
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
    with pytest.raises(
        ValueError, match="unknown task 'chess'; built-in tasks: addition, sort, countdown, word_problems"
    ):
        load_task("chess")
    with pytest.raises(ValueError, match="difficulty must be >= 1"):
        TaskSource("sort", difficulty=0)


def test_task_verifier_is_a_registered_verifier_reward():
    reward = get("task_verifier", task="sort")
    assert reward(["sort:21="], ["12"], answer=["12"]) == [1.0]


def _solve_word_problem(prompt: str) -> tuple[int, int]:
    """An independent reading of a word problem: (answer, number of operations)."""
    sentences = re.findall(r"[^.?]+[.?]", prompt)
    value, ops = int(re.match(r"\w+ has (\d+) \w+\.", sentences[0].strip()).group(1)), 0
    for s in sentences[1:]:
        s = s.strip()
        if m := re.search(r"gets (\d+) more|gives \w+ (\d+) more", s):
            value += int(m.group(1) or m.group(2))
        elif m := re.search(r"gives away (\d+)|loses (\d+) of them", s):
            value -= int(m.group(1) or m.group(2))
        elif m := re.search(r"becomes (\d+) times as many", s):
            value *= int(m.group(1))
        elif m := re.search(r"into (\d+) bags", s):
            assert value % int(m.group(1)) == 0, prompt
            value //= int(m.group(1))
        else:
            continue  # the question and the answer instruction
        ops += 1
        assert 0 <= value <= 200, prompt
    return value, ops


def test_word_problems_have_integer_answers_and_one_to_three_operations():
    source = TaskSource("word_problems", seed=0)
    counts = {1: 0, 2: 0, 3: 0}
    for i in range(300):
        row = source.row(i)
        value, ops = _solve_word_problem(row["prompt"])
        assert str(value) == row["answer"], row
        counts[ops] += 1
        assert row["prompt"].endswith("Put the final answer, a whole number, in \\boxed{}.")
    assert min(counts.values()) > 60, counts  # each of 1, 2, 3 operations is common
    assert {
        _solve_word_problem(TaskSource("word_problems", difficulty=1).row(i)["prompt"])[1] for i in range(50)
    } == {1}


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("12 + 3 = 15. So the answer is \\boxed{15}.", 1.0),
        ("\\boxed{ 15 }", 1.0),
        ("She has 15 apples now.", 1.0),  # no box: the last number
        ("She had 15, then 12.", 0.0),
        ("\\boxed{15} or \\boxed{16}", 0.0),  # a hedge
        ("15 or 16", 0.0),
        ("\\boxed{16}, not 15", 0.0),  # the box wins over the last number
        ("\\boxed{15.5}", 0.0),
        ("\\boxed{1,200}", 0.0),  # thousands separators are read: 1200
        ("", 0.0),
    ],
)
def test_word_problem_verifier_reads_the_box_or_the_final_number(completion, expected):
    assert verify("word_problems", "p", completion, "15") == expected


def test_boxed_format_reward():
    reward = get("boxed_format")
    got = reward(None, ["so \\boxed{12}.", "\\boxed{1} then \\boxed{2}", "\\boxed{x}", "12", "\\boxed{ -3 }"])
    assert got == [1.0, 0.0, 0.0, 0.0, 1.0]
