"""Exceptions a user of grpokit may catch. No heavy imports here: the CLI imports this at start-up."""

from __future__ import annotations

import signal
from pathlib import Path


class UserError(Exception):
    """Input the user can fix (options, data, files, arguments), with the fix in the message.

    The CLI prints a ``UserError`` as one line and exits 2; any other exception is a bug in grpokit
    or in the user's code and keeps its traceback. Each subclass also derives from the builtin
    type a Python caller would expect (``ValueError``, ``FileNotFoundError``...)."""


class ConfigError(UserError, ValueError):
    """A configuration problem, reported before any model is loaded."""


class DataError(UserError, ValueError):
    """Rows that cannot be used: bad JSON, a missing column, no rows, unsupported tests."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the run needs does not exist."""


class RunExistsError(UserError, FileExistsError):
    """The output directory already holds a run."""


class CheckpointError(UserError, RuntimeError):
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
