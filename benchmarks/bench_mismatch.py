"""Sampler vs trainer log-probs on the real model: SmolLM2-135M-Instruct's recipe (bfloat16 autocast)
for a few GRPO steps, printing each step's ``logprob_mismatch`` and ``logprob_ratio_outside``.

    .venv/bin/python benchmarks/bench_mismatch.py [--steps 3] [--out /tmp/bench-mismatch]

Needs the SmolLM2 model (``make test`` installs it). The sampler decodes token by token with a KV
cache, the trainer recomputes whole sequences; under bfloat16 the two differ, and this measures by
how much on the recipe's own batches (8 prompts x 8 samples, 96 new tokens).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

from grpokit.cli import DEMO_MODELS
from grpokit.config import load_config
from grpokit.train.trainer import GRPOTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="/tmp/bench-mismatch")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    name, _ = DEMO_MODELS["smollm2"]
    cfg = load_config(
        name,
        [
            f"train.max_steps={args.steps}",
            f"train.output_dir={args.out}",
            "train.eval_max_prompts=8",
            "train.quiet=true",
            "train.save_every=0",
            "logging.report=false",
        ],
    )
    t = time.perf_counter()
    GRPOTrainer(cfg).train()
    print(f"{time.perf_counter() - t:.0f} s; autocast {cfg.model.autocast}")
    print("| step | logprob_mismatch | logprob_ratio_outside | update (s) |\n|---:|---:|---:|---:|")
    with open(f"{args.out}/metrics.jsonl") as f:
        for line in f:
            r = json.loads(line)
            print(
                f"| {r['step']} | {r['logprob_mismatch']:.4f} | {r['logprob_ratio_outside']:.2%} | "
                f"{r['time_training_s']:.1f} |"
            )


if __name__ == "__main__":
    main()
