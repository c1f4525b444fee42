"""TRL reward functions and datasets work unchanged: every TRL signature form, called by keyword
with TRL's arguments, through the Python API and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from grpokit.config import load_config
from grpokit.rewards.registry import TrainerProgress, WeightedReward, get, score
from grpokit.train.trainer import GRPOTrainer

# The reward functions a TRL user writes, one per signature form, as a module of their own.
TRL_REWARDS = textwrap.dedent(
    """
    import asyncio

    CALLS = []  # (function, sorted keyword names, trainer_state.global_step)


    def _seen(name, kwargs):
        state = kwargs.get("trainer_state")
        CALLS.append((name, sorted(kwargs), getattr(state, "global_step", None)))


    def completions_only(completions, **kwargs):
        _seen("completions_only", kwargs)
        kwargs["log_metric"]("mean_chars", sum(len(c) for c in completions) / len(completions))
        kwargs["log_extra"]("chars", [len(c) for c in completions])
        return [float(len(c) % 3) for c in completions]


    def prompts_and_completions(prompts, completions, **kwargs):
        _seen("prompts_and_completions", kwargs)
        assert len(prompts) == len(completions) and all(isinstance(p, str) for p in prompts)
        return [float(len(p + c) % 2) for p, c in zip(prompts, completions)]


    def with_solution(completions, solution, **kwargs):
        _seen("with_solution", kwargs)
        return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]


    def sometimes_none(completions, **kwargs):
        _seen("sometimes_none", kwargs)
        return [None if i % 2 else 0.5 for i in range(len(completions))]


    async def async_reward(completions, **kwargs):
        _seen("async_reward", kwargs)
        await asyncio.sleep(0)
        return [float(len(c) % 4) for c in completions]


    def conversational(completions, prompts, **kwargs):
        _seen("conversational", kwargs)
        assert all(p[-1]["role"] == "user" for p in prompts)
        assert all(c[0]["role"] == "assistant" for c in completions)
        return [float(len(c[0]["content"]) % 3) for c in completions]


    def no_kwargs(completions, solution):  # TRL would fail here; grpokit passes what it names
        return [0.0 for _ in completions]
    """
)

TEXT_FORMS = [
    "completions_only",
    "prompts_and_completions",
    "with_solution",
    "sometimes_none",
    "async_reward",
]


@pytest.fixture()
def trl_module(tmp_path, monkeypatch):
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("trl_rewards", None)
    import trl_rewards

    yield trl_rewards
    sys.modules.pop("trl_rewards", None)


def write_rows(path, conversational: bool) -> None:
    rows = []
    for i in range(8):
        prompt = f"{i}+{i}="
        value = [{"role": "user", "content": prompt}] if conversational else prompt
        rows.append({"prompt": value, "solution": str(2 * i), "completion": str(2 * i), "level": i % 3})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture()
def chat_model_dir(tmp_path, tiny_dir):
    """The tiny model with a chat template its character vocabulary can spell."""
    from grpokit.models.loading import load_model

    model, tok = load_model(str(tiny_dir))
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} {% endif %}"
    )
    out = tmp_path / "chat-model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_config(tmp_path, model_dir, data, rewards: list[str], name: str) -> list[str]:
    sets = {
        "model.name_or_path": str(model_dir),
        "data.task": None,
        "data.path": str(data),
        "data.answer_column": "solution",
        "train.max_steps": 1,
        "train.prompts_per_step": 2,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 4,
        "rollout.temperature": 1.2,
        "train.save_every": 0,
        "train.quiet": True,
        "logging.report": False,
        "train.output_dir": str(tmp_path / name),
        "rewards": [{"name": f"trl_rewards:{r}"} for r in rewards],
    }
    return [f"{k}={json.dumps(v)}" for k, v in sets.items()]


@pytest.mark.parametrize("form", TEXT_FORMS)
def test_each_trl_form_trains_a_step_through_the_api(tmp_path, tiny_dir, trl_module, form):
    data = tmp_path / "rows.jsonl"
    write_rows(data, conversational=False)
    cfg = load_config(None, run_config(tmp_path, tiny_dir, data, [form], "run"))
    summary = GRPOTrainer(cfg).train()
    assert summary["steps"] == 1
    (_, keys, step), *_ = [c for c in trl_module.CALLS if c[0] == form]
    # TRL's keyword arguments, and every dataset column but the prompt
    expected = {"completion_ids", "trainer_state", "log_metric", "log_extra", "solution", "completion"}
    named = {"solution"} if form == "with_solution" else set()  # taken as a named parameter instead
    assert (expected | {"level", "answer"}) - named <= set(keys) | {"prompts", "completions"}
    assert step == 1
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert isinstance(metrics[f"reward_{form}_mean"], float)
    if form == "completions_only":  # log_metric -> metrics.jsonl, log_extra -> samples.jsonl
        assert metrics["mean_chars"] == pytest.approx(metrics["completion_length_mean"], abs=4)
        sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
        assert sample["extra"]["chars"] == len(sample["completion"])
    if form == "sometimes_none":  # None = not applicable: half the rows unscored, the mean over the rest
        assert metrics["num_unscored"] == 4 and metrics[f"reward_{form}_mean"] == 0.5


def test_conversational_prompts_get_message_lists(tmp_path, chat_model_dir, trl_module):
    data = tmp_path / "chat.jsonl"
    write_rows(data, conversational=True)
    cfg = load_config(
        None, run_config(tmp_path, chat_model_dir, data, ["conversational", "async_reward"], "c")
    )
    assert GRPOTrainer(cfg).train()["steps"] == 1
    assert {c[0] for c in trl_module.CALLS} >= {"conversational", "async_reward"}


def test_the_cli_runs_trl_rewards_unchanged(tmp_path, tiny_dir, chat_model_dir, trl_module):
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for conversational, model_dir, forms in (
        (False, tiny_dir, TEXT_FORMS),
        (True, chat_model_dir, ["conversational", "async_reward"]),
    ):
        name = "cli-chat" if conversational else "cli-text"
        data = tmp_path / f"{name}.jsonl"
        write_rows(data, conversational)
        argv = [sys.executable, "-m", "grpokit", "train"]
        for item in run_config(tmp_path, model_dir, data, forms, name):
            argv += ["--set", item]
        res = subprocess.run(argv, capture_output=True, text=True, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        metrics = json.loads((tmp_path / name / "metrics.jsonl").read_text())
        assert all(f"reward_{f}_mean" in metrics for f in forms)


def test_async_rewards_of_a_batch_run_concurrently():
    """Each of the two waits for the other's signal: awaited one after the other, both would time out."""
    events: dict[str, asyncio.Event] = {}

    def make(mine: str, theirs: str):
        async def reward(completions, **kwargs):
            for key in (mine, theirs):
                events.setdefault(key, asyncio.Event())
            events[mine].set()
            await asyncio.wait_for(events[theirs].wait(), timeout=5)
            return [1.0] * len(completions)

        return reward

    rewards = [WeightedReward("a", make("a", "b")), WeightedReward("b", make("b", "a"))]
    scores = score(rewards, ["p", "q"], ["x", "y"], {})
    assert scores.total.tolist() == [2.0, 2.0]


