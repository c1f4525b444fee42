"""The command line: train end to end, and errors as one line only when the user can fix them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpokit import __version__
from grpokit.cli import main


def test_version():
    out = subprocess.run([sys.executable, "-m", "grpokit", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"grpokit {__version__}"


def test_train_from_the_command_line(tmp_path, tiny_dir):
    out = tmp_path / "run"
    argv = [
        "-m",
        "grpokit",
        "train",
        "--quiet",
        "--output-dir",
        str(out),
        "--set",
        f"model.name_or_path={tiny_dir}",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.prompts_per_step=2",
        "--set",
        "rollout.group_size=2",
        "--set",
        "rollout.max_new_tokens=4",
        "--set",
        "train.eval_max_prompts=4",
    ]
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "done: 2 steps" in res.stdout
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert {"config.yaml", "summary.json", "samples.jsonl"} <= {p.name for p in out.iterdir()}


def test_configuration_errors_exit_2_with_one_clear_line(capsys):
    assert main(["train", "--set", "train.lr=-1"]) == 2
    err = capsys.readouterr().err
    assert "configuration error: train.lr: must be > 0, got -1.0" in err and "Traceback" not in err


def test_user_errors_are_one_line_and_library_bugs_keep_their_traceback(tmp_path, capsys, monkeypatch):
    # bad input the user can fix: one line naming the fix, exit 2
    assert main(["report", str(tmp_path / "nothing-here")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(tmp_path / "nothing-here") in err
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\nnot json\n')
    argv = ["--set", "data.task=null", "--set", f"data.path={data}", "--set", "data.prompt_column=question"]
    assert main(["train", *argv]) == 2
    assert f"{data}:2: not valid JSON" in capsys.readouterr().err
    # a ValueError from inside grpokit (or the user's code) is a bug: it propagates with its traceback

    def broken(*_):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr("grpokit.report.write_report", broken)
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(["report", str(tmp_path)])


def test_public_api_names():
    import grpokit

    assert grpokit.GRPOConfig().train.max_steps == 200
    assert callable(grpokit.GRPOTrainer) and callable(grpokit.load_task) and callable(grpokit.load_config)
    assert "task_verifier" in grpokit.rewards.names()
    with pytest.raises(AttributeError):
        grpokit.nope  # noqa: B018
