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

from grpokit.data.tasks import TaskSource
from grpokit.errors import ConfigError, DataError, MissingFileError


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


def build_sources(d, seed: int, dataset=None, eval_dataset=None) -> tuple:
    """``(training source, held-out rows)`` for the run's ``data`` section ``d`` (``config.DataConfig``).

    Training: ``dataset`` (rows given in Python), else the built-in ``d.task`` (an endless seeded
    stream), else the file ``d.path``. Held-out: ``eval_dataset``, else ``d.eval_path``, else the
    task's held-out split (never yielded by its training stream), else none.
    """
    if dataset is not None:
        rows = list(dataset)
        check_rows(rows, d.prompt_column)
        train = RowsSource(rows, seed=seed, shuffle=d.shuffle)
    elif d.task is not None:
        train = TaskSource(d.task, seed=seed)
    else:
        train = RowsSource(load_rows(d.path, d.prompt_column, d.split), seed=seed, shuffle=d.shuffle)
    if eval_dataset is not None:
        eval_rows = list(eval_dataset)
        check_rows(eval_rows, d.prompt_column, "eval dataset")
    elif d.eval_path is not None:
        eval_rows = load_rows(d.eval_path, d.prompt_column, d.eval_split)
    elif d.task is not None and dataset is None:
        source = TaskSource(d.task, split="eval")
        eval_rows = [source.row(i) for i in range(len(source))]
    else:
        eval_rows = []
    return train, eval_rows


def filter_long_prompts(
    train, eval_rows: list[dict], limit: int, length, render, *, seed: int, shuffle: bool
) -> tuple:
    """Drop the rows whose prompt is longer than ``limit`` tokens (``data.max_prompt_length``) from the
    training source and the held-out rows alike. Returns ``(train, eval_rows, dropped, message)``;
    of an endless built-in task the stream itself is filtered and ``dropped`` counts its first 500.

    ``length(row)`` is the prompt's token count, ``render(row)`` the prompt text (for the error).
    A limit that leaves no training or no held-out prompt is refused with the lengths found.
    """

    def refuse(which: str, rows: list[dict]) -> None:
        lengths = [length(r) for r in rows]
        longest = render(rows[lengths.index(max(lengths))])
        raise ConfigError(
            f"data.max_prompt_length={limit} drops every {which} prompt: they are {min(lengths)}-"
            f"{max(lengths)} tokens long (the longest: {longest!r}); set it to at least "
            f"{max(lengths)} to keep them all, or null"
        )

    dropped = 0
    if isinstance(train, RowsSource):
        kept = [r for r in train.rows if length(r) <= limit]
        dropped += len(train.rows) - len(kept)
        if not kept:
            refuse("training", train.rows)
        train = RowsSource(kept, seed=seed, shuffle=shuffle)
    else:  # an endless built-in task: filter the stream itself
        sample = [train.row(i) for i in range(500)]
        num_short = sum(length(r) <= limit for r in sample)
        if num_short == 0:
            refuse("training", sample)
        dropped += len(sample) - num_short
        train = FilteredSource(train, lambda r: length(r) <= limit)
    kept_eval = [r for r in eval_rows if length(r) <= limit]
    if eval_rows and not kept_eval:
        refuse("held-out", eval_rows)
    dropped += len(eval_rows) - len(kept_eval)
    message = None
    if dropped:
        where = "" if isinstance(train, RowsSource) else " (training: of the task's first 500)"
        message = (
            f"grpokit: dropped {dropped} prompts longer than data.max_prompt_length={limit} tokens{where}"
        )
    return train, kept_eval, dropped, message
