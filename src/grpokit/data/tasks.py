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
from collections.abc import Callable
from dataclasses import dataclass

from grpokit.rewards.registry import register


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    make: Callable[[random.Random, int], tuple[str, str]]  # (rng, difficulty) -> (prompt, answer)
    verify: Callable[[str, str], float]  # (completion, answer) -> 1.0 | 0.0
    default_difficulty: int


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer else 0.0


def _make_addition(rng: random.Random, digits: int) -> tuple[str, str]:
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return f"{a}+{b}=", str(a + b)


TASKS: dict[str, Task] = {
    "addition": Task(
        "addition",
        "a+b= with operands of up to `difficulty` digits; answer: the sum",
        _make_addition,
        exact_match,
        default_difficulty=2,
    ),
}

EVAL_SEED = "grpokit-eval"  # the held-out set is the same for every run of a task and difficulty


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}")
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


@register("task_verifier", verifier=True)
def task_verifier(task: str):
    """The built-in task's exact verifier as a reward: 1.0 if the completion is the answer, else 0.0.

    Needs the ``answer`` column (the built-in tasks provide it).
    """
    check = get_task(task).verify

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [check(c, a) for c, a in zip(completions, answer, strict=True)]

    reward.__name__ = f"task_verifier[{task}]"
    return reward
