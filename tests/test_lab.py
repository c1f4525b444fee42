"""`grpokit lab hacking`, shortened: every arm runs, summary.json and report.html are complete."""

from __future__ import annotations

import json
import subprocess
import sys

from grpokit.lab import ARMS, exploited, prefix_correct


def test_the_flawed_checker_and_the_exploit_measure():
    answers = ["123", "123", "123", "123"]
    completions = ["123", "1234", "123!", "12"]
    assert prefix_correct(None, completions, answers) == [1.0, 1.0, 1.0, 0.0]  # the flaw
    assert exploited(None, completions, answers) == [0.0, 1.0, 1.0, 0.0]


def test_short_lab_writes_summary_and_report(tmp_path):
    out = tmp_path / "lab"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit",
            "lab",
            "hacking",
            "--seeds",
            "0",
            "--steps",
            "3",
            "--eval-prompts",
            "8",
            "--output-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == set(ARMS)
    for arm in summary["arms"].values():
        for key in ("exploit_rate", "true_accuracy", "proxy_reward", "mean_kl"):
            assert arm["mean"][key] is not None
    assert len(summary["findings"]) == 5 and all("holds" in f for f in summary["findings"])
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "What held on this run" in html
