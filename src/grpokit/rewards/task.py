"""``task_verifier``: a built-in task's exact verifier (data/tasks.py) as a registered reward."""

from __future__ import annotations

from collections.abc import Callable

from grpokit.data.tasks import get_task
from grpokit.rewards.registry import register


@register("task_verifier", verifier=True)
def task_verifier(task: str) -> Callable[..., list[float]]:
    """The built-in task's exact verifier as a reward: 1.0 if the completion is the answer, else 0.0.

    Needs the ``answer`` column (the built-in tasks provide it). ``task`` defaults to ``data.task``.
    """
    return get_task(task).as_reward()
