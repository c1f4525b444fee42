"""The demo's acceptance numbers: `grpokit demo` end to end on 3 seeds, wall time and accuracy gain.

    .venv/bin/python benchmarks/bench_demo.py [--seeds 0 1 2] [--task sort]

Each seed runs the real command (`python -m grpokit demo --quiet`) in a subprocess, timed from
process start to exit (imports, model load, both held-out evaluations, training, report), and
reads its summary.json. Prints a markdown table for docs/benchmarks.md.
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
            rows.append((seed, s["accuracy_before"], s["accuracy_after"], s["steps"], s["wall_time_s"], wall))
    print(f"task {a.task}\n")
    print("| seed | accuracy before | accuracy after | gain | steps | train+eval (s) | end to end (s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for seed, before, after, steps, train_s, wall in rows:
        print(
            f"| {seed} | {before:.1%} | {after:.1%} | {after - before:+.1%} | {steps} "
            f"| {train_s:.1f} | {wall:.1f} |"
        )


if __name__ == "__main__":
    main()
