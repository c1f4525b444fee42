"""The demo's acceptance numbers: `grpokit demo` end to end on 3 seeds, wall time and accuracy gain.

    .venv/bin/python benchmarks/bench_demo.py [--seeds 0 1 2] [--task sort]

Each seed runs the real command (`python -m grpokit demo --quiet`) in a subprocess, timed from
process start to exit (imports, model load, both held-out evaluations, training, report), and
reads its summary.json. Prints a markdown table for docs/benchmarks.md. Runs with an environment
(``--task calculator``) also report, from metrics.jsonl, the sampled training accuracy and the share
of episodes that call a tool, as means over the first and the last 10 steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--task", default="sort")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            out = Path(tmp) / f"seed{seed}"
            cmd = [
                sys.executable,
                "-m",
                "grpokit",
                "demo",
                "--quiet",
                "--task",
                a.task,
                "--seed",
                str(seed),
                "--output-dir",
                str(out),
            ]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            wall = time.perf_counter() - t0
            s = json.loads((out / "summary.json").read_text())
            metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            row = (seed, s["accuracy_before"], s["accuracy_after"], s["steps"], s["wall_time_s"], wall)
            rows.append((row, _first_last(metrics)))
    tools = all(extra for _, extra in rows)
    print(f"task {a.task}\n")
    head = "| seed | accuracy before | accuracy after | gain | steps | train+eval (s) | end to end (s) |"
    rule = "|---:|---:|---:|---:|---:|---:|---:|"
    if tools:
        head += " sampled accuracy, first -> last 10 steps | episodes with a tool call |"
        rule += "---:|---:|"
    print(head)
    print(rule)
    for (seed, before, after, steps, train_s, wall), extra in rows:
        line = (
            f"| {seed} | {before:.1%} | {after:.1%} | {after - before:+.1%} | {steps} "
            f"| {train_s:.1f} | {wall:.1f} |"
        )
        if tools:
            (acc0, acc1), (call0, call1) = extra
            line += f" {acc0:.1%} -> {acc1:.1%} | {call0:.0%} -> {call1:.0%} |"
        print(line)


def _first_last(metrics: list[dict], n: int = 10):
    """((accuracy first, last), (tool_call_fraction first, last)) over n steps; None without tools."""
    if "tool_call_fraction" not in metrics[0]:
        return None

    def mean(key: str, part: list[dict]) -> float:
        return sum(m[key] for m in part) / len(part)

    first, last = metrics[:n], metrics[-n:]
    return (
        (mean("accuracy", first), mean("accuracy", last)),
        (mean("tool_call_fraction", first), mean("tool_call_fraction", last)),
    )


if __name__ == "__main__":
    main()
