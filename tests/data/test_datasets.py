"""Users' datasets in every supported format, prompt templates, chat templates, long-prompt filtering."""

from __future__ import annotations

import csv
import json

import pytest

from grpokit.data.datasets import R1_TEMPLATE, RowsSource, build_prompt, load_rows
from grpokit.models.tiny import char_tokenizer

ROWS = [{"question": "1+1?", "answer": "2", "level": 1}, {"question": "2+3?", "answer": "5", "level": 2}]


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    with (tmp_path / "d.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        w.writeheader()
        w.writerows(ROWS)
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(tmp_path / "hf"))
    return tmp_path


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.parquet", "hf"])
def test_every_format_gives_the_same_rows(files, name):
    assert load_rows(files / name, "question") == ROWS


def test_csv_rows_are_strings_and_splits_are_chosen(files):
    assert load_rows(files / "d.csv", "question") == [{k: str(v) for k, v in r.items()} for r in ROWS]
    assert load_rows(files / "hf", "question", split="test") == ROWS[:1]
    with pytest.raises(ValueError, match=r"no split 'validation'.*splits present: train, test"):
        load_rows(files / "hf", "question", split="validation")


def test_missing_column_lists_the_columns(files):
    with pytest.raises(
        ValueError,
        match=r"no column 'prompt' \(data.prompt_column\); columns present: question, answer, level",
    ):
        load_rows(files / "d.jsonl", "prompt")
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load_rows(files / "nope.jsonl")


def test_shuffle_is_seeded_per_epoch_and_can_be_off():
    rows = [{"prompt": str(i)} for i in range(10)]
    a, b = RowsSource(rows, seed=1), RowsSource(rows, seed=1)
    epoch = [a.row(i)["prompt"] for i in range(10)]
    assert epoch == [b.row(i)["prompt"] for i in range(10)] and sorted(epoch) == sorted(
        r["prompt"] for r in rows
    )
    assert [a.row(10 + i)["prompt"] for i in range(10)] != epoch  # a new permutation next epoch
    plain = RowsSource(rows, shuffle=False)
    assert [plain.row(i)["prompt"] for i in range(12)] == [str(i) for i in range(10)] + ["0", "1"]


def chat_tokenizer():
    tok = char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


def test_templates_system_prompts_and_chat():
    row = {"question": "1+1?", "answer": "2"}
    assert build_prompt(row, prompt_column="question", template="Q: {prompt} A:") == "Q: 1+1? A:"
    assert build_prompt(row, prompt_column="question", template="r1") == R1_TEMPLATE.format(prompt="1+1?")
    assert "<think> </think> and <answer> </answer>" in R1_TEMPLATE
    assert build_prompt(row, prompt_column="question", system_prompt="Be brief.") == "Be brief.\n1+1?"
    tok = chat_tokenizer()
    assert build_prompt(
        row, tok, prompt_column="question", system_prompt="Be brief.", chat_template=True
    ) == ("<system>Be brief.\n<user>1+1?\n<assistant>")
    conversation = {"prompt": [{"role": "user", "content": "hi"}]}
    assert build_prompt(conversation, tok) == "<user>hi\n<assistant>"
    with pytest.raises(ValueError, match="the tokenizer has none"):
        build_prompt(conversation, char_tokenizer())
    with pytest.raises(ValueError, match=r"refers to \{topic\}, which is not a column"):
        build_prompt(row, prompt_column="question", template="{topic}: {prompt}")


def test_trainer_filters_long_prompts_and_counts_them(tmp_path, tiny_dir):
    from grpokit.config import load_config
    from grpokit.train.trainer import GRPOTrainer

    rows = [{"prompt": "1+1=", "answer": "2"}] * 3 + [{"prompt": "9" * 40 + "+1=", "answer": "x"}] * 2
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_dir}",
            "data.task=null",
            f"data.path={tmp_path / 'train.jsonl'}",
            "data.max_prompt_length=10",
            f"train.output_dir={tmp_path / 'run'}",
            "train.quiet=true",
            "train.max_steps=1",
            "train.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=3",
            "rewards=[{name: math_accuracy, options: {use_math_verify: false}}]",
        ],
    )
    trainer = GRPOTrainer(cfg)
    assert trainer.num_filtered_prompts == 2 and len(trainer.train_source) == 3
    summary = trainer.train()
    assert summary["num_filtered_prompts"] == 2


def test_max_prompt_length_filters_a_built_in_task_like_a_dataset(tmp_path, tiny_dir):
    """Issue 19: the limit applies to the task's training stream and its held-out rows alike, and a
    limit that leaves no prompt is refused, naming the prompt lengths."""
    from grpokit.config import load_config
    from grpokit.errors import ConfigError
    from grpokit.train.trainer import GRPOTrainer

    def trainer(limit):
        sets = [f"model.name_or_path={tiny_dir}", "data.task=addition", f"data.max_prompt_length={limit}"]
        sets += [f"train.output_dir={tmp_path / 'run'}", "train.quiet=true"]
        return GRPOTrainer(load_config(None, sets))

    # addition prompts "a+b=" with up to 2 digits: 4-6 characters (tokens)
    t = trainer(5)
    lengths = [len(t.tokenizer(t.train_source.row(i)["prompt"])["input_ids"]) for i in range(200)]
    assert max(lengths) <= 5 and t.eval_rows and all(len(r["prompt"]) <= 5 for r in t.eval_rows)
    assert t.num_filtered_prompts > 0 and len(t.eval_rows) < 500
    fresh = trainer(5).train_source  # row i is a pure function of the seed and i: resume stays exact
    assert [fresh.row(i) for i in range(30, 0, -1)] == [t.train_source.row(i) for i in range(30, 0, -1)]
    with pytest.raises(ConfigError, match=r"max_prompt_length=3 drops every training prompt: they are 4-6 "
                       r"tokens long \(the longest: '\d\d\+\d\d='\); set it to at least 6"):  # fmt: skip
        trainer(3)
