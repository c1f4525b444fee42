"""The shipped tiny model: a plain Hugging Face model, small, and starting low but not at zero."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.data.tasks import TASKS, TaskSource
from grpokit.models.loading import load_model
from grpokit.models.tiny import char_tokenizer, shipped_model_dir
from grpokit.rollout.sampler import SamplingParams, sample

ROOT = Path(__file__).resolve().parents[2]


def test_loads_with_from_pretrained_and_is_small():
    path = shipped_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 <= n <= 5_000_000, n
    assert sum(f.stat().st_size for f in path.iterdir()) < 1_000_000  # small enough to ship in the wheel
    assert tok("sort:321=")["input_ids"] == char_tokenizer()("sort:321=")["input_ids"]
    assert tok.decode(tok("12+34=")["input_ids"]) == "12+34="


def pass_rate(model, tok, rows, temperature):
    prompts = [r["prompt"] for r in rows]
    r = sample(
        model,
        tok,
        prompts,
        1,
        SamplingParams(max_new_tokens=10, temperature=temperature),
        torch.Generator().manual_seed(0),
    )
    ok = [
        TASKS["sort"].verify(p, c, row["answer"])
        for p, c, row in zip(prompts, r.completions, rows, strict=True)
    ]
    return sum(ok) / len(ok)


def test_starts_low_but_not_at_zero_on_the_demo_task():
    model, tok = load_model("tiny")
    held = TaskSource("sort", split="eval")
    rows = [held.row(i) for i in range(500)]
    greedy, sampled = pass_rate(model, tok, rows, 0.0), pass_rate(model, tok, rows, 1.0)
    # measured when built: greedy 0.174, sampled ~0.18; GRPO needs sampled > 0 so groups disagree
    assert 0.10 <= greedy <= 0.40, greedy
    assert sampled >= 0.08, sampled


@pytest.mark.parametrize("task", ["all", "calculator"])
def test_build_script_is_deterministic(tmp_path, task):
    def build(out):
        cmd = [
            sys.executable,
            str(ROOT / "scripts" / "build_tiny_model.py"),
            "--out",
            str(out),
            "--task",
            task,
        ]
        cmd += ["--min-steps", "10", "--max-steps", "10", "--check-every", "10", "--check-rows", "16"]
        subprocess.run(cmd, check=True, capture_output=True)
        return (out / "model.safetensors").read_bytes()

    assert build(tmp_path / "a") == build(tmp_path / "b")


def test_the_calculator_model_sometimes_calls_the_tool_and_is_rarely_right():
    """The shipped tiny-calculator model, sampled on the build's own check (200 held-out problems,
    seed 0): calls the tool in some episodes but not most, and is right in few, so GRPO's groups
    disagree and there is room to learn (measured when built: 42% call, 6% right)."""
    from grpokit.envs import make_env_factory
    from grpokit.rollout.episodes import sample_episodes

    model, tok = load_model("tiny-calculator")
    rows = [TaskSource("calculator", split="eval").row(i) for i in range(200)]
    make_env = make_env_factory("calculator", tools=[], tool_format="pythonic", tool_timeout_s=10.0)
    r = sample_episodes(
        model, tok, rows, make_env, 1, SamplingParams(max_new_tokens=48, temperature=1.0),
        torch.Generator().manual_seed(0), max_turns=3, max_episode_tokens=160,
    )  # fmt: skip
    calls = sum(e.num_tool_calls > 0 for e in r.episodes) / len(rows)
    right = sum(
        TASKS["calculator"].verify("", c, row["answer"]) for c, row in zip(r.completions, rows, strict=True)
    ) / len(rows)
    assert 0.15 <= calls <= 0.60, calls
    assert 0.02 <= right <= 0.40, right


def test_saved_tokenizer_round_trips_spaces_and_newlines(tiny_dir):
    # transformers 5 swaps the tokenizer of a qwen2-type model for Qwen2Tokenizer, which drops spaces
    for path in (shipped_model_dir(), tiny_dir):
        tok = AutoTokenizer.from_pretrained(path)
        text = "22 from 3 5 7=\n 3*5+7"
        assert tok(text)["input_ids"] == char_tokenizer()(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"]) == text
