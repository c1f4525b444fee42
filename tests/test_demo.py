"""`grpokit demo` (shortened) writes a valid summary and report; TensorBoard gets the metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from grpokit.config import load_config
from grpokit.report import write_report
from grpokit.train.trainer import GRPOTrainer


def test_short_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit",
            "demo",
            "--steps",
            "3",
            "--output-dir",
            str(out),
            "--quiet",
            "--set",
            "train.eval_max_prompts=64",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "held-out accuracy" in res.stdout and "report.html" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "sort" and summary["steps"] == 3 and summary["wall_time_s"] > 0
    for key in ("accuracy_before", "accuracy_after"):
        assert 0.0 <= summary[key] <= 1.0
    assert 0.05 <= summary["accuracy_before"] <= 0.45  # the shipped model's starting point
    report = (out / "report.html").read_text()
    assert "data:image/png;base64," in report and "Latest sampled completions" in report
    for key in ("accuracy_before", "accuracy_after"):  # the report shows the run's own numbers
        cell = f"<div class='k'>held-out {key.replace('_', ' ')}</div><div class='v'>{summary[key]:.1%}</div>"
        assert cell in report, cell


def test_demo_options_reach_the_config(tmp_path):
    out = tmp_path / "d"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit",
            "demo",
            "--task",
            "countdown",
            "--steps",
            "1",
            "--seed",
            "5",
            "--output-dir",
            str(out),
            "--quiet",
            "--set",
            "train.eval_max_prompts=8",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    cfg = load_config(out / "config.yaml")
    assert (cfg.data.task, cfg.train.max_steps, cfg.train.seed) == ("countdown", 1, 5)


def test_report_for_a_non_run_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no metrics\.jsonl"):
        write_report(tmp_path)


def test_tensorboard_gets_the_same_keys(tmp_path, tiny_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_dir}",
            f"train.output_dir={tmp_path / 'tb'}",
            "train.quiet=true",
            "train.max_steps=2",
            "train.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "train.eval_max_prompts=4",
            "logging.tensorboard=true",
        ],
    )
    GRPOTrainer(cfg).train()
    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward_mean", "loss", "completion_length_mean", "tokens_per_s"} <= tags
    assert [e.step for e in acc.Scalars("reward_mean")] == [1, 2]
