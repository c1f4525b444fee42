"""Reward registry and the weighted combination of several rewards.

What it does: maps names to reward factories (``get(name, **options)`` returns the callable),
loads a user's own ``module.path:function``, and scores a batch with several rewards:
each reward's values are checked (length, finiteness) and the weighted sum is formed, with
``None`` meaning "not applicable to this sample" (it contributes nothing).

The reward contract is TRL's: a reward is called **by keyword**,
``reward(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_metric=...,
log_extra=..., **columns) -> list[float | None]``, where ``columns`` holds the dataset's other
columns, one value per completion. With conversational prompts (message lists) a user reward gets
the prompts as message lists and each completion as ``[{"role": "assistant", "content": text}]``;
``async def`` rewards are awaited, all of a batch's concurrently. A function without ``**kwargs``
gets only the arguments it names. grpokit's built-in rewards always get text and the columns. A
function whose parameters are named neither ``prompts`` nor ``completions`` is called the older
grpokit way, ``fn(prompts, completions, **columns)`` (docs/rewards.md has the table).

What it deliberately does not do: turn rewards into advantages (``grpokit.algo``), or hide a
broken reward: NaN or inf from a reward raises, naming the reward and the sample.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpokit.errors import ConfigError

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
        fn = _FACTORIES[name](**options)
        fn._grpokit_builtin = True  # called with text completions and the columns only
        return fn
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"reward {name!r}: cannot import {attr!r} from module {module_name!r} ({e})"
            ) from e
        if not callable(fn):
            raise ConfigError(f"reward {name!r} is not callable")
        if options:
            fn = functools.update_wrapper(functools.partial(fn, **options), fn)
        return fn
    raise ConfigError(
        f"unknown reward {name!r}; registered rewards: {', '.join(names())}, or give 'module.path:function'"
    )


def _load_builtins() -> None:
    # Built-in rewards register themselves on import; importing here keeps `get` self-contained.
    from grpokit.rewards import code, format, math, model, task  # noqa: F401  (register their rewards)


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
    logged_metrics: dict[str, float] = field(default_factory=dict)  # log_metric(name, value): batch means
    extra_columns: dict[str, list] = field(default_factory=dict)  # log_extra(column, values): [B] each

    def take(self, rows: list[int]) -> Scores:
        """The scores of a subset of rows, in that order."""
        idx = torch.tensor(rows, dtype=torch.long)
        total = self.total[idx]
        per = {k: v[idx] for k, v in self.per_reward.items()}
        verifier = None if self.verifier is None else self.verifier[idx]
        unscored = int(torch.stack([torch.isnan(v) for v in per.values()]).all(dim=0).sum()) if per else 0
        extra = {k: [v[i] for i in rows] for k, v in self.extra_columns.items()}
        return Scores(total, per, verifier, unscored, self.num_failed, dict(self.logged_metrics), extra)


def concat_scores(parts: list[Scores]) -> Scores:
    """Scores of several batches, rows one batch after the other."""
    verifier = None if parts[0].verifier is None else torch.cat([p.verifier for p in parts])
    per = {k: torch.cat([p.per_reward[k] for p in parts]) for k in parts[0].per_reward}
    metrics: dict[str, list[float]] = {}
    for p in parts:
        for k, v in p.logged_metrics.items():
            metrics.setdefault(k, []).append(v)
    keys = dict.fromkeys(k for part in parts for k in part.extra_columns)
    extra = {k: [x for p in parts for x in p.extra_columns.get(k, [None] * len(p.total))] for k in keys}
    return Scores(
        torch.cat([p.total for p in parts]),
        per,
        verifier,
        sum(p.num_unscored for p in parts),
        sum(p.num_failed for p in parts),
        {k: sum(v) / len(v) for k, v in metrics.items()},
        extra,
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


# What score() itself passes: never a dataset column a reward could be missing.
_PASSED = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra"}


def required_columns(fn: RewardFn) -> set[str]:
    """The dataset columns ``fn`` cannot run without: its parameters without a default, other than
    what grpokit always passes (and, for a function called positionally, its first two)."""
    if isinstance(fn, ParallelReward):
        fn = get(fn.name, **fn.options)
    try:
        signature = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return set()
    params = list(signature.values())
    if _positional_form(signature):
        params = params[2:]  # the positional (prompts, completions) of the older grpokit form
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in kinds and p.default is p.empty and p.name not in _PASSED}


def check_reward_columns(
    rewards: list[WeightedReward], row: dict, prompt_column: str, answer_column: str, where: str
) -> None:
    """Fail at start-up, before any model loads, when a reward needs a column the data lacks.

    ``row`` is a row of the data: rewards see its columns but the prompt, and the answer column also
    as ``answer`` (``reward_columns``).
    """

    present = [k for k in row if k != prompt_column]
    available = set(present) | ({"answer"} if answer_column in row else set())
    for spec in rewards:
        missing = sorted(required_columns(spec.fn) - available)
        if not missing:
            continue
        hint = (
            f"; rewards get data.answer_column={answer_column!r} as 'answer', and the data has no column "
            f"{answer_column!r}: set data.answer_column to the column holding the reference answer"
            if "answer" in missing
            else "; add the column to the data, or give the reward a default for it"
        )
        raise ConfigError(
            f"reward {spec.name!r} needs the column{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(repr, missing))}, which the {where} does not have; columns present: "
            f"{', '.join(present) or '(none but the prompt)'}{hint}"
        )


def conversational_prompts(rows: list[dict], repeat: int, prompt_column: str = "prompt") -> list | None:
    """The rows' prompts as message lists, each repeated ``repeat`` times (TRL gives conversational
    prompts to rewards this way), or None when the prompts are text."""
    if not rows or not isinstance(rows[0].get(prompt_column), list):
        return None
    return [r[prompt_column] for r in rows for _ in range(repeat)]


@dataclass
class TrainerProgress:
    """What a reward receives as ``trainer_state`` (TRL passes transformers' TrainerState): the step
    being scored (1-based; 0 outside training), the epoch as a float (rows consumed / dataset
    rows; 0 for endless built-in tasks), and the run's ``max_steps``."""

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0


def score(
    rewards: list[WeightedReward],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    completion_ids: list[list[int]] | None = None,
    *,
    messages: list[list[dict]] | None = None,
    state: TrainerProgress | None = None,
) -> Scores:
    """Call every reward on the batch and combine them: ``total = sum_k w_k r_k`` over non-None values.

    Args:
        prompts, completions: the B rendered prompt texts and completion texts.
        columns: the dataset's other columns, B values each (``reward_columns``).
        completion_ids: each completion's tokens, passed as ``completion_ids`` as TRL does.
        messages: the B conversational prompts (message lists) when the dataset's prompts are
            conversational: user rewards then get them as ``prompts`` and each completion as an
            assistant message list, as in TRL. None: text prompts.
        state: passed to user rewards as ``trainer_state``.
    """
    B = len(completions)
    metrics: dict[str, list[float]] = {}
    extra: dict[str, list] = {}

    def log_metric(name: str, value: float) -> None:
        metrics.setdefault(str(name), []).append(float(value))

    def log_extra(column: str, values: list) -> None:
        if len(values) != B:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {B} completions")
        extra.setdefault(str(column), []).extend(values)

    text = {"prompts": prompts, "completions": completions, **columns}
    if completion_ids is not None:
        text["completion_ids"] = completion_ids
    trl = {
        **text,
        "trainer_state": state or TrainerProgress(),
        "log_metric": log_metric,
        "log_extra": log_extra,
    }
    if messages is not None:
        trl["prompts"] = messages
        trl["completions"] = [[{"role": "assistant", "content": c}] for c in completions]
    raw: dict[int, object] = {}
    errors: dict[int, Exception] = {}
    pending = []
    for k, spec in enumerate(rewards):
        kwargs = text if getattr(spec.fn, "_grpokit_builtin", False) else trl
        try:
            out = _invoke(spec.fn, kwargs)
        except Exception as e:
            errors[k] = e
            continue
        if inspect.isawaitable(out):
            pending.append((k, out))
        else:
            raw[k] = out
    if pending:  # every async reward of the batch at once, as TRL does
        results = _run_async([aw for _, aw in pending])
        for (k, _), res in zip(pending, results, strict=True):
            if isinstance(res, BaseException):
                errors[k] = res
            else:
                raw[k] = res

    total = torch.zeros(B, dtype=torch.float64)
    applied = torch.zeros(B, dtype=torch.bool)
    per_reward: dict[str, torch.Tensor] = {}
    verifier_values = []
    failed = 0
    for k, spec in enumerate(rewards):
        try:
            if k in errors:
                raise errors[k]
            values = _check(spec, raw[k], completions)
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
    logged = {k: sum(v) / len(v) for k, v in metrics.items()}
    return Scores(total.float(), per_reward, verifier, int((~applied).sum()), failed, logged, extra)


def _invoke(fn: RewardFn, kwargs: dict):
    """Call ``fn`` by keyword with what it accepts (all of ``kwargs`` when it takes ``**kwargs``);
    a function naming neither ``prompts`` nor ``completions`` is called positionally with them."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: the plain contract
        return fn(**kwargs)
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    if _positional_form(params):
        rest = {k: v for k, v in kwargs.items() if k not in ("prompts", "completions")}
        rest = rest if takes_all else {k: v for k, v in rest.items() if k in params}
        return fn(kwargs["prompts"], kwargs["completions"], **rest)
    return fn(**(kwargs if takes_all else {k: v for k, v in kwargs.items() if k in params}))


def _positional_form(params) -> bool:
    """grpokit's older form ``fn(p, c, **columns)``: parameters named neither ``prompts`` nor
    ``completions``, and room for two positional arguments."""
    if "prompts" in params or "completions" in params:
        return False
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params.values())


def _run_async(awaitables: list) -> list:
    """Await them concurrently; results (or the exceptions raised) in order. Inside a running event
    loop (a notebook) they run on a loop of their own in a helper thread."""

    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    box: list = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(gather())))
    thread.start()
    thread.join()
    return box[0]


def _check(spec: WeightedReward, out, completions: list[str]) -> torch.Tensor:
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

    _grpokit_builtin = True  # it gets text and the columns (no callables to send to a worker)

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


def build_rewards(
    specs, task: str | None = None, *, given=None, overlong: tuple[int, int] | None = None
) -> list[WeightedReward]:
    """A run's rewards, each a :class:`WeightedReward` with a unique name.

    Args:
        specs: the configured rewards (``config.RewardSpec``: name, options, weight, verifier,
            workers, timeout_s, error); used when ``given`` is None.
        task: the built-in task, the default ``task`` option of ``task_verifier``.
        given: callables or :class:`WeightedReward` passed in Python (``GRPOTrainer(rewards=...)``);
            they replace ``specs``.
        overlong: ``(max_len, cache_len)`` adds DAPO's overlong penalty (``algo.overlong_penalty``)
            unless a reward named ``overlong`` is already there.
    """
    out = []
    for r in given if given is not None else ():
        out.append(
            r if isinstance(r, WeightedReward) else WeightedReward(getattr(r, "__name__", "reward"), r)
        )
    for spec in specs if given is None else ():
        options = dict(spec.options)
        if spec.name == "task_verifier" and "task" not in options:
            if task is None:
                raise ConfigError("reward task_verifier needs data.task (or rewards[].options.task)")
            options["task"] = task
        verifier = is_verifier(spec.name) if spec.verifier is None else spec.verifier
        if spec.workers:
            fn = ParallelReward(spec.name, options, spec.workers, spec.timeout_s, spec.error)
        else:
            fn = get(spec.name, **options)
        out.append(WeightedReward(spec.name.split(":")[-1], fn, spec.weight, verifier, spec.error))
    if overlong is not None and not any(r.name == "overlong" for r in out):
        out.append(
            WeightedReward("overlong", get("overlong", max_len=overlong[0], cache_len=overlong[1]), 1.0)
        )
    seen: dict[str, int] = {}  # metric names (reward_<name>_mean) must not collide: _2, _3, ...
    for r in out:
        seen[r.name] = seen.get(r.name, 0) + 1
        if seen[r.name] > 1:
            r.name = f"{r.name}_{seen[r.name]}"
    return out
