"""Reward registry and the weighted combination of several rewards.

What it does: maps names to reward factories (``get(name, **options)`` returns the callable),
loads a user's own ``module.path:function``, and scores a batch with several rewards:
each reward's values are checked (length, finiteness) and the weighted sum is formed, with
``None`` meaning "not applicable to this sample" (it contributes nothing).

The reward contract (TRL-compatible): ``reward(prompts, completions, **columns) -> list[float | None]``
where ``columns`` holds the dataset's other columns, one value per completion.

What it deliberately does not do: turn rewards into advantages (``grpokit.algo``), or hide a
broken reward: NaN or inf from a reward raises, naming the reward and the sample.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

RewardFn = Callable[..., list]

_FACTORIES: dict[str, Callable[..., RewardFn]] = {}
_VERIFIERS: set[str] = set()


def register(name: str, *, verifier: bool = False):
    """Decorator: register ``factory(**options) -> reward`` under ``name``.

    ``verifier=True`` marks an exact 0/1 check of correctness: its mean is reported as
    ``accuracy`` and the hacking monitor treats it as ground truth.
    """

    def deco(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if name in _FACTORIES:
            raise ValueError(f"reward {name!r} is already registered")
        _FACTORIES[name] = factory
        if verifier:
            _VERIFIERS.add(name)
        return factory

    return deco


def names() -> list[str]:
    _load_builtins()
    return sorted(_FACTORIES)


def is_verifier(name: str) -> bool:
    _load_builtins()
    return name in _VERIFIERS


def get(name: str, **options) -> RewardFn:
    """The reward called ``name``, built with ``options``; or a user's ``module.path:function``.

    A user function is used as the reward itself; ``options`` are bound as keyword arguments.
    """
    _load_builtins()
    if name in _FACTORIES:
        return _FACTORIES[name](**options)
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(
                f"reward {name!r}: cannot import {attr!r} from module {module_name!r} ({e})"
            ) from e
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
        if options:
            inner = fn

            def fn(prompts, completions, **columns):
                return inner(prompts, completions, **columns, **options)

            fn.__name__ = getattr(inner, "__name__", name)
        return fn
    raise ValueError(
        f"unknown reward {name!r}; registered rewards: {', '.join(names())}, or give 'module.path:function'"
    )


def _load_builtins() -> None:
    # Built-in rewards register themselves on import; importing here keeps `get` self-contained.
    from grpokit.data import tasks  # noqa: F401  (registers task_verifier)
    from grpokit.rewards import code, format, math, model  # noqa: F401  (register their rewards)


@dataclass
class WeightedReward:
    """One configured reward: its name (for metrics), the callable, its weight, and whether it verifies."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    verifier: bool = False
    error: str = (
        "raise"  # a reward that raises: "raise" stops the run, "zero" scores the batch 0 and counts it
    )


@dataclass
class Scores:
    """The rewards of a batch of B completions."""

    total: torch.Tensor  # [B] float32 weighted sum over applicable rewards
    per_reward: dict[str, torch.Tensor]  # name -> [B] float32, NaN where the reward returned None
    verifier: torch.Tensor | None  # [B] mean of the verifier rewards that applied, NaN if none did
    num_unscored: int  # completions for which every reward returned None (total is 0 there)
    num_failed: int = 0  # completions a reward failed on (raised under error=zero, or timed out inside)

    def take(self, rows: list[int]) -> Scores:
        """The scores of a subset of rows, in that order."""
        idx = torch.tensor(rows, dtype=torch.long)
        total = self.total[idx]
        per = {k: v[idx] for k, v in self.per_reward.items()}
        verifier = None if self.verifier is None else self.verifier[idx]
        unscored = int(torch.stack([torch.isnan(v) for v in per.values()]).all(dim=0).sum()) if per else 0
        return Scores(total, per, verifier, unscored, self.num_failed)


def concat_scores(parts: list[Scores]) -> Scores:
    """Scores of several batches, rows one batch after the other."""
    verifier = None if parts[0].verifier is None else torch.cat([p.verifier for p in parts])
    per = {k: torch.cat([p.per_reward[k] for p in parts]) for k in parts[0].per_reward}
    return Scores(
        torch.cat([p.total for p in parts]),
        per,
        verifier,
        sum(p.num_unscored for p in parts),
        sum(p.num_failed for p in parts),
    )


