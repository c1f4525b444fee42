"""Run-directory logging: metrics.jsonl, samples.jsonl, and the live progress bar.

What it does: writes one JSON object per step to ``metrics.jsonl`` (flushed every line, so a
crash loses nothing already logged), sampled completions to ``samples.jsonl``, the same metrics
to TensorBoard when asked (``logging.tensorboard``), and drives a rich progress bar with step,
reward, accuracy, KL, tokens/s and ETA. NaN values (a metric that has no
value this step, e.g. KL without a reference model) are written as JSON ``null``.

What it deliberately does not do: compute metrics (the trainer and the algo functions do), or
decide what is a warning (``diagnostics`` does).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


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
        fmt("kl", "kl", ".4f"),
        fmt("tokens_per_s", "tok/s", ".0f"),
    ]
    if m.get("eval_accuracy") is not None:
        parts.append(fmt("eval_accuracy", "eval acc", ".1%"))
    return "  ".join(p for p in parts if p)
