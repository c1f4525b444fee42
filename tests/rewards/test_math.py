"""math_accuracy: extraction, exact equivalence, math-verify with guards, hedges, timeouts."""

from __future__ import annotations

import time

import pytest

from grpokit.rewards import get
from grpokit.rewards.math import extract_answer, has_math_verify, parse_number
from grpokit.rewards.workers import WorkerPool

needs_mv = pytest.mark.skipif(not has_math_verify(), reason="math-verify (grpokit[math]) is not installed")


@pytest.mark.parametrize(
    "text,answer",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"first \boxed{1}, finally \boxed{\frac{3}{4}}", r"\frac{3}{4}"),
        (r"\boxed{\frac{a}{\sqrt{b^{2}}}}", r"\frac{a}{\sqrt{b^{2}}}"),  # nested braces
        (r"\fbox{7}", "7"),
        ("Natalia sold 48 clips.\n#### 72", "72"),
        ("<think>2+2</think><answer> 4 </answer>", "4"),
        (r"<answer>it is \boxed{9}</answer>", "9"),
        ("I think 3 apples, then 5 pears, so 8.", "8"),
        ("The total is $1,234.", "1,234"),
        ("no number here", None),
        (r"\boxed{unclosed", None),
    ],
)
def test_extraction(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "s,value",
    [
        ("42", 42),
        ("-12", -12),
        ("0.50", 0.5),
        ("1,234", 1234),
        ("1,234.5", 1234.5),
        ("3/4", 0.75),
        (r"\frac{3}{4}", 0.75),
        (r"\dfrac{3}{4}", 0.75),
        (r"\frac34", 0.75),
        (r"-\frac{1}{2}", -0.5),
        (r"\$18", 18),
        ("$18$", 18),
        (r"50\%", 50),
        ("5 \\text{ cm}", 5),
        ("18 dollars", 18),
        (".5", 0.5),
        ("12.", 12),
        (r"90^\circ", 90),
        ("x+1", None),
        ("1/0", None),
        ("1,23", None),
        (r"\sqrt{2}", None),
    ],
)
def test_exact_number_parser(s, value):
    got = parse_number(s)
    assert (got is None) if value is None else (got == pytest.approx(value) and got is not None)


def score(completions, answers, **options):
    reward = get("math_accuracy", **options)
    return reward(["q"] * len(completions), completions, answer=answers)


EXACT_CASES = [  # (completion, gold, expected) decided by the exact parser alone
    (r"\boxed{42}", "42", 1.0),
    (r"\boxed{42.0}", "42", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{2}{4}}", "1/2", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{\$18}", "18", 1.0),
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    (r"\boxed{-3}", "3", 0.0),
    (r"\boxed{43}", "42", 0.0),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0.0),
    ("the answer is 7", "7", 1.0),
    ("it is 7 or 8", "7", 0.0),
    (r"\boxed{3} or \boxed{4}", "3", 0.0),
    (r"\boxed{3 \text{ or } 4}", "3", 0.0),
    ("either 5 or 6, so 5", "5", 1.0),
    ("nothing", "5", 0.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
]


@pytest.mark.parametrize("completion,gold,expected", EXACT_CASES)
def test_exact_cases_without_math_verify(completion, gold, expected):
    assert score([completion], [gold], use_math_verify=False) == [expected]


SYMBOLIC_CASES = [
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\frac{\pi}{2}", 1.0),
    (r"\boxed{x^2+2x+1}", r"(x+1)^2", 1.0),
    (r"\boxed{x^2+1}", r"(x+1)^2", 0.0),
    (r"\boxed{\frac{1}{2004!}}", r"\frac{1}{2006!}", 0.0),
    (r"\boxed{\frac{1}{2006!}}", r"\frac{1}{2006!}", 1.0),
    (r"\boxed{1/2^{99}}", r"1/2^{98}", 0.0),
    (r"\boxed{1-\frac{1}{e}}", r"1+\frac{1}{e}", 0.0),
    (r"\boxed{1-\frac{1}{e}}", r"\frac{e-1}{e}", 1.0),
    (r"\boxed{(-\infty, 3)}", "x<3", 1.0),
    (r"\boxed{x<3}", r"(-\infty, 3)", 1.0),
    (r"\boxed{(-\infty, 3]}", "x<3", 0.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
]


@needs_mv
@pytest.mark.parametrize("completion,gold,expected", SYMBOLIC_CASES)
def test_symbolic_cases_with_math_verify_and_its_guards(completion, gold, expected):
    assert score([completion], [gold]) == [expected]


def _sleep(seconds):
    time.sleep(seconds)
    return seconds


def _boom(_):
    raise RuntimeError("bad input")


def test_worker_pool_kills_slow_tasks_without_blocking_the_rest():
    pool = WorkerPool(num_workers=2, timeout_s=1.0)
    try:
        t0 = time.monotonic()
        results = pool.map(_sleep, [0.01, 30, 0.02, 30, 0.03])
        elapsed = time.monotonic() - t0
        assert [r.ok for r in results] == [True, False, True, False, True]
        assert results[1].timed_out and "timeout" in results[1].error
        assert elapsed < 10  # two 30 s tasks were killed at 1 s each
        assert pool.num_killed == 2
        (err,) = pool.map(_boom, [1])
        assert not err.ok and "RuntimeError: bad input" in err.error
        assert [r.value for r in pool.map(_sleep, [0.0])] == [0.0]  # replaced workers still serve
    finally:
        pool.close()


@needs_mv
def test_a_pathological_answer_is_bounded_by_the_timeout():
    reward = get("math_accuracy", timeout_s=2.0)
    t0 = time.monotonic()
    got = reward(
        ["q"] * 3,
        [r"\boxed{9^{9^{9^{9^9}}}}", r"\boxed{\sqrt{4}}", r"\boxed{9^{9^{9^{9^9}}}-1}"],
        answer=[r"9^{9^{9^{9^9}}}+1", "2", r"9^{9^{9^{9^9}}}"],
    )
    assert got[1] == 1.0 and got[0] == 0.0 and got[2] == 0.0
    assert time.monotonic() - t0 < 30


@needs_mv
def test_deeply_nested_brackets_are_bounded_too():
    reward = get("math_accuracy", timeout_s=2.0)
    nested = "(" * 60 + "1" + ")" * 60
    t0 = time.monotonic()
    got = reward(["q"] * 2, [rf"\boxed{{{nested}}}", r"\boxed{\sqrt{9}}"], answer=["2", "3"])
    assert got == [0.0, 1.0] and time.monotonic() - t0 < 30
