"""A GRPO step under torchrun (2 ranks, DDP, gloo on the CPU) with ``train.share_prompts`` on and off.

    .venv/bin/python benchmarks/bench_ddp.py [--steps 8] [--reps 3]

The 3M-parameter Qwen2 of bench_trl.py (character tokenizer) on the addition task, each prompt
behind a fixed 96-character instruction so prompts are ~110 tokens and completions at most 16:
the long-prompt, short-completion shape where computing each prompt once pays. 8 prompts x G = 8
per step, beta 0.04 (a reference model), micro-batches of 16 rows, ``grpokit train`` launched by
``torch.distributed.run --nproc-per-node 2`` (one thread per rank: the machine's 2 cores). The
layouts alternate, ``--reps`` launches each; per launch the median step time (``time_*_s`` summed)
over the steps after the first 2, and the median ``time_training_s`` (the update's passes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import spread
from bench_trl import build

PREAMBLE = "Read the sum below carefully, add the two numbers digit by digit, and give only the result: "


def launch(model_dir: Path, data: Path, out: Path, share: bool, steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    config = out.parent / "rewards.yaml"  # the addition task's verifier on the file's rows
    config.write_text("rewards:\n  - name: task_verifier\n    options: {task: addition}\n")
    cmd += ["-m", "grpokit", "train", "--config", str(config), "--output-dir", str(out)]
    sets = [
        f"model.name_or_path={json.dumps(str(model_dir))}",
        f"data.path={json.dumps(str(data))}",
        "data.task=null",
        "rollout.group_size=8",
        "rollout.max_new_tokens=16",
        "rollout.temperature=1.0",
        "train.prompts_per_step=8",
        "train.micro_batch_size=16",
        f"train.max_steps={steps}",
        "train.save_every=0",
        "train.eval_every=0",
        "train.quiet=true",
        "logging.report=false",
        "algo.beta=0.04",
        f"train.share_prompts={'true' if share else 'false'}",
    ]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-4000:])
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ddp-"))
    model_dir, data, params = build(work, args.steps, vocab=0)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    long = work / "long.jsonl"
    long.write_text("".join(json.dumps({**r, "prompt": PREAMBLE + r["prompt"]}) + "\n" for r in rows))
    results: dict[bool, dict[str, list[float]]] = {
        s: {"step": [], "train": [], "shared": []} for s in (True, False)
    }
    for rep in range(args.reps):
        for share in (True, False) if rep % 2 == 0 else (False, True):
            m = launch(model_dir, long, work / f"run-{rep}-{share}", share, args.steps)[2:]
            step = [r["time_sampling_s"] + r["time_scoring_s"] + r["time_training_s"] for r in m]
            results[share]["step"].append(statistics.median(step))
            results[share]["train"].append(statistics.median(r["time_training_s"] for r in m))
            results[share]["shared"].append(statistics.mean(r["prompt_shared_fraction"] for r in m))
    print(f"{params / 1e6:.2f}M parameters, 2 ranks (DDP, gloo, 1 thread each),", end=" ")
    print(f"{args.steps} steps x {args.reps} launches")
    print()
    print("| train.share_prompts | step s, median of launches (min-max) |", end=" ")
    print("update s (time_training_s) | prompt_shared_fraction |")
    print("|---|---:|---:|---:|")
    for share in (False, True):
        r = results[share]
        shared = statistics.mean(r["shared"])
        print(f"| {share} | {spread(r['step'], '.3f')} | {spread(r['train'], '.3f')} | {shared:.2f} |")
    on, off = (statistics.median(results[s]["train"]) for s in (True, False))
    print(f"\nupdate time with shared prompts: {on / off:.2f}x the padded layout's")


if __name__ == "__main__":
    main()
