"""One AdamW step over SmolLM2-135M-sized parameters: torch's default loop vs foreach vs fused.

    .venv/bin/python benchmarks/bench_optimizer.py [--reps 7]

Parameters shaped like SmolLM2-135M (30 layers of 4 x 576x576 and 3 x 1536x576 matrices, norms,
a 49152 x 576 embedding: 148M float32 values) with random gradients; the median of ``--reps``
steps after one warm-up step, each kernel in the same process, one after the other.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def smollm2_like_parameters() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    shapes = [(576, 576)] * 4 + [(1536, 576)] * 3 + [(576,)] * 2
    params = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.02) for _ in range(30) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(49152, 576, generator=g) * 0.02))
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    rows = []
    for name, kw in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        params = smollm2_like_parameters()
        opt = torch.optim.AdamW(params, lr=1e-5, **kw)
        opt.step()
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
        rows.append((name, statistics.median(times), min(times), max(times)))
    base, n = rows[0][1], sum(p.numel() for p in smollm2_like_parameters())
    print(f"{n / 1e6:.0f}M parameters, torch {torch.__version__}")
    print("| AdamW kernel | step (s), median (min-max) | speed vs default |\n|---|---:|---:|")
    for name, med, lo, hi in rows:
        print(f"| {name} | {med:.3f} ({lo:.3f}-{hi:.3f}) | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
