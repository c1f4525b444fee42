"""Built-in synthetic tasks with exact verifiers: the embedded default that needs no download.

What it does: each task makes a (prompt, answer) pair from a seeded ``random.Random`` and a
difficulty, and verifies a completion exactly (reward 1.0 or 0.0). ``TaskSource`` gives
random access to an endless training stream (row i is a pure function of the seed and i, so a
resumed run continues exactly where it stopped) and to a fixed held-out set that the training
stream avoids.

What it deliberately does not do: parse answers leniently. The completion, stripped of
surrounding whitespace, must equal the answer: a verifier that accepts near-misses can be hacked.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from grpokit.data.answers import extract_answer, is_hedged
from grpokit.errors import ConfigError


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    make: Callable[[random.Random, int], tuple[str, str]]  # (rng, difficulty) -> (prompt, answer)
    verify: Callable[[str, str, str], float]  # (prompt, completion, answer) -> 1.0 | 0.0
    default_difficulty: int
    env: str | None = None  # the environment the task needs (rollout.env), e.g. "calculator"

    def as_reward(self) -> Callable[..., list[float]]:
        """The exact verifier as a batched reward ``(prompts, completions, answer, **columns)``:
        1.0 where the completion is the answer, else 0.0. (Registered as ``task_verifier`` in
        ``rewards/task.py``.)"""
        check = self.verify

        def reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
            return [check(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]

        reward.__name__ = f"task_verifier[{self.name}]"
        return reward


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer else 0.0


def _verify_exact(prompt: str, completion: str, answer: str) -> float:
    return exact_match(completion, answer)


def _make_addition(rng: random.Random, digits: int) -> tuple[str, str]:
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return f"{a}+{b}=", str(a + b)


def _make_multiplication(rng: random.Random, digits: int) -> tuple[str, str]:
    """Operands of 3 to ``digits`` digits (at least 3): beyond what the tiny model does in its head."""
    lo = min(3, digits)
    n, m = rng.randint(lo, digits), rng.randint(lo, digits)
    a, b = rng.randrange(10 ** (n - 1), 10**n), rng.randrange(10 ** (m - 1), 10**m)
    return f"{a}*{b}=", str(a * b)


def _make_sort(rng: random.Random, length: int) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(length))
    return f"sort:{digits}=", "".join(sorted(digits))


# --- Countdown: reach the target with each given number exactly once and + - * / ( ). ---------


def _make_countdown(rng: random.Random, count: int) -> tuple[str, str]:
    """Numbers 1..9 combined by a random expression; the target is its value (a positive integer),
    so every problem has a solution. The answer column holds one solution (any other counts too)."""
    for _ in range(1000):
        nums = [rng.randint(1, 9) for _ in range(count)]
        expr = str(nums[0])
        for n in nums[1:]:
            op = rng.choice("+-*/")
            expr = f"({expr}){op}{n}" if op in "*/" and any(c in expr for c in "+-") else f"{expr}{op}{n}"
        value = evaluate_arithmetic(expr)
        if value is not None and value.denominator == 1 and 0 < value <= 99:
            shuffled = nums[:]
            rng.shuffle(shuffled)
            return f"{int(value)} from {' '.join(map(str, shuffled))}=", expr
    raise RuntimeError("could not draw a countdown problem")  # unreachable for count >= 1


def evaluate_arithmetic(expr: str) -> Fraction | None:
    """Exact value of an expression of non-negative integers, + - * / and parentheses, or None.

    A small recursive-descent parser over Fractions: never ``eval``; None for anything malformed,
    division by zero, or more than 64 tokens (bounds the work a completion can cause).
    """
    tokens = _TOKEN.findall(expr.replace(" ", ""))
    if not tokens or "".join(tokens) != expr.replace(" ", "") or len(tokens) > 64:
        return None
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def expression(depth: int) -> Fraction:
        value = term(depth)
        while peek() in ("+", "-"):
            value = value + term(depth) if take() == "+" else value - term(depth)
        return value

    def term(depth: int) -> Fraction:
        value = factor(depth)
        while peek() in ("*", "/"):
            op, rhs = take(), factor(depth)
            value = value * rhs if op == "*" else value / rhs  # ZeroDivisionError -> None below
        return value

    def factor(depth: int) -> Fraction:
        tok = peek()
        if tok == "(" and depth < 16:
            take()
            value = expression(depth + 1)
            if peek() != ")":
                raise ValueError("unbalanced")
            take()
            return value
        if tok is not None and tok.isdigit():
            return Fraction(int(take()))
        raise ValueError(f"unexpected {tok!r}")

    try:
        value = expression(0)
    except (ValueError, ZeroDivisionError):
        return None
    return value if pos == len(tokens) else None


_TOKEN = re.compile(r"\d+|[-+*/()]")


def _verify_countdown(prompt: str, completion: str) -> float:
    """1.0 iff the completion is an expression using each given number exactly once that equals the target."""
    m = re.fullmatch(r"(\d+) from ([\d ]+)=", prompt)
    if m is None:
        return 0.0
    target, numbers = int(m.group(1)), sorted(int(x) for x in m.group(2).split())
    expr = completion.strip()
    used = sorted(int(x) for x in re.findall(r"\d+", expr))
    value = evaluate_arithmetic(expr)
    return 1.0 if used == numbers and value is not None and value == target else 0.0


# --- Word problems: grade-school arithmetic in sentences, for pretrained instruct models. --------

_NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Lily", "Max", "Nora", "Ben", "Emma", "Jack")
_ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "coins", "books", "shells", "cards")
WORD_PROBLEM_INSTRUCTION = "Put the final answer, a whole number, in \\boxed{}."


def _make_word_problem(rng: random.Random, max_ops: int) -> tuple[str, str]:
    """A quantity changed by 1..``max_ops`` operations (+ - * /), one sentence each; every
    intermediate value is a non-negative integer <= 200, so the answer is a whole number."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    value = rng.randint(2, 20)
    sentences = [f"{name} has {value} {item}."]
    for _ in range(rng.randint(1, max_ops)):
        ops = ["add", "sub"] + (["mul"] if value <= 40 else []) + (["div"] if _divisors(value) else [])
        op = rng.choice([o for o in ops if o != "sub" or value >= 2])
        if op == "add":
            n = rng.randint(2, 20)
            value += n
            sentences.append(rng.choice([f"Then {name} gets {n} more.", f"A friend gives {name} {n} more."]))
        elif op == "sub":
            n = rng.randint(1, min(value - 1, 20))
            value -= n
            sentences.append(rng.choice([f"Then {name} gives away {n}.", f"{name} loses {n} of them."]))
        elif op == "mul":
            n = rng.randint(2, min(5, 200 // value))
            value *= n
            sentences.append(f"Then the number of {item} becomes {n} times as many.")
        else:
            n = rng.choice(_divisors(value))
            value //= n
            sentences.append(f"{name} splits them equally into {n} bags and keeps one bag.")
    sentences.append(f"How many {item} does {name} have now? {WORD_PROBLEM_INSTRUCTION}")
    return " ".join(sentences), str(value)


def _divisors(value: int) -> list[int]:
    return [d for d in range(2, 6) if value % d == 0 and value // d >= 1]


def _verify_final_number(prompt: str, completion: str, answer: str) -> float:
    r"""1.0 iff the completion's final answer is the integer ``answer``: the last ``\boxed{}`` if
    there is one, else the last number in the text (extraction as ``math_accuracy``'s); several
    different boxed answers (a hedge) score 0."""
    got = extract_answer(completion)
    if got is None or is_hedged(completion, got):
        return 0.0
    got = got.replace(",", "").strip().rstrip(".")
    return 1.0 if re.fullmatch(r"-?\d+", got) is not None and int(got) == int(answer) else 0.0


TASKS: dict[str, Task] = {
    "addition": Task(
        "addition",
        "a+b= with operands of up to `difficulty` digits; answer: the sum",
        _make_addition,
        _verify_exact,
        default_difficulty=2,
    ),
    "sort": Task(
        "sort",
        "sort:<digits>= with `difficulty` digits; answer: the digits in ascending order",
        _make_sort,
        _verify_exact,
        default_difficulty=6,
    ),
    "countdown": Task(
        "countdown",
        "<target> from <numbers>= with `difficulty` numbers 1-9; answer: an expression "
        "using each number once with + - * / ( ) that equals the target",
        _make_countdown,
        lambda prompt, completion, answer: _verify_countdown(prompt, completion),
        default_difficulty=3,
    ),
    "word_problems": Task(
        "word_problems",
        "grade-school arithmetic in 1-`difficulty` sentences of + - * / on one quantity (integers); "
        "answer: the final count, read from \\boxed{} or the last number",
        _make_word_problem,
        _verify_final_number,
        default_difficulty=3,
    ),
    "calculator": Task(
        "calculator",
        "a*b= with operands of 3 to `difficulty` digits, to be solved with the calculator tool "
        "(rollout.env: calculator); answer: the product, as the model's last message",
        _make_multiplication,
        _verify_exact,
        default_difficulty=4,
        env="calculator",
    ),
}

EVAL_SEED = "grpokit-eval"  # the held-out set is the same for every run of a task and difficulty


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}")
    return TASKS[name]


class TaskSource:
    """Rows ``{"prompt", "answer"}`` of a built-in task: ``row(i)`` for any i >= 0, deterministic.

    ``split="eval"`` gives a fixed set of ``eval_size`` distinct problems (independent of
    ``seed``); ``split="train"`` is endless and skips problems of that eval set when the problem
    space is large enough to (up to 64 redraws per row).
    """

    def __init__(
        self,
        task: str,
        *,
        seed: int = 0,
        difficulty: int | None = None,
        split: str = "train",
        eval_size: int = 500,
    ) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.task = get_task(task)
        self.difficulty = self.task.default_difficulty if difficulty is None else difficulty
        if self.difficulty < 1:
            raise ValueError(f"difficulty must be >= 1, got {self.difficulty}")
        self.seed, self.split = seed, split
        self._eval = self._eval_rows(eval_size)
        self._eval_prompts = {r["prompt"] for r in self._eval}

    def _eval_rows(self, size: int) -> list[dict]:
        rng = random.Random(f"{EVAL_SEED}:{self.task.name}:{self.difficulty}")
        rows, seen = [], set()
        for _ in range(size * 64):
            if len(rows) == size:
                break
            prompt, answer = self.task.make(rng, self.difficulty)
            if prompt not in seen:
                seen.add(prompt)
                rows.append({"prompt": prompt, "answer": answer})
        return rows

    def __len__(self) -> int:
        return len(self._eval) if self.split == "eval" else 2**62

    def row(self, i: int) -> dict:
        if self.split == "eval":
            return dict(self._eval[i])
        rng = random.Random(f"{self.seed}:{self.task.name}:{self.difficulty}:{i}")
        for _ in range(64):
            prompt, answer = self.task.make(rng, self.difficulty)
            if prompt not in self._eval_prompts:
                break
        return {"prompt": prompt, "answer": answer}


@dataclass
class LoadedTask:
    """What ``load_task`` returns: the training stream, the held-out rows, and the verifier reward."""

    task: Task
    train: TaskSource
    eval_rows: list[dict]
    reward: Callable[..., list[float]]


def load_task(name: str, *, seed: int = 0, difficulty: int | None = None, eval_size: int = 500) -> LoadedTask:
    """A built-in task ready to train on: ``train.row(i)``, ``eval_rows`` and its 0/1 ``reward``."""
    train = TaskSource(name, seed=seed, difficulty=difficulty, eval_size=eval_size)
    held_out = TaskSource(name, difficulty=difficulty, split="eval", eval_size=eval_size)
    eval_rows = [held_out.row(i) for i in range(len(held_out))]
    return LoadedTask(train.task, train, eval_rows, train.task.as_reward())