def reward_columns(
    rows: list[dict], repeat: int, prompt_column: str = "prompt", answer_column: str = "answer"
):
    """The dataset columns a reward sees: every column but the prompt, each value repeated ``repeat``
    times to line up with the completions; the answer column is also given as ``answer``."""
    keys = [k for k in rows[0] if k != prompt_column]
    columns = {k: [r.get(k) for r in rows for _ in range(repeat)] for k in keys}
    if answer_column != "answer" and answer_column in columns:
        columns["answer"] = columns[answer_column]
    return columns


def score(
    rewards: list[WeightedReward],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    completion_ids: list[list[int]] | None = None,
) -> Scores:
    """Call every reward on the batch and combine them: ``total = sum_k w_k r_k`` over non-None values.

    ``completion_ids`` (each completion's tokens) is passed to the rewards as a column, as TRL does.
    """
    if completion_ids is not None:
        columns = {**columns, "completion_ids": completion_ids}
    B = len(completions)
    total = torch.zeros(B, dtype=torch.float64)
    applied = torch.zeros(B, dtype=torch.bool)
    per_reward: dict[str, torch.Tensor] = {}
    verifier_values = []
    failed = 0
    for spec in rewards:
        try:
            values = _call(spec, prompts, completions, columns)
            failed += int(getattr(spec.fn, "last_failures", 0) or 0)
        except Exception as e:
            if spec.error != "zero":
                raise RuntimeError(
                    f"reward {spec.name!r} raised {type(e).__name__}: {e} "
                    "(set error: zero on this reward to score such batches 0 and count them instead)"
                ) from e
            values = torch.zeros(B, dtype=torch.float64)
            failed += B
        per_reward[spec.name] = values.float()
        ok = ~torch.isnan(values)
        total += torch.where(ok, values * spec.weight, torch.zeros_like(values))
        applied |= ok
        if spec.verifier:
            verifier_values.append(values)
    verifier = torch.stack(verifier_values).nanmean(dim=0).float() if verifier_values else None
    return Scores(total.float(), per_reward, verifier, int((~applied).sum()), failed)


def _call(spec: WeightedReward, prompts, completions, columns) -> torch.Tensor:
    out = spec.fn(prompts, completions, **columns)
    if inspect.isgenerator(out):
        out = list(out)
    if len(out) != len(completions):
        raise ValueError(
            f"reward {spec.name!r} returned {len(out)} values for {len(completions)} completions"
        )
    values = torch.tensor([float("nan") if v is None else float(v) for v in out], dtype=torch.float64)
    bad = [i for i, v in enumerate(out) if v is not None and not torch.isfinite(values[i])]
    if bad:
        raise ValueError(
            f"reward {spec.name!r} returned NaN or inf for completions {bad[:5]} "
            f"(e.g. {completions[bad[0]]!r}); return None for 'not applicable', or fix the reward"
        )
    return values


_WORKER_CACHE: dict[str, RewardFn] = {}


def _score_one(task: tuple) -> float | None:
    """Worker side of :class:`ParallelReward`: build the reward once per process, score one sample."""
    name, options, prompt, completion, row = task
    key = repr((name, sorted(options.items())))
    if key not in _WORKER_CACHE:
        _WORKER_CACHE[key] = get(name, **options)
    out = _WORKER_CACHE[key]([prompt], [completion], **{k: [v] for k, v in row.items()})
    return out[0]


class ParallelReward:
    """A reward run one completion at a time in worker processes, each with a hard timeout.

    Any registered or ``module:function`` reward works: each worker builds it by name. A sample
    that raises or times out scores 0 under ``error="zero"`` (counted in ``last_failures``), or
    stops the run under ``error="raise"``.
    """

    def __init__(self, name: str, options: dict, workers: int, timeout_s: float, error: str) -> None:
        from grpokit.rewards.workers import shared_pool

        self.name, self.options, self.error = name, dict(options), error
        self.pool = shared_pool(workers, timeout_s)
        self.__name__ = name.split(":")[-1]
        self.last_failures = 0

    def __call__(self, prompts, completions, **columns):
        tasks = [
            (self.name, self.options, p, c, {k: v[i] for k, v in columns.items()})
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
        ]
        out, self.last_failures = [], 0
        for i, res in enumerate(self.pool.map(_score_one, tasks)):
            if res.ok:
                out.append(res.value)
                continue
            if self.error != "zero":
                raise RuntimeError(
                    f"reward {self.name!r} failed on completion {i}: {res.error} "
                    "(set error: zero to score it 0 and count it instead)"
                )
            out.append(0.0)
            self.last_failures += 1
        return out
