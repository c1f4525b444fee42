"""Training pass on completions of very uneven length: length bucketing vs padding in arrival order.

    .venv/bin/python benchmarks/bench_bucketing.py [--reps 5]

One GRPO training pass (forward + backward of every micro-batch, grpokit's
``accumulate_policy_gradient``) over 64 completions whose lengths are very uneven: three quarters
between 8 and 64 tokens, one quarter between 256 and 512, in random order (seeded), 16-token
prompts, a 4-layer Llama with hidden size 256 (3.3M parameters), float32. Plans compared, all with
at most 16 rows per micro-batch:

- ``arrival``: micro-batches of 16 rows in the order the rollout produced them, each padded to its
  longest row (what a trainer without bucketing does);
- ``bucketed``: grpokit's ``plan_micro_batches`` (rows sorted by length, longest first, so each
  micro-batch holds rows of similar length);
- ``bucketed + token cap``: the same with ``micro_batch_tokens = 4096`` padded tokens, so short rows
  travel in bigger micro-batches and long ones in smaller ones;
- ``+ packed``: the same plans padding-free (``train.packing``): each micro-batch's rows laid end to
  end in bins of its longest row, position ids restarting per sequence.

Each plan runs in a fresh child process per repetition (interleaved); reported: padded tokens
computed, the median and min-max of the pass's time, and of its extra peak RSS. The gradients of
all plans are the same (tested in tests/train/test_batch.py); only the cost differs.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time

from _common import SMALL_BODY, spread

PLANS = (
    "arrival",
    "bucketed",
    "bucketed + token cap",
    "arrival + packed",
    "bucketed + packed",
    "bucketed + token cap + packed",
)
B, PROMPT, ROWS = 64, 16, 16


def lengths() -> list[int]:
    rng = random.Random(0)
    out = [rng.randint(8, 64) for _ in range(48)] + [rng.randint(256, 512) for _ in range(16)]
    rng.shuffle(out)
    return out


def make_plan(name: str, lens: list[int]) -> list[list[int]]:
    from grpokit.train.batch import plan_micro_batches

    total = [PROMPT + n for n in lens]
    name = name.removesuffix(" + packed")  # the same plan, each micro-batch collated without padding
    if name == "arrival":
        return [list(range(i, min(i + ROWS, B))) for i in range(0, B, ROWS)]
    if name == "bucketed":
        return plan_micro_batches(total, ROWS)
    return plan_micro_batches(total, ROWS, 4096)


def child(name: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpokit.algo import LossSpec
    from grpokit.train.batch import TrainBatch, accumulate_policy_gradient, collate

    torch.manual_seed(0)
    V = 512
    cfg = LlamaConfig(
        vocab_size=V,
        **SMALL_BODY,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(cfg).eval()
    lens = lengths()
    T = max(lens)
    ids = torch.randint(3, V, (B, T))
    mask = torch.arange(T)[None, :] < torch.tensor(lens)[:, None]
    batch = TrainBatch([torch.randint(3, V, (PROMPT,)) for _ in range(B)], ids, mask, torch.randn(B))
    plan = make_plan(name, lens)
    packed = name.endswith("packed")
    padded = sum(collate(batch, mb, 0, torch.device("cpu"), packed).input_ids.numel() for mb in plan)
    spec = LossSpec(beta=0.0, aggregation="seq_mean_token_mean", max_completion_length=T)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    accumulate_policy_gradient(model, batch, plan, 0, temperature=1.0, loss=spec, packed=packed)
    seconds = time.perf_counter() - t
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return {
        "plan": name,
        "seconds": seconds,
        "extra_peak_mib": extra,
        "padded_tokens": padded,
        "mbs": len(plan),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", choices=PLANS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child)))
        return
    runs: dict[str, list[dict]] = {p: [] for p in PLANS}
    for _ in range(a.reps):
        for p in PLANS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", p], check=True, capture_output=True, text=True
            )
            runs[p].append(json.loads(out.stdout.strip().splitlines()[-1]))
    real = sum(PROMPT + n for n in lengths())
    print(f"64 completions, lengths 8-64 (48) and 256-512 (16); {real} real tokens; {a.reps} reps\n")
    print(
        "| plan | micro-batches | tokens computed | time (s), median (min-max) | vs arrival "
        "| extra peak RSS (MiB) | vs arrival |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = {
        p: {k: statistics.median(r[k] for r in runs[p]) for k in ("seconds", "extra_peak_mib")} for p in PLANS
    }
    for p in PLANS:
        print(
            f"| {p} | {runs[p][0]['mbs']} | {runs[p][0]['padded_tokens']} "
            f"| {spread([r['seconds'] for r in runs[p]])} "
            f"| {med[p]['seconds'] / med['arrival']['seconds']:.2f}x "
            f"| {spread([r['extra_peak_mib'] for r in runs[p]], '.0f')} "
            f"| {med[p]['extra_peak_mib'] / med['arrival']['extra_peak_mib']:.2f}x |"
        )


if __name__ == "__main__":
    main()
