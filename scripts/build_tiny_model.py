"""Build the embedded tiny model shipped in src/grpokit/models/tiny_model/ (reproducible, CPU, ~1 min).

    .venv/bin/python scripts/build_tiny_model.py [--out DIR] [--seed 0]

A 2-layer Llama decoder (d=64, ~100K parameters) with a character tokenizer gets a brief
supervised warm-up on the built-in tasks' prompt formats from a *sloppy teacher*: for 60% of the
examples the target comes from a plausible wrong rule (sorting that drops repeated digits,
addition that forgets carries, a countdown expression over the right numbers with the wrong
value). The model learns the format and both behaviours, so it starts with low but non-zero
accuracy and -- what GRPO needs -- a sampled pass rate above zero: groups then disagree and carry
a learning signal. Warm-up stops at the first check where the sort task's greedy accuracy is in
[0.10, 0.40] and its sampled pass rate is at least 0.08, after at least `--min-steps`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM
from transformers.utils import logging as hf_logging

from grpokit.data.tasks import TASKS, TaskSource
from grpokit.models.tiny import char_tokenizer, tiny_config
from grpokit.rollout.sampler import SamplingParams, sample

OUT = Path(__file__).resolve().parents[1] / "src" / "grpokit" / "models" / "tiny_model"


def sloppy_target(task: str, prompt: str, answer: str, rng: random.Random) -> str:
    """A plausible wrong answer for the sloppy teacher."""
    if task == "sort":
        digits = prompt[len("sort:") : -1]
        return "".join(sorted(set(digits)))  # drops repeated digits
    if task == "addition":
        a, b = prompt[:-1].split("+")
        width = max(len(a), len(b))
        a, b = a.zfill(width), b.zfill(width)
        no_carry = "".join(str((int(x) + int(y)) % 10) for x, y in zip(a, b, strict=True)).lstrip("0")
        return no_carry or "0"
    numbers = prompt.split(" from ")[1][:-1].split()
    rng.shuffle(numbers)
    return "".join(n + rng.choice("+-*") for n in numbers[:-1]) + numbers[-1]


def batch_tensors(tok, pairs: list[tuple[str, str]]):
    """Right-padded prompt+target+EOS ids and a loss mask on the target (and EOS) only."""
    seqs, masks = [], []
    for prompt, target in pairs:
        p, t = tok(prompt)["input_ids"], tok(target)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + t)
        masks.append([0] * len(p) + [1] * len(t))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return ids, mask


def pass_rates(model, tok, rows_by_task: dict[str, list[dict]], seed: int) -> dict[str, dict[str, float]]:
    out = {}
    for task, rows in rows_by_task.items():
        prompts = [r["prompt"] for r in rows]
        rates = {}
        for mode, temp in (("greedy", 0.0), ("sampled", 1.0)):
            r = sample(
                model,
                tok,
                prompts,
                1,
                SamplingParams(max_new_tokens=16, temperature=temp),
                torch.Generator().manual_seed(seed),
            )
            ok = [
                TASKS[task].verify(p, c, row["answer"])
                for p, c, row in zip(prompts, r.completions, rows, strict=True)
            ]
            rates[mode] = sum(ok) / len(ok)
        out[task] = rates
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sloppy", type=float, default=0.6, help="fraction of targets from the wrong rule")
    ap.add_argument("--min-steps", type=int, default=300)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("--check-rows", type=int, default=200, help="held-out problems per task at each check")
    a = ap.parse_args()

    hf_logging.disable_progress_bar()
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    tok = char_tokenizer()
    model = LlamaForCausalLM(tiny_config(len(tok), hidden_size=64, num_layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sources = {t: TaskSource(t, seed=10_000 + a.seed) for t in TASKS}
    checks = {t: [TaskSource(t, split="eval").row(i) for i in range(a.check_rows)] for t in TASKS}
    t0, log = time.time(), []
    for step in range(1, a.max_steps + 1):
        pairs = []
        for k in range(96):
            task = ("sort", "sort", "addition", "countdown")[k % 4]  # sort, the demo's task, twice as often
            row = sources[task].row(step * 96 + k)
            target = (
                sloppy_target(task, row["prompt"], row["answer"], rng)
                if rng.random() < a.sloppy
                else row["answer"]
            )
            pairs.append((row["prompt"], target))
        ids, mask = batch_tensors(tok, pairs)
        model.train()
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % a.check_every == 0:
            model.eval()
            rates = pass_rates(model, tok, checks, a.seed)
            log.append({"step": step, "loss": round(loss.item(), 4), **rates})
            print(json.dumps(log[-1]), flush=True)
            s = rates["sort"]
            if step >= a.min_steps and 0.10 <= s["greedy"] <= 0.40 and s["sampled"] >= 0.08:
                break
    model.eval()
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    params = sum(p.numel() for p in model.parameters())
    card = {
        "parameters": params,
        "warmup_steps": step,
        "seed": a.seed,
        "sloppy_fraction": a.sloppy,
        "build_seconds": round(time.time() - t0, 1),
        "checks": log,
    }
    (a.out / "build_info.json").write_text(json.dumps(card, indent=1))
    print(f"saved {params} parameters after {step} steps to {a.out}")


if __name__ == "__main__":
    main()