def test_keyword_call_details():
    seen = {}

    def no_kwargs(completions, solution):
        seen["args"] = (completions, solution)
        return [1.0] * len(completions)

    def old_style(p, c, **columns):  # grpokit's positional form: still called positionally
        seen["old"] = (p, c, sorted(columns))
        return [0.5] * len(c)

    def raises(completions, **kwargs):
        raise KeyError("boom")

    state = TrainerProgress(global_step=3, epoch=0.5, max_steps=10)
    s = score(
        [WeightedReward("n", no_kwargs), WeightedReward("o", old_style)],
        ["p1", "p2"],
        ["c1", "c2"],
        {"solution": ["a", "b"]},
        [[1], [2]],
        state=state,
    )
    assert s.total.tolist() == [1.5, 1.5]
    assert seen["args"] == (["c1", "c2"], ["a", "b"])
    assert seen["old"][:2] == (["p1", "p2"], ["c1", "c2"])
    assert {"completion_ids", "trainer_state", "log_metric", "log_extra", "solution"} <= set(seen["old"][2])
    with pytest.raises(RuntimeError, match="reward 'r' raised KeyError"):
        score([WeightedReward("r", raises)], ["p"], ["c"], {})
    # built-in rewards keep getting text and the columns, never TRL's callables
    builtin = get("task_verifier", task="addition")
    assert score([WeightedReward("v", builtin)], ["1+1="], ["2"], {"answer": ["2"]}).total.tolist() == [1.0]
    # module:function rewards with options bind them by keyword
    assert torch.isfinite(s.total).all()


def test_a_reward_needing_a_missing_column_fails_before_the_model_loads(tmp_path):
    """The repro of issue 18: question/solution columns, answer_column: nosuchcol, math_accuracy."""
    from grpokit.errors import ConfigError

    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    sets = {
        "model.name_or_path": str(tmp_path / "no-model-here"),  # loading it would fail differently
        "data.task": None,
        "data.path": str(data),
        "data.prompt_column": "question",
        "data.answer_column": "nosuchcol",
        "rewards": [{"name": "math_accuracy"}],
        "train.output_dir": str(tmp_path / "run"),
    }
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in sets.items()])
    with pytest.raises(ConfigError, match=r"reward 'math_accuracy' needs the column 'answer', which the "
                       r"training data does not have; columns present: solution; .*data.answer_column="
                       r"'nosuchcol'.*set data.answer_column"):  # fmt: skip
        GRPOTrainer(cfg)
    # a user reward's own named column is checked the same way; with the column present it passes
    from grpokit.rewards.registry import check_reward_columns, required_columns

    def needs_tests(completions, tests, level=0, **kwargs):
        return [0.0] * len(completions)

    assert required_columns(needs_tests) == {"tests"}
    assert required_columns(lambda p, c, tests: []) == {"tests"}  # older positional form
    with pytest.raises(ConfigError, match=r"needs the column 'tests'.*columns present: solution"):
        check_reward_columns(
            [WeightedReward("t", needs_tests)],
            {"question": "q", "solution": "s"},
            "question",
            "answer",
            "training data",
        )
    check_reward_columns(
        [WeightedReward("t", needs_tests)], {"question": "q", "tests": []}, "question", "answer", "x"
    )
    argv = [sys.executable, "-m", "grpokit", "train"]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    res = subprocess.run(argv, capture_output=True, text=True)
    assert (
        res.returncode == 2 and "configuration error: reward 'math_accuracy' needs the column" in res.stderr
    )
