"""Build the embedded tiny model shipped in src/grpokit/models/tiny_model/ (reproducible, CPU, ~1 min).

    .venv/bin/python scripts/build_tiny_model.py [--out DIR] [--seed 0]
    .venv/bin/python scripts/build_tiny_model.py --task calculator   # tiny-calculator, from tiny

A 2-layer Llama decoder (d=64, ~100K parameters) with a character tokenizer gets a brief
supervised warm-up on the built-in tasks' prompt formats from a *sloppy teacher*: for 60% of the
examples the target comes from a plausible wrong rule (sorting that drops repeated digits,
addition that forgets carries, a countdown expression over the right numbers with the wrong
value). The model learns the format and both behaviours, so it starts with low but non-zero
accuracy and -- what GRPO needs -- a sampled pass rate above zero: groups then disagree and carry
a learning signal. Warm-up stops at the first check where the sort task's greedy accuracy is in
[0.10, 0.40] and its sampled pass rate is at least 0.08, after at least `--min-steps`.

``--task calculator`` continues the shipped tiny model into ``tiny_calculator_model``: traces of
the calculator task in the pythonic tool-call format (``5*6=<call>calculator('5*6')</call>``, the
result inserted as ``<result>30</result>`` and not trained on, then the product and EOS) from a
sloppy teacher that answers 65% of the problems with a guess of the right length instead of a
call, and mistypes an operand in a third of its calls. It stops at the first check, after
`--min-steps`, where sampled episodes (with the real tool) call it in 15-60% of the cases and
are right in 5-40%: GRPO then has both behaviours to choose between. (Greedy decoding calls the
tool almost always -- the call's ``<`` is likelier than any one first digit of a guess -- and is
right when it copies the operands correctly, about half the time.)
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


CALL_RATE, TYPO_RATE = 0.35, 0.33  # the calculator teacher: share of calls; calls with a wrong operand


def calculator_trace(prompt: str, answer: str, rng: random.Random) -> list[tuple[str, bool]]:
    """The sloppy teacher's episode for ``a*b=``: (text, trained) segments after the prompt."""
    if rng.random() >= CALL_RATE:  # a guess with the right number of digits
        guess = str(rng.randrange(10 ** (len(answer) - 1), 10 ** len(answer)))
        return [(guess, True)]
    a, b = prompt[:-1].split("*")
    if rng.random() < TYPO_RATE:
        pos = rng.randrange(len(a))
        a = a[:pos] + rng.choice("0123456789".replace(a[pos], "")) + a[pos + 1 :]
    result = str(int(a) * int(b))
    return [
        (f"<call>calculator('{a}*{b}')</call>", True),
        (f"<result>{result}</result>", False),
        (result, True),
    ]


def batch_segments(tok, examples: list[list[tuple[str, bool]]]):
    """Right-padded ids of (text, trained) segments + EOS, and the loss mask of the trained ones."""
    seqs, masks = [], []
    for segments in examples:
        ids, mask = [], []
        for text, trained in segments:
            part = tok(text)["input_ids"]
            ids += part
            mask += [trained] * len(part)
        seqs.append([*ids, tok.eos_token_id])
        masks.append([*mask, True])
    width = max(map(len, seqs))
    out = torch.full((len(seqs), width), tok.pad_token_id)
    loss = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        out[i, : len(s)], loss[i, : len(m)] = torch.tensor(s), torch.tensor(m)
    return out, loss


def calculator_rates(model, tok, rows: list[dict], seed: int) -> dict[str, float]:
    from grpokit.envs import make_env_factory
    from grpokit.rollout.episodes import sample_episodes

    make_env = make_env_factory("calculator", tools=[], tool_format="pythonic", tool_timeout_s=10.0)
    out = {}
    for mode, temp in (("greedy", 0.0), ("sampled", 1.0)):
        r = sample_episodes(
            model, tok, rows, make_env, 1, SamplingParams(max_new_tokens=48, temperature=temp),
            torch.Generator().manual_seed(seed), max_turns=3, max_episode_tokens=160,
        )  # fmt: skip
        ok = [
            TASKS["calculator"].verify("", c, row["answer"])
            for c, row in zip(r.completions, rows, strict=True)
        ]
        out[f"{mode}_accuracy"] = sum(ok) / len(ok)
        out[f"{mode}_tool_calls"] = sum(e.num_tool_calls > 0 for e in r.episodes) / len(rows)
    return out


def build_calculator(a) -> None:
    """Continue the shipped tiny model on sloppy calculator traces (see the module docstring)."""
    from grpokit.models.tiny import shipped_model_dir

    base = shipped_model_dir("tiny")
    out = a.out if a.out != OUT else OUT.parent / "tiny_calculator_model"
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    tok = char_tokenizer()
    model = LlamaForCausalLM.from_pretrained(base)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    source = TaskSource("calculator", seed=10_000 + a.seed)
    checks = [TaskSource("calculator", split="eval").row(i) for i in range(a.check_rows)]
    t0, log = time.time(), []
    for step in range(1, a.max_steps + 1):
        rows = [source.row(step * 64 + k) for k in range(64)]
        ids, mask = batch_segments(
            tok, [[(r["prompt"], False), *calculator_trace(r["prompt"], r["answer"], rng)] for r in rows]
        )
        loss = sft_step(model, opt, ids, mask)
        if step % a.check_every == 0:
            model.eval()
            rates = calculator_rates(model, tok, checks, a.seed)
            log.append({"step": step, "loss": round(loss.item(), 4), **rates})
            print(json.dumps(log[-1]), flush=True)
            if (
                step >= a.min_steps
                and 0.15 <= rates["sampled_tool_calls"] <= 0.60
                and 0.05 <= rates["sampled_accuracy"] <= 0.40
            ):
                break
    save(model, tok, out, step, a, t0, log, {"base": "tiny", "call_rate": CALL_RATE, "typo_rate": TYPO_RATE})


def sft_step(model, opt, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One supervised step: cross-entropy on the target tokens (``mask``) given everything before."""
    model.train()
    logits = model(input_ids=ids).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def save(model, tok, out: Path, step: int, a, t0: float, log: list, extra: dict) -> None:
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    card = {
        "parameters": params,
        "warmup_steps": step,
        "seed": a.seed,
        "build_seconds": round(time.time() - t0, 1),
        **extra,
        "checks": log,
    }
    (out / "build_info.json").write_text(json.dumps(card, indent=1))
    print(f"saved {params} parameters after {step} steps to {out}")


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
    ap.add_argument(
        "--task", choices=("all", "calculator"), default="all", help="calculator: build tiny-calculator"
    )
    a = ap.parse_args()
    if a.task == "calculator":
        build_calculator(a)
        return

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
        loss = sft_step(model, opt, ids, mask)
        if step % a.check_every == 0:
            model.eval()
            rates = pass_rates(model, tok, checks, a.seed)
            log.append({"step": step, "loss": round(loss.item(), 4), **rates})
            print(json.dumps(log[-1]), flush=True)
            s = rates["sort"]
            if step >= a.min_steps and 0.10 <= s["greedy"] <= 0.40 and s["sampled"] >= 0.08:
                break
    save(model, tok, a.out, step, a, t0, log, {"sloppy_fraction": a.sloppy})


if __name__ == "__main__":
    main()
