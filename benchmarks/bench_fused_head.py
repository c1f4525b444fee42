"""One GRPO update on SmolLM2-135M-Instruct: log-probs from full logits vs from hidden states and
the head block by block (``model.fused_logprobs``), peak memory and time, each in a fresh process.

    .venv/bin/python benchmarks/bench_fused_head.py [--rows 64 --completion 96 --prompt 30 --reps 3] \
        [--share] [--layers] [--modes shared+layers,...] [--gradient-checkpointing]

The recipe's shape: 64 rows (8 prompts x 8 samples) of a ``--prompt``-token prompt and ``--completion``
sampled-length tokens (random ids: the cost does not depend on them), bfloat16 autocast with the
float32 head, one forward + backward of the GRPO loss per rep (``accumulate_policy_gradient``,
one micro-batch). Peak RSS is the child's own ``VmHWM``; time is the median over ``--reps``.
``--layers`` adds the same modes with ``model.fused_layers`` (``models.fused_layers.fuse_layers``:
RMSNorm and the MLP saving fewer activations), marked ``+layers``. ``--modes`` picks modes by name
instead (to time one mode at two commits: ``PYTHONPATH=<the commit's src>``);
``--gradient-checkpointing`` recomputes the layers in the backward, as SmolLM2's TRL comparison does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

G = 8
# logits: full logits then token_logprobs; fused: hidden states + head block by block;
# shared: fused with each prompt computed once per group (train.share_prompts); "+layers": with
# fuse_layers (model.fused_layers)
MODES = ("logits", "fused", "shared")
ALL_MODES = MODES + tuple(m + "+layers" for m in MODES)


def child(
    mode: str, rows: int, completion: int, reps: int, prompt: int = 30, checkpointing: bool = False
) -> dict:
    import torch

    from _common import peak_rss_kib
    from grpokit.algo import LossSpec
    from grpokit.models.fused_layers import fuse_layers
    from grpokit.models.loading import (
        keep_head_float32,
        load_model,
        mixed_precision,
        prompt_sharing_costs,
        resolve_model_path,
    )
    from grpokit.train.batch import TrainBatch, accumulate_policy_gradient

    torch.manual_seed(0)
    model, tok = load_model(
        str(resolve_model_path("smollm2-135m-instruct")), gradient_checkpointing=checkpointing
    )
    model.train(checkpointing)  # HF checkpoints only in train mode (dropout is 0 in this model)
    keep_head_float32(model)
    name, mode, layers = mode, mode.removesuffix("+layers"), mode.endswith("+layers")
    if layers and (why := fuse_layers(model)):
        raise SystemExit(f"fuse_layers refused SmolLM2: {why}")
    loaded = peak_rss_kib() / 1024
    V = model.config.vocab_size
    groups = [torch.randint(100, V, (prompt,)) for _ in range(rows // G)]
    prompts = [groups[i // G] for i in range(rows)]  # G samples per prompt
    ids = torch.randint(100, V, (rows, completion))
    mask = torch.ones(rows, completion, dtype=torch.bool)
    batch = TrainBatch(prompts, ids, mask, torch.randn(rows))
    spec = LossSpec(max_completion_length=completion)
    times = []
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        with mixed_precision(torch.device("cpu"), "bfloat16"):
            accumulate_policy_gradient(
                model, batch, [list(range(rows))], tok.pad_token_id or 0, temperature=0.7, loss=spec,
                fused_head=mode != "logits", share=prompt_sharing_costs(model) if mode == "shared" else None,
            )  # fmt: skip
        times.append(time.perf_counter() - t)
    return {
        "mode": name,
        "seconds": statistics.median(times),
        "peak_mib": peak_rss_kib() / 1024,
        "loaded_mib": loaded,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--completion", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=30, help="prompt tokens (each prompt has G = 8 rows)")
    ap.add_argument("--share", action="store_true", help="also time train.share_prompts (mode 'shared')")
    ap.add_argument(
        "--layers", action="store_true", help="also each mode with model.fused_layers ('+layers')"
    )
    ap.add_argument(
        "--modes", help=f"comma-separated modes out of {', '.join(ALL_MODES)} (instead of the flags)"
    )
    ap.add_argument("--gradient-checkpointing", action="store_true", help="recompute the layers in backward")
    ap.add_argument("--child", choices=ALL_MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.rows, a.completion, a.reps, a.prompt, a.gradient_checkpointing)))
        return
    results = []
    modes = list(MODES if a.share else MODES[:2])
    modes += [m + "+layers" for m in modes] if a.layers else []
    if a.modes:
        modes = a.modes.split(",")
        if unknown := [m for m in modes if m not in ALL_MODES]:
            ap.error(f"unknown mode(s) {unknown}; choose from {', '.join(ALL_MODES)}")
    for mode in modes:
        sizes = ["--rows", str(a.rows), "--completion", str(a.completion), "--reps", str(a.reps)]
        sizes += ["--prompt", str(a.prompt)] + (
            ["--gradient-checkpointing"] if a.gradient_checkpointing else []
        )
        cmd = [sys.executable, __file__, "--child", mode, *sizes]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    base = results[0]
    print(f"| log-probs from | fwd+bwd (s), median of {a.reps} | peak RSS (MiB) | above the model (MiB) |")
    print("|---|---:|---:|---:|")
    for r in results:
        above_model = r["peak_mib"] - r["loaded_mib"]
        print(f"| {r['mode']} | {r['seconds']:.2f} | {r['peak_mib']:.0f} | {above_model:.0f} |")
    for f in results[1:]:
        above = (f["peak_mib"] - f["loaded_mib"]) / (base["peak_mib"] - base["loaded_mib"])
        print(
            f"{f['mode']} / {base['mode']}: time {f['seconds'] / base['seconds']:.2f}x, "
            f"memory above the model {above:.2f}x"
        )


if __name__ == "__main__":
    main()
