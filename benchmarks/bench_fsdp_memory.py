"""Peak memory per rank under torchrun: DDP against FSDP, LoRA and full fine-tuning, on 2 CPU ranks.

    .venv/bin/python benchmarks/bench_fsdp_memory.py [--model smollm2-135m-instruct] [--steps 2]

Each configuration is one ``grpokit train`` launch by ``torch.distributed.run --nproc-per-node 2``
(gloo, one thread per rank): the smollm2 recipe (float32 weights, bfloat16 autocast), 2 prompts x G = 4
per step, 24 new tokens, beta 0.04 (a reference: the adapter-off base with LoRA, a sharded copy with
FSDP's full fine-tune), micro-batches of 4 rows, no checkpoints. Every rank reports its own peak
resident set (``VmHWM``) when the run ends; the table gives the largest rank's. Each configuration
runs twice: with glibc's default heap, and with ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4194304``,
which hands every allocation of 4 MiB or more straight back to the system when it is freed, so the
reading follows the live tensors more than the heap glibc keeps.

`--fused` instead compares, under FSDP (full fine-tune, the tuned heap), the loss's log-probs from
hidden states + head (``model.fused_logprobs``, the default) with the logits path, at 4 prompts x
G = 8, 96 new tokens (the recipe's) and micro-batches of 16 rows, where the float32
[16, T, 49152] logits and their gradient are a few hundred MiB each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import peak_rss_kib

TUNED = "glibc.malloc.mmap_threshold=4194304"


def worker(argv: list[str]) -> None:
    """One rank: ``grpokit train ARGV``, then this rank's peak RSS on stdout."""
    from grpokit.cli import main
    from grpokit.train.distributed import exit_process

    code = main(["train", *argv])
    print(f"peak_rss_kib rank={os.environ.get('RANK', '0')} {peak_rss_kib()}", flush=True)
    exit_process(code)


def launch(
    out: Path, model: str, strategy: str, lora: bool, steps: int, tuned: bool, extra: tuple[str, ...] = ()
) -> int:
    """The largest rank's peak RSS in KiB."""
    sets = [
        "train.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24",
        "train.eval_max_prompts=2", f"train.max_steps={steps}", "train.save_every=0",
        "train.micro_batch_size=4", "algo.beta=0.04", f"model.name_or_path={model}",
        "model.lora={r: 8}" if lora else "model.lora=null", f"distributed.strategy={strategy}",
        "train.quiet=true", "logging.report=false", *extra,
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", __file__]
    cmd += ["--worker", "--config", "smollm2", "--output-dir", str(out)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if tuned:
        env["GLIBC_TUNABLES"] = TUNED
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"launch failed ({strategy}, lora={lora}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    peaks = [int(x) for x in re.findall(r"peak_rss_kib rank=\d+ (\d+)", proc.stdout)]
    if len(peaks) != 2:
        sys.exit(f"expected 2 ranks' peaks, got {peaks}:\n{proc.stdout[-2000:]}")
    return max(peaks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--fused", action="store_true")
    a = ap.parse_args()
    if a.fused:
        fused(a.model, a.steps)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for lora in (True, False):
            for tuned in (False, True):
                peaks = {}
                for strategy in ("ddp", "fsdp"):
                    out = Path(tmp) / f"{strategy}-{lora}-{tuned}"
                    peaks[strategy] = launch(out, a.model, strategy, lora, a.steps, tuned) / 1024
                rows.append((lora, tuned, peaks))
                print(json.dumps({"lora": lora, "tuned_heap": tuned, "peak_rss_mib": peaks}), flush=True)
    shape = f"{a.steps} steps of 2 prompts x G = 4, beta 0.04"
    print(f"\n{a.model} (the smollm2 recipe: bfloat16 autocast), 2 CPU ranks (gloo), {shape}\n")
    print("| training | heap | DDP peak RSS (MiB) | FSDP peak RSS (MiB) | FSDP / DDP |")
    print("|---|---|---:|---:|---:|")
    for lora, tuned, p in rows:
        kind = "LoRA r = 8" if lora else "full fine-tune + reference"
        heap = f"`{TUNED}`" if tuned else "glibc default"
        print(f"| {kind} | {heap} | {p['ddp']:.0f} | {p['fsdp']:.0f} | {p['fsdp'] / p['ddp']:.2f}x |")


def fused(model: str, steps: int) -> None:
    bigger = (
        "train.prompts_per_step=4", "rollout.group_size=8", "train.micro_batch_size=16",
        "rollout.max_new_tokens=96",
    )  # fmt: skip
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for on in ("true", "false"):
            extra = (*bigger, f"model.fused_logprobs={on}")
            peaks[on] = launch(Path(tmp) / on, model, "fsdp", False, steps, True, extra) / 1024
            print(json.dumps({"fused_logprobs": on, "peak_rss_mib": peaks[on]}), flush=True)
    shape = f"{steps} steps of 4 prompts x G = 8, 96 new tokens"
    print(f"\n{model}, FSDP on 2 CPU ranks, full fine-tune, {shape}, `{TUNED}`\n")
    print("| loss log-probs | FSDP peak RSS (MiB) |")
    print("|---|---:|")
    print(f"| hidden states + head (`model.fused_logprobs: true`) | {peaks['true']:.0f} |")
    print(f"| full logits (`model.fused_logprobs: false`) | {peaks['false']:.0f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
