"""Exceptions a user of grpokit may catch. No heavy imports here: the CLI imports this at start-up."""

from __future__ import annotations

import signal
from pathlib import Path


class ConfigError(ValueError):
    """A configuration problem, reported before any model is loaded (the CLI prints it as one line)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, partial or corrupt."""


class TrainingInterrupted(RuntimeError):
    """Raised by ``GRPOTrainer.train()`` after SIGINT / SIGTERM, once the current step is done and saved."""

    def __init__(self, step: int, signum: int, checkpoint: Path | None, run_dir: Path) -> None:
        self.step, self.signum, self.checkpoint, self.run_dir = step, signum, checkpoint, run_dir
        name = signal.Signals(signum).name
        super().__init__(
            f"{name} received: stopped after step {step}, checkpoint saved to {checkpoint}; "
            f"resume with: grpokit train --resume {run_dir}"
        )
