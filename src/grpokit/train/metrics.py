"""Run-directory logging: metrics.jsonl, samples.jsonl, and the live progress bar.

What it does: writes one JSON object per step to ``metrics.jsonl`` (flushed every line, so a
crash loses nothing already logged), sampled completions to ``samples.jsonl``, the same metrics
to TensorBoard when asked (``logging.tensorboard``), and drives a rich progress bar with step,
reward, accuracy, KL, tokens/s and ETA. NaN values (a metric that has no
value this step, e.g. KL without a reference model) are written as JSON ``null``.

It also lays out a step's row (``step_metrics``, from the values the trainer and the algo
functions computed) and picks the logged samples (``sample_rows``).

What it deliberately does not do: compute the statistics themselves, or decide what is a warning
(``diagnostics`` does).
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpokit.algo import zero_std_groups

if TYPE_CHECKING:
    import torch

    from grpokit.rewards.registry import Scores
    from grpokit.rollout.sampler import Rollout
    from grpokit.train.batch import UpdateStats


def json_safe(value: Any) -> Any:
    """Floats that JSON cannot hold (NaN, inf) become None; tensors become Python numbers."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def append_jsonl(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(json_safe(row)) + "\n")


class RunLogger:
    """Owns the run directory's log files and the progress bar."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        quiet: bool = False,
        start_step: int = 0,
        tensorboard: bool = False,
    ) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self._progress = None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard extra

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if not quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold cyan]GRPO"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def log_step(self, metrics: dict) -> None:
        append_jsonl(self.metrics_path, metrics)
        if self._tb is not None:
            for key, value in metrics.items():  # the same keys as metrics.jsonl
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, metrics["step"])
            self._tb.flush()
        if self._progress is not None:
            self._progress.update(self._task, completed=metrics["step"], info=progress_text(metrics))

    def log_samples(self, rows: list[dict]) -> None:
        for row in rows:
            append_jsonl(self.samples_path, row)

    def print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def progress_text(m: dict) -> str:
    def fmt(key: str, label: str, spec: str) -> str | None:
        v = m.get(key)
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return None
        return f"{label} {v:{spec}}"

    parts = [
        fmt("reward_mean", "reward", ".3f"),
        fmt("accuracy", "acc", ".1%"),
        fmt("tool_call_fraction", "tool calls", ".0%"),
        fmt("kl", "kl", ".4f"),
        fmt("tokens_per_s", "tok/s", ".0f"),
    ]
    if m.get("eval_accuracy") is not None:
        parts.append(fmt("eval_accuracy", "eval acc", ".1%"))
    return "  ".join(p for p in parts if p)


def step_metrics(
    step: int, rollout: Rollout, scores: Scores, adv_B: torch.Tensor, stats: UpdateStats, times
) -> dict:
    """The step's row of metrics.jsonl: rewards, advantages, the update's statistics, lengths, times."""
    t0, t_sampled, t1, _, t3 = times  # start, sampling done (summed), generation done, advantages, update
    total, lengths = scores.total, rollout.completion_lengths.float()
    return {
        "step": step,
        "loss": stats.loss,
        "reward_mean": float(total.mean()),
        "reward_std": float(total.std()),
        **{f"reward_{k}_mean": float(v.nanmean()) for k, v in scores.per_reward.items()},
        "accuracy": None if scores.verifier is None else float(scores.verifier.nanmean()),
        "advantage_mean": float(adv_B.mean()),
        "advantage_std": float(adv_B.std()),
        "advantage_abs_mean": float(adv_B.abs().mean()),
        "zero_std_fraction": float(zero_std_groups(total, rollout.group_size).float().mean()),
        "kl": stats.kl,
        "clip_fraction": stats.clip_fraction,
        "clip_fraction_low": stats.clip_fraction_low,
        "clip_fraction_high": stats.clip_fraction_high,
        "ratio_mean": stats.ratio_mean,
        "ratio_max": stats.ratio_max,
        "entropy": stats.entropy,
        "completion_length_mean": float(lengths.mean()),
        "completion_length_max": int(lengths.max()),
        "truncated_fraction": float(rollout.truncated.float().mean()),
        "grad_norm": stats.grad_norm,
        "grad_nonfinite_steps": stats.nonfinite_grad_steps,
        "prompt_shared_fraction": stats.shared_rows / stats.rows if stats.rows else float("nan"),
        "num_unscored": scores.num_unscored,
        "reward_failures": scores.num_failed,
        "time_sampling_s": t_sampled - t0,
        "time_scoring_s": t1 - t_sampled,
        "time_training_s": t3 - t1,
        "tokens_per_s": float(lengths.sum()) / max(t3 - t0, 1e-9),
        **episode_metrics(rollout),
    }


def episode_metrics(rollout: Rollout) -> dict:
    """Multi-turn runs: model turns, tool calls and failed tool calls per episode (means), the share of
    episodes with a call, and environment tokens per episode; nothing for single-turn runs."""
    eps = rollout.episodes
    if eps is None:
        return {}
    n = len(eps)
    env_tokens = rollout.completion_mask.sum() - rollout.trained_mask.sum()
    return {
        "turns_mean": sum(e.num_turns for e in eps) / n,
        "tool_calls_mean": sum(e.num_tool_calls for e in eps) / n,
        "tool_call_fraction": sum(e.num_tool_calls > 0 for e in eps) / n,
        "tool_errors": sum(e.num_tool_errors for e in eps),
        "env_tokens_mean": float(env_tokens) / n,
    }


def run_summary(
    steps: int, wall: float, world_size: int, counts: dict, alerts: list, stopped_early: str | None,
    last: dict, task: str | None, before: dict | None, after: dict | None,
) -> dict:  # fmt: skip
    """summary.json: the run's size and outcome, the held-out evaluations before and after."""
    s = {"steps": steps, "wall_time_s": round(wall, 3), "world_size": world_size, **counts, "alerts": alerts,
         "stopped_early": stopped_early, "final_step_metrics": last}  # fmt: skip
    if task is not None:
        s["task"] = task
    for tag, ev in (("before", before), ("after", after)):
        if ev is not None:
            s[f"reward_{tag}"], s[f"accuracy_{tag}"] = ev["reward_mean"], ev["accuracy"]
            s[f"eval_examples_{tag}"] = ev["examples"]
    return s


