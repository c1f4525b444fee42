"""Peak memory and time of token log-probs: naive log_softmax-gather vs grpokit.algo.

``hidden_token_logprobs+loss_grad`` passes the loss's gradient (here the upstream weights) so the
head's gradients are computed inside the forward blocks, as the trainer does for token-separable
losses.

Each method runs forward + backward in its own child process, and the child reports the growth of
its peak resident set (ru_maxrss) over the peak it had once its inputs existed, so the three
numbers are comparable and measured in one run. CPU only; on a GPU use
torch.cuda.max_memory_allocated instead (same script structure).

    .venv/bin/python benchmarks/bench_logprobs.py [--batch 8 --seq 512 --vocab 32000 --hidden 512 --reps 5]

Each method runs ``--reps`` times (fresh processes, interleaved); the table gives the median and
the min-max spread. Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from _common import spread

METHODS = ("naive", "token_logprobs", "hidden_token_logprobs", "hidden_token_logprobs+loss_grad")


def child(method: str, B: int, T: int, V: int, H: int, dtype_name: str) -> dict:
    import torch

    from grpokit.algo import hidden_token_logprobs, token_logprobs

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    ids = torch.randint(0, V, (B, T))
    hidden = torch.randn(B, T, H, dtype=dtype, requires_grad=True)
    weight = (torch.randn(V, H, dtype=dtype) / H**0.5).requires_grad_(True)
    upstream = torch.randn(B, T)
    if not method.startswith("hidden_token_logprobs"):
        # the model's logits exist in both logits-based methods: count them in the baseline
        with torch.no_grad():
            logits = (hidden @ weight.t()).requires_grad_(True)
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    t0 = time.perf_counter()
    if method == "naive":
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    elif method == "token_logprobs":
        logp = token_logprobs(logits, ids)
    elif method == "hidden_token_logprobs":
        logp = hidden_token_logprobs(hidden, weight, ids)
    else:  # the loss's gradient (here: upstream) taken inside the forward blocks
        flat = upstream.reshape(-1)
        logp = hidden_token_logprobs(hidden, weight, ids, loss_grad=lambda index_c, _: flat[index_c])
    (logp * upstream).sum().backward()
    seconds = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"method": method, "extra_peak_mib": (peak_kib - base_kib) / 1024, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.batch, a.seq, a.vocab, a.hidden, a.dtype)))
        return

    args = [
        "--batch",
        str(a.batch),
        "--seq",
        str(a.seq),
        "--vocab",
        str(a.vocab),
        "--hidden",
        str(a.hidden),
        "--dtype",
        a.dtype,
    ]
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for _ in range(a.reps):
        for method in METHODS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", method, *args],
                check=True,
                capture_output=True,
                text=True,
            )
            runs[method].append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits_mib = a.batch * a.seq * a.vocab * (2 if a.dtype == "bfloat16" else 4) / 2**20
    print(
        f"B={a.batch} T={a.seq} V={a.vocab} H={a.hidden} {a.dtype}, {a.reps} reps; "
        f"the logits tensor alone is {logits_mib:.0f} MiB\n"
    )
    print("| method | extra peak RSS, fwd+bwd (MiB) | vs naive | time fwd+bwd (s) | vs naive |")
    print("|---|---:|---:|---:|---:|")
    med = {
        m: {k: statistics.median(r[k] for r in runs[m]) for k in ("extra_peak_mib", "seconds")}
        for m in METHODS
    }
    for m in METHODS:
        print(
            f"| {m} | {spread([r['extra_peak_mib'] for r in runs[m]], '.0f')} "
            f"| {med[m]['extra_peak_mib'] / med['naive']['extra_peak_mib']:.2f}x "
            f"| {spread([r['seconds'] for r in runs[m]])} "
            f"| {med[m]['seconds'] / med['naive']['seconds']:.2f}x |"
        )


if __name__ == "__main__":
    main()
