"""Users' datasets as random-access row sources, and prompt templates.

What it does: ``load_rows`` reads local JSONL, JSON, CSV and Parquet files, Hugging Face datasets
saved with ``save_to_disk`` and local dataset directories/scripts (through the ``datasets``
extra), and checks the prompt column exists, listing the columns present when it does not.
``RowsSource`` serves rows as an endless, seeded, epoch-by-epoch shuffled stream (``row(i)``
depends only on the seed and i). ``build_prompt`` turns a row into the text the model sees: a
format-string template or DeepSeek-R1's, an optional system prompt, and the tokenizer's chat
template (always for conversational prompts, i.e. lists of messages).

What it deliberately does not do: download anything, or tokenize (the sampler does).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from grpokit.errors import DataError, MissingFileError


def read_jsonl(path: str | Path, prompt_column: str = "prompt") -> list[dict]:
    """Rows of a JSONL file (one JSON object per line), each checked to have ``prompt_column``."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"data file {str(path)!r} does not exist")
    rows: list[dict] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: each line must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    check_rows(rows, prompt_column, str(path))
    return rows


def load_rows(path: str | Path, prompt_column: str = "prompt", split: str = "train") -> list[dict]:
    """Rows of a local dataset: ``.jsonl``, ``.json`` (a list of objects), ``.csv``, ``.parquet``, a
    directory saved by ``datasets.save_to_disk``, or a local directory/script ``datasets.load_dataset``
    reads (its ``split``)."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if path.is_file() and suffix == ".jsonl":
        return read_jsonl(path, prompt_column)
    if path.is_file() and suffix == ".json":
        data = json.loads(path.read_text())
        rows = data if isinstance(data, list) else data.get("data") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise DataError(f"{path}: a .json dataset must be a list of objects (or {{'data': [...]}})")
    elif path.is_file() and suffix == ".csv":
        import csv

        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    elif path.is_file() and suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading .parquet needs pyarrow: pip install 'grpokit[datasets]'") from None
        rows = pq.read_table(path).to_pylist()
    else:
        rows = _hf_rows(path, split)
    check_rows(rows, prompt_column, str(path))
    return rows


def _hf_rows(path: Path, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{path} is not a .jsonl/.json/.csv/.parquet file; reading Hugging Face datasets needs "
            "pip install 'grpokit[datasets]'"
        ) from None
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(path))
    else:
        ds = datasets.load_dataset(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split {split!r} (data.split); splits present: {', '.join(ds)}")
        ds = ds[split]
    return ds.to_list()


def check_rows(rows: list[dict], prompt_column: str, where: str = "dataset") -> None:
    if not rows:
        raise DataError(f"{where} has no rows")
    for n, row in enumerate(rows):
        if prompt_column not in row:
            raise DataError(
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


class FilteredSource:
    """The rows of an endless ``source`` that ``keep`` accepts: ``row(i)`` is the i-th accepted row,
    a pure function of the source and i (so resume stays exact). Used for ``data.max_prompt_length``
    on a built-in task's stream."""

    def __init__(self, source, keep) -> None:
        self.source, self.keep = source, keep
        self._accepted: list[int] = []  # source indices of the accepted rows, in order
        self._scanned = 0

    def __len__(self) -> int:
        return len(self.source)

    def row(self, i: int) -> dict:
        misses = 0
        while len(self._accepted) <= i:
            if self.keep(self.source.row(self._scanned)):
                self._accepted.append(self._scanned)
                misses = 0
            else:
                misses += 1
                if misses > 100_000:  # the caller checks a sample first; this is only a backstop
                    raise RuntimeError("the prompt filter rejected 100,000 rows in a row")
            self._scanned += 1
        return self.source.row(self._accepted[i])


R1_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here "
    "</answer>. User: {prompt}. Assistant:"
)  # DeepSeek-R1-Zero's training template (DeepSeek-AI 2025, arXiv:2501.12948, Table 1)

TEMPLATES = {"r1": R1_TEMPLATE}


def format_prompt(row: dict, prompt_column: str = "prompt", template: str | None = None) -> str:
    """The prompt text of a row: ``row[prompt_column]``, or ``template.format(prompt=..., **row)``.

    ``template`` is a format string or the name of a built-in one (``"r1"``).
    """
    prompt = row[prompt_column]
    if template is None:
        return prompt
    template = TEMPLATES.get(template, template)
    try:
        return template.format(**{**row, "prompt": prompt})
    except KeyError as e:
        raise DataError(
            f"data.template refers to {{{e.args[0]}}}, which is not a column; columns: {', '.join(row)}"
        ) from None


def build_prompt(
    row: dict,
    tokenizer=None,
    *,
    prompt_column: str = "prompt",
    template: str | None = None,
    system_prompt: str | None = None,
    chat_template: bool = False,
) -> str:
    """The text the model is given for ``row``.

    A conversational prompt (a list of ``{"role", "content"}`` messages) always goes through the
    tokenizer's chat template. A text prompt is formatted with ``template`` and, with
    ``chat_template=True``, wrapped as one user message (after ``system_prompt``) and rendered with
    ``apply_chat_template(..., add_generation_prompt=True)``.
    """
    value = row[prompt_column]
    if isinstance(value, list):
        messages = [dict(m) for m in value]
        if system_prompt and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return _chat(tokenizer, messages)
    text = format_prompt(row, prompt_column, template)
    if not chat_template:
        return f"{system_prompt}\n{text}" if system_prompt else text
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": text}
    ]
    return _chat(tokenizer, messages)


def _chat(tokenizer, messages: list[dict]) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "this prompt needs the tokenizer's chat template (conversational rows, or data.chat_template: "
            "true), but the tokenizer has none; set data.chat_template: false and use a text template"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
