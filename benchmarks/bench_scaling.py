"""How a GRPO step's time grows with the group size G and the completion length, and where it goes.

    .venv/bin/python benchmarks/bench_scaling.py [--steps 6]

A 4-layer Llama with hidden size 256 (3.3M parameters, random weights, float32, CPU) whose EOS
logit is forced to -inf (a forward hook on ``lm_head``), so every completion runs to exactly
``max_new_tokens``: the length is the variable, not the model's whim. 4 prompts per step, a rule
reward (share of digits in the completion), beta = 0.04 (a reference model), micro-batches of 16
rows. Sweeps: G = 4, 8, 16, 32 at 64 new tokens; 64, 128, 256, 512 new tokens at G = 8. Each
configuration runs ``--steps`` steps; the first is dropped (warm-up) and the table gives the median
and min-max of the rest, with the step split into sampling / scoring / training (grpokit's own
``time_*_s`` metrics), and the growth against the first row of its sweep.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from _common import SMALL_BODY, spread


def digit_share(prompts, completions, **_):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def model_and_tokenizer():
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpokit.models.tiny import char_tokenizer

    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        **SMALL_BODY,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    eos = tok.eos_token_id

    def no_eos(module, inputs, logits):
        return logits.index_fill(-1, torch.tensor([eos], device=logits.device), float("-inf"))

    model.lm_head.register_forward_hook(no_eos)
    return model, tok


def run(G: int, new_tokens: int, steps: int, out: Path) -> list[dict]:
    from grpokit.config import load_config
    from grpokit.train.trainer import GRPOTrainer

    model, tok = model_and_tokenizer()
    cfg = load_config(
        None,
        [
            "data.task=addition",
            f"rollout.group_size={G}",
            f"rollout.max_new_tokens={new_tokens}",
            "train.prompts_per_step=4",
            "train.micro_batch_size=16",
            f"train.max_steps={steps}",
            "algo.beta=0.04",
            "train.lr=1e-4",
            "train.eval_max_prompts=1",
            "train.save_every=0",
            "train.quiet=true",
            "logging.report=false",
            "monitor.enabled=false",
            f"train.output_dir={json.dumps(str(out))}",
        ],
    )
    GRPOTrainer(cfg, model=model, tokenizer=tok, rewards=[digit_share]).train()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["completion_length_mean"] == new_tokens for r in rows), "completions ended early"
    return rows[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    sweeps = {
        "G (64 new tokens)": [(G, 64) for G in (4, 8, 16, 32)],
        "new tokens (G = 8)": [(8, n) for n in (64, 128, 256, 512)],
    }
    print(f"torch threads {torch.get_num_threads()}, {a.steps - 1} measured steps per row\n")
    print(
        "| sweep | G | new tokens | completion tokens / step | step s, median (min-max) | growth "
        "| sampling s | scoring s | training s | sampling share |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, (sweep, configs) in enumerate(sweeps.items()):
        first = None
        for G, n in configs:
            rows = run(G, n, a.steps, work / f"sweep{k}-G{G}-n{n}")
            split = {
                k: [r[k] for r in rows] for k in ("time_sampling_s", "time_scoring_s", "time_training_s")
            }
            step = [sum(v) for v in zip(*split.values(), strict=True)]
            sam, sco, tra = (statistics.median(v) for v in split.values())
            s = statistics.median(step)
            first = first or (s, G * n)
            growth = f"{s / first[0]:.2f}x time for {G * n / first[1]:.0f}x tokens"
            print(
                f"| {sweep} | {G} | {n} | {4 * G * n} | {spread(step, '.3f')} | {growth} "
                f"| {sam:.3f} | {sco:.4f} | {tra:.3f} | {sam / s:.0%} |"
            )


if __name__ == "__main__":
    main()
