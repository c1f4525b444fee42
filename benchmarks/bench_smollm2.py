"""SmolLM2-135M-Instruct learns arithmetic word problems with GRPO: held-out accuracy before and
after, per seed, with 95% intervals, and the training wall time.

    .venv/bin/python benchmarks/bench_smollm2.py --seeds 0 1          # trains each seed, then evaluates
    .venv/bin/python benchmarks/bench_smollm2.py --runs runs/a runs/b  # evaluates finished runs only

Each seed is ``grpokit train --config smollm2 --set train.seed=S`` (the recipe of docs/smollm2.md,
what ``grpokit demo --model smollm2`` runs). Evaluation is greedy on the first ``--problems``
held-out word problems (never yielded by the training stream), prompts rendered exactly as the
trainer renders them, under the run's autocast. It scores the base model once and, per run, the
final model and every checkpoint, so the accuracy reached within ``--budget-min`` minutes of
training wall time (the sum of the steps' sampling, scoring and training times in metrics.jsonl)
is reported too. Intervals: Wilson for an accuracy; for a gain, the paired difference over the
same problems, mean +- 1.96 x its standard error.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from grpokit.config import load_config
from grpokit.data.datasets import build_prompt
from grpokit.data.tasks import TaskSource, get_task
from grpokit.models.loading import keep_head_float32, load_model, mixed_precision
from grpokit.rollout.sampler import SamplingParams, sample


def wilson(k: int, n: int) -> tuple[float, float]:
    z, p = 1.96, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    d = [a - b for a, b in zip(after, before, strict=True)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1)
    return mean, 1.96 * math.sqrt(var / len(d))


def correct_per_problem(model_dir: str, cfg, rows: list[dict]) -> list[float]:
    model, tok = load_model(model_dir)
    if cfg.model.autocast is not None:
        keep_head_float32(model)
    d = cfg.data
    prompts = [
        build_prompt(r, tok, chat_template=d.chat_template, system_prompt=d.system_prompt) for r in rows
    ]
    verify = get_task("word_problems").verify
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)
    out: list[float] = []
    with torch.no_grad(), mixed_precision("cpu", cfg.model.autocast):
        for s in range(0, len(rows), 32):
            rollout = sample(model, tok, prompts[s : s + 32], 1, params)
            out += [
                verify(p, c, r["answer"])
                for p, c, r in zip(prompts[s : s + 32], rollout.completions, rows[s : s + 32], strict=True)
            ]
    return out


def training_minutes(run: Path) -> list[tuple[int, float]]:
    """(step, cumulative training wall time in minutes) from metrics.jsonl."""
    total, out = 0.0, []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        total += m["time_sampling_s"] + m["time_scoring_s"] + m["time_training_s"]
        out.append((m["step"], total / 60))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--runs", nargs="*", help="evaluate these finished run directories instead of training")
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--budget-min", type=float, default=30.0)
    ap.add_argument("--out-dir", default="runs/bench-smollm2")
    a = ap.parse_args()

    runs = [Path(r) for r in a.runs] if a.runs else []
    for seed in [] if a.runs else a.seeds:
        run = Path(a.out_dir) / f"seed-{seed}"
        t0 = time.time()
        cmd = [sys.executable, "-m", "grpokit", "train", "--config", "smollm2", "--quiet"]
        subprocess.run([*cmd, "--set", f"train.seed={seed}", "--output-dir", str(run)], check=True)
        print(f"seed {seed}: trained in {time.time() - t0:.0f} s", flush=True)
        runs.append(run)

    cfg = load_config(runs[0] / "config.yaml")
    rows = [TaskSource("word_problems", split="eval").row(i) for i in range(a.problems)]
    base = correct_per_problem(cfg.model.name_or_path, cfg, rows)
    lo, hi = wilson(int(sum(base)), len(base))
    print(
        f"\nbase model: {sum(base) / len(base):.1%} [{lo:.1%}, {hi:.1%}] on {len(base)} held-out problems\n"
    )
    print("| seed | steps | training min | accuracy after [95% CI] | gain, points [95% CI] |")
    print("|---|---:|---:|---:|---:|")
    for run in runs:
        seed = load_config(run / "config.yaml").train.seed
        minutes = dict(training_minutes(run))
        ckpts = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        points = [(int(p.name.split("-")[1]), str(p / "model")) for p in ckpts]
        final_step = max(minutes)
        if not points or points[-1][0] != final_step:
            points.append((final_step, str(run / "final")))
        for step, model_dir in points:
            got = correct_per_problem(model_dir, cfg, rows)
            lo, hi = wilson(int(sum(got)), len(got))
            gain, half = paired_gain(base, got)
            within = " (within budget)" if minutes[step] <= a.budget_min else ""
            print(
                f"| {seed} | {step} | {minutes[step]:.1f}{within} | {sum(got) / len(got):.1%} "
                f"[{lo:.1%}, {hi:.1%}] | {100 * gain:+.1f} [{100 * (gain - half):+.1f}, "
                f"{100 * (gain + half):+.1f}] |",
                flush=True,
            )


if __name__ == "__main__":
    main()
