"""The code sandbox's cost: per-call overhead vs a plain subprocess, and code_tests throughput.

    .venv/bin/python benchmarks/bench_sandbox.py [--calls 40] [--completions 64]

Side by side in one run: `python3 -I -S -c pass` as a plain subprocess and through
grpokit.rewards.sandbox (prlimit + setpriv + bwrap); then code_tests on completions that each
carry 4 asserts, judged num_parallel at a time. Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from grpokit.rewards import get
from grpokit.rewards.sandbox import Sandbox, default_python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--completions", type=int, default=64)
    a = ap.parse_args()
    py = default_python()
    plain, boxed = [], []
    box = Sandbox(slots=1)
    for _ in range(a.calls):  # interleaved, so load changes hit both alike
        t = time.perf_counter()
        subprocess.run([py, "-I", "-S", "-c", "pass"], check=True)
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert box.run({}, [py, "-I", "-S", "-c", "pass"]).returncode == 0
        boxed.append(time.perf_counter() - t)

    def q(xs):
        xs = sorted(xs)
        return statistics.median(xs) * 1e3, xs[len(xs) // 10] * 1e3, xs[-len(xs) // 10 - 1] * 1e3

    tests = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(10, 5) == 15\nassert add(0, 0) == 0"
    completion = "```python\ndef add(a, b):\n    return a + b\n```"
    rows = []
    for parallel in (1, 2, 4):
        reward = get("code_tests", num_parallel=parallel)
        t = time.perf_counter()
        scores = reward(["p"] * a.completions, [completion] * a.completions, tests=[tests] * a.completions)
        rows.append((parallel, a.completions / (time.perf_counter() - t), sum(scores) / len(scores)))

    print(f"{a.calls} calls each, interleaved; python: {py}\n")
    print("| run | median (ms) | p10 (ms) | p90 (ms) |")
    print("|---|---:|---:|---:|")
    for name, xs in (("plain subprocess", plain), ("sandbox (prlimit+setpriv+bwrap)", boxed)):
        m, lo, hi = q(xs)
        print(f"| {name} | {m:.1f} | {lo:.1f} | {hi:.1f} |")
    print(f"\noverhead: {q(boxed)[0] - q(plain)[0]:.1f} ms per call ({q(boxed)[0] / q(plain)[0]:.2f}x)\n")
    print("| code_tests num_parallel | completions / s (4 asserts each) | mean reward |")
    print("|---:|---:|---:|")
    for parallel, rate, mean in rows:
        print(f"| {parallel} | {rate:.1f} | {mean:.2f} |")


if __name__ == "__main__":
    main()
