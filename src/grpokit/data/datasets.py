"""Users' datasets as random-access row sources, and prompt templates.

What it does: ``read_jsonl`` reads a JSONL file (one JSON object per line) and checks the prompt
column exists; ``RowsSource`` serves rows as an endless, seeded, epoch-by-epoch shuffled stream
(``row(i)`` depends only on the seed and i). ``format_prompt`` applies ``data.template``.

What it deliberately does not do (yet): Parquet, CSV, Hugging Face ``datasets`` and chat
templates -- issue #7 adds them behind the same ``row(i)`` interface.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def read_jsonl(path: str | Path, prompt_column: str = "prompt") -> list[dict]:
    """Rows of a JSONL file (one JSON object per line), each checked to have ``prompt_column``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    rows: list[dict] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: each line must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    check_rows(rows, prompt_column, str(path))
    return rows


def check_rows(rows: list[dict], prompt_column: str, where: str = "dataset") -> None:
    if not rows:
        raise ValueError(f"{where} has no rows")
    for n, row in enumerate(rows):
        if prompt_column not in row:
            raise ValueError(
                f"{where}, row {n}: no column {prompt_column!r} (data.prompt_column); "
                f"columns present: {', '.join(row)}"
            )


class RowsSource:
    """Endless stream over a list of rows: ``row(i)``; with ``shuffle`` each epoch is a fresh
    permutation seeded by (seed, epoch), so row i depends only on the seed and i."""

    def __init__(self, rows: list[dict], *, seed: int = 0, shuffle: bool = True) -> None:
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self._perm_epoch, self._perm = -1, list(range(len(rows)))

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> dict:
        epoch, j = divmod(i, len(self.rows))
        if self.shuffle and epoch != self._perm_epoch:
            self._perm = list(range(len(self.rows)))
            random.Random(f"{self.seed}:epoch:{epoch}").shuffle(self._perm)
            self._perm_epoch = epoch
        return dict(self.rows[self._perm[j]])


def format_prompt(row: dict, prompt_column: str = "prompt", template: str | None = None) -> str:
    """The prompt text of a row: ``row[prompt_column]``, or ``template.format(prompt=..., **row)``."""
    prompt = row[prompt_column]
    if template is None:
        return prompt
    try:
        return template.format(**{**row, "prompt": prompt})
    except KeyError as e:
        raise ValueError(
            f"data.template refers to {{{e.args[0]}}}, which is not a column; columns: {', '.join(row)}"
        ) from None