def sample_rows(
    seed: int, step: int, n: int, prompts_B: list[str], rollout: Rollout, scores: Scores, adv_B: torch.Tensor
) -> list[dict]:
    """``n`` of the step's completions for samples.jsonl, picked by their own ``random.Random`` (seeded
    by the run's seed and the step), so logging more or fewer never changes the training trajectory."""
    rng = random.Random(f"{seed}:samples:{step}")
    picks = sorted(rng.sample(range(rollout.num_rows), min(n, rollout.num_rows)))
    return [
        {
            "step": step,
            "prompt": prompts_B[i],
            "completion": rollout.completions[i],
            **({} if rollout.episodes is None else rollout.episodes[i].as_dict()),
            "reward": float(scores.total[i]),
            "advantage": float(adv_B[i]),
            "rewards": {k: float(v[i]) for k, v in scores.per_reward.items()},
            **(
                {"extra": {k: json_safe(v[i]) for k, v in scores.extra_columns.items()}}
                if scores.extra_columns
                else {}
            ),
        }
        for i in picks
    ]


class NoLogger:
    """Ranks other than 0 write nothing: the run directory is rank 0's."""

    def log_step(self, metrics: dict) -> None: ...

    def log_samples(self, rows: list[dict]) -> None: ...

    def print(self, text: str) -> None: ...

    def close(self) -> None: ...


def truncate_logs(run_dir: Path, step: int) -> None:
    """Keep only the metrics.jsonl / samples.jsonl lines of steps <= ``step`` (atomic rewrite).

    After a crash the logs may run past the checkpoint being resumed; those steps are re-run, so
    their old lines go, and every step ends up logged exactly once.
    """
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = run_dir / name
        if not path.exists():
            continue
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # a line cut by the crash: nothing after it is trustworthy
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
