"""Rollout speed: grpokit's sampler vs Hugging Face `generate` (KV cache), same model, same prompts.

    .venv/bin/python benchmarks/bench_rollout.py [--reps 5]

Both sample G completions for each of 4 prompts at temperature 1 from the shipped tiny model
(HF: `num_return_sequences=G`, `do_sample=True`, `top_k=0`). Completions stop at EOS; each side is
credited with the completion tokens it actually produced (EOS included), so the metric is
completion tokens per second. Median and spread over `--reps` runs, interleaved.

`--profile` instead profiles one grpokit sampler call (G = 16, 64 new tokens) with torch.profiler
and prints where the time goes: the wall time, the time inside ATen operators (the tensor work),
the rest (Python: the HF model's module code, cache and mask bookkeeping, the sampler's loop), and
the top operators and top Python functions (cProfile) by their own time.

`--model smollm2` runs the same side-by-side on SmolLM2-135M-Instruct at G = 8: 4 word problems
rendered with the smollm2 recipe's chat template and system prompt, 96 new tokens at temperature
0.7, both in float32 and under bfloat16 autocast (the recipe's precision, logits in float32 on
grpokit's side; HF `generate` under the same autocast). A third column is grpokit's own path with
each prompt's keys kept once per row, as before the prompts were shared (`decode.SHARE_BYTES`).
`--shots K` puts K worked word problems (question and boxed answer) before each question, for
longer prompts.

`--draw` times one token draw for 64 rows at Qwen2's vocabulary (151,936): the sampler's
two-level inverse-CDF draw (in the buffer a sampler call reuses for all its steps; at temperature 1
and 0.7), the full-width float64 scan it replaced, and `torch.multinomial` (what `generate` uses),
20 repetitions each, interleaved.

`--truncation` runs SmolLM2 at the recipe's shapes under bfloat16 autocast with top-p 0.95, top-k 50
and both: grpokit's sampler, grpokit's sampler with the filters it had before 2026-12-08 (every
row's whole vocabulary sorted for top-p), and HF `generate` with the same filters, `--reps`
interleaved; and the share of grpokit's row draws that ran over a few candidate logits (their
widths) rather than the whole vocabulary.

`--episodes` times multi-turn episodes instead (`rollout.episodes.sample_episodes`): the calculator
task's episodes on the shipped tiny-calculator model (16 problems x G = 8, up to 3 model turns of
40 tokens, 120 tokens per episode, temperature 1, the calculator tool in worker processes), on
grpokit's own decode path and on the HF forward (`rollout.decode: hf`), interleaved; the model's
tokens per second (environment tokens not counted), median (min-max) of `--reps` after one warm-up
(which starts the tool's worker processes). `generate` has no multi-turn counterpart.

`--compile` measures whether `torch.compile` of the own decode path's one-token step would pay:
after one prompt pass, greedy one-token steps run eagerly and through `torch.compile(dynamic=True)`
of the same forward (the cache length grows by one per step, so its shapes are dynamic), `--reps`
runs each interleaved after the compiling run; it prints the compile time, both step times and
whether the greedy tokens are identical. The tiny model (G = 16, 64 steps, float32), or with
`--model smollm2` the recipe's shapes (4 prompts x G = 8, 96 steps) in float32 and bfloat16.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from grpokit.models.loading import keep_head_float32, load_model, mixed_precision
from grpokit.rollout.sampler import SamplingParams, encode_prompts, sample

PROMPTS = ["sort:381927=", "sort:550412=", "sort:918273=", "sort:000111="]


def hf_generate(
    model, tok, G: int, n: int, seed: int, prompts=PROMPTS, temperature: float = 1.0,
    top_k: int = 0, top_p: float = 1.0,
) -> int:  # fmt: skip
    ids, mask = encode_prompts(tok, prompts)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            do_sample=True,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=n,
            num_return_sequences=G,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    new = out[:, ids.shape[1] :]
    produced = 0
    for row in new.tolist():
        produced += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    return produced


def ours(
    model, tok, G: int, n: int, seed: int, prompts=PROMPTS, temperature: float = 1.0, decode: str = "auto",
    top_k: int = 0, top_p: float = 1.0,
) -> int:  # fmt: skip
    params = SamplingParams(n, temperature, top_p=top_p, top_k=top_k, decode=decode)
    r = sample(model, tok, prompts, G, params, torch.Generator().manual_seed(seed))
    return int(r.completion_mask.sum())


def ours_hf_forward(model, tok, G: int, n: int, seed: int, prompts=PROMPTS, temperature: float = 1.0) -> int:
    return ours(model, tok, G, n, seed, prompts, temperature, decode="hf")


def ours_unshared(model, tok, G: int, n: int, seed: int, prompts=PROMPTS, temperature: float = 1.0) -> int:
    """:func:`ours` with every prompt's keys kept once per row (``decode.SHARE_BYTES`` out of reach)."""
    from grpokit.rollout import decode

    shared, decode.SHARE_BYTES = decode.SHARE_BYTES, 2**62
    try:
        return ours(model, tok, G, n, seed, prompts, temperature)
    finally:
        decode.SHARE_BYTES = shared


def smollm2_setup(shots: int = 0):
    """SmolLM2-135M-Instruct, the smollm2 recipe's config, and 4 word problems rendered with its chat
    template and system prompt (``shots`` worked problems before each question)."""
    from grpokit.config import load_config
    from grpokit.data.datasets import build_prompt
    from grpokit.data.tasks import TaskSource

    cfg = load_config("smollm2")
    model, tok = load_model(cfg.model.name_or_path)
    source = TaskSource("word_problems", seed=0)
    examples = [source.row(4 + i) for i in range(shots)]  # worked problems before each question
    solved = "".join(f"{r['prompt']}\nAnswer: \\boxed{{{r['answer']}}}\n\n" for r in examples)
    prompts = [
        build_prompt(
            {**row, "prompt": solved + row["prompt"]}, tok, chat_template=True,
            system_prompt=cfg.data.system_prompt,
        )
        for row in (source.row(i) for i in range(4))
    ]  # fmt: skip
    return cfg, model, tok, prompts


def smollm2(reps: int, compile_step: bool = False, shots: int = 0) -> None:
    cfg, model, tok, prompts = smollm2_setup(shots)
    if compile_step:
        compile_cost(model, tok, prompts, 8, cfg.rollout.max_new_tokens, reps, "float32")
        keep_head_float32(model)
        compile_cost(model, tok, prompts, 8, cfg.rollout.max_new_tokens, reps, "bfloat16")
        return
    G, n, temp = 8, cfg.rollout.max_new_tokens, cfg.rollout.temperature
    lengths = [len(tok(p).input_ids) for p in prompts]
    print(
        f"SmolLM2-135M-Instruct, 4 word problems ({shots} worked examples before each; prompts of "
        f"{min(lengths)}-{max(lengths)} tokens) x G={G}, {n} new tokens, T={temp}, {reps} reps\n"
    )
    print(
        "| precision | grpokit tok/s (median, min-max) | grpokit, prompts not shared tok/s "
        "| HF generate tok/s (median, min-max) | ratio | ratio, not shared |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    sides = (("ours", ours), ("whole", ours_unshared), ("hf", hf_generate))
    for precision in ("float32", "bfloat16"):
        if precision == "bfloat16":
            keep_head_float32(model)
        rates = {name: [] for name, _ in sides}
        for rep in range(reps):
            for name, fn in sides:
                ctx = (
                    mixed_precision("cpu", "bfloat16")
                    if precision == "bfloat16"
                    else contextlib.nullcontext()
                )
                t = time.perf_counter()
                with ctx:
                    produced = fn(model, tok, G, n, rep, prompts, temp)
                rates[name].append(produced / (time.perf_counter() - t))
        med = {name: statistics.median(r) for name, r in rates.items()}
        cells = " | ".join(f"{med[k]:.0f} ({min(r):.0f}-{max(r):.0f})" for k, r in rates.items())
        print(
            f"| {precision} | {cells} | {med['ours'] / med['hf']:.2f}x | {med['whole'] / med['hf']:.2f}x |",
            flush=True,
        )


def profile(model, tok) -> None:
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ours(model, tok, 16, 64, 0)  # warm-up
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        produced = ours(model, tok, 16, 64, 1)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    aten = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::")) / 1e6
    print(f"one sampler call, G=16, 64 new tokens: {produced} tokens in {wall:.3f} s (profiled)")
    print(f"time inside aten operators (self): {aten:.3f} s = {aten / wall:.0%} of the wall time\n")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))
    pr = cProfile.Profile()
    pr.enable()
    ours(model, tok, 16, 64, 2)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(15)


def _sorted_truncated_draw(z_bV: torch.Tensor, top_k: int, top_p: float, u_b: torch.Tensor):
    """The sampler's top-k / top-p before 2026-12-08 (kept here as the baseline): top-k masks the
    logits below the k-th over the whole vocabulary, top-p sorts every row's whole vocabulary,
    then the draw runs over the masked vocabulary."""
    from grpokit.rollout.sampler import inverse_cdf

    if top_k:
        kth_b1 = torch.topk(z_bV, top_k, dim=-1).values[:, -1:]
        z_bV = z_bV.masked_fill(z_bV < kth_b1, float("-inf"))
    if top_p < 1.0:
        sorted_bV, order_bV = torch.sort(z_bV, dim=-1, descending=True)
        p_bV = torch.softmax(sorted_bV, dim=-1)
        drop_bV = (p_bV.cumsum(dim=-1) - p_bV) >= top_p
        z_bV = z_bV.scatter(-1, order_bV, sorted_bV.masked_fill(drop_bV, float("-inf")))
    return inverse_cdf(z_bV, u_b, out=z_bV)


def truncation(reps: int) -> None:
    """SmolLM2 under bfloat16 autocast (the recipe's precision), the recipe's prompts and shapes, with
    top-p / top-k: grpokit's sampler, the same with the filters as before 2026-12-08
    (:func:`_sorted_truncated_draw`), and HF ``generate`` with the same filters, interleaved."""
    from grpokit.rollout import sampler

    cfg, model, tok, prompts = smollm2_setup()
    keep_head_float32(model)
    G, n, temp = 8, cfg.rollout.max_new_tokens, cfg.rollout.temperature
    print(f"SmolLM2-135M-Instruct, bfloat16, 4 word problems x G={G}, {n} new tokens, T={temp}, {reps} reps")
    header = "filters | grpokit tok/s | grpokit, filters as before | HF generate tok/s | vs before | vs HF"
    print(f"\n| {header} |\n|---|---:|---:|---:|---:|---:|")
    current = sampler._truncated_draw

    def before(*args, **kwargs) -> int:
        sampler._truncated_draw = _sorted_truncated_draw
        try:
            return ours(*args, **kwargs)
        finally:
            sampler._truncated_draw = current

    widths: list[int] = []  # the widths each row's draw ran over, in grpokit's first call per setting
    draw = sampler.inverse_cdf

    def recording(z_bV, u_b, out=None):
        widths.extend([z_bV.shape[-1]] * z_bV.shape[0])
        return draw(z_bV, u_b, out=out)

    sides = (("ours", ours), ("before", before), ("hf", hf_generate))
    for top_k, top_p in ((0, 0.95), (50, 1.0), (50, 0.95)):
        rates: dict[str, list[float]] = {name: [] for name, _ in sides}
        widths.clear()
        for rep in range(reps):
            for name, fn in sides:
                sampler.inverse_cdf = recording if (name, rep) == ("ours", 0) else draw
                t = time.perf_counter()
                with mixed_precision("cpu", "bfloat16"):
                    produced = fn(model, tok, G, n, rep, prompts, temp, top_k=top_k, top_p=top_p)
                rates[name].append(produced / (time.perf_counter() - t))
        sampler.inverse_cdf = draw
        med = {name: statistics.median(r) for name, r in rates.items()}
        cells = " | ".join(f"{med[k]:.0f} ({min(r):.0f}-{max(r):.0f})" for k, r in rates.items())
        label = ", ".join([f"top_k={top_k}"] * bool(top_k) + [f"top_p={top_p}"] * (top_p < 1))
        print(f"| {label} | {cells} | {med['ours'] / med['before']:.2f}x | {med['ours'] / med['hf']:.2f}x |")
        shares = {w: widths.count(w) / len(widths) for w in sorted(set(widths))}
        print("  row draws by width: " + ", ".join(f"{w}: {x:.1%}" for w, x in shares.items()), flush=True)


def _full_width_draw(logits: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's draw before the two-level CDF: softmax, a float64 cumsum over the whole
    vocabulary, then log_softmax for the drawn token's log-prob (kept here as the baseline)."""
    cdf = torch.softmax(logits, -1).double().cumsum(-1)
    index = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)
    return index, torch.log_softmax(logits, -1).gather(-1, index.clamp(max=cdf.shape[-1] - 1))


def draw_cost(reps: int = 20) -> None:
    from grpokit.rollout.sampler import _sample_next, draw_scratch

    torch.manual_seed(0)
    logits = torch.randn(64, 151936)
    u = torch.rand(64)
    g = torch.Generator().manual_seed(0)
    scratch = draw_scratch(logits)  # the sampler makes one per call, for all of its steps
    at_one, at_07 = SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=1, temperature=0.7)
    draws = {
        "two-level inverse-CDF (grpokit), T=1": lambda: _sample_next(logits, at_one, u, scratch),
        "two-level inverse-CDF (grpokit), T=0.7": lambda: _sample_next(logits, at_07, u, scratch),
        "full-width inverse-CDF (grpokit before 2026-12-04), T=1": lambda: _full_width_draw(logits, u),
        "torch.multinomial, T=1": lambda: torch.multinomial(torch.softmax(logits, -1), 1, generator=g),
    }
    times: dict[str, list[float]] = {name: [] for name in draws}
    for _ in range(reps):
        for name, draw in draws.items():
            t = time.perf_counter()
            draw()
            times[name].append(1000 * (time.perf_counter() - t))
    print("one token draw, 64 rows x 151,936 logits (ms):")
    for name, ts in times.items():
        print(f"  {name}: {statistics.median(ts):.1f} ({min(ts):.1f}-{max(ts):.1f})")


def compile_cost(model, tok, prompts, G: int, n: int, reps: int, precision: str) -> None:
    from grpokit.rollout.decode import OwnDecoder

    ids, mask = encode_prompts(tok, prompts)
    ctx = mixed_precision("cpu", "bfloat16") if precision == "bfloat16" else contextlib.nullcontext()

    def steps(decoder, forward=None) -> tuple[float, torch.Tensor]:
        logits, state = decoder.prefill(ids, mask, G, ids.shape[1] + n)
        if forward is not None:
            decoder._forward = forward  # the prompt pass stays eager; the steps use ``forward``
        token, tokens = logits.argmax(-1), []
        t = time.perf_counter()
        for _ in range(n):
            token = decoder.step(token, state).argmax(-1)
            tokens.append(token)
        elapsed = time.perf_counter() - t
        vars(decoder).pop("_forward", None)
        return elapsed, torch.stack(tokens, 1)

    with torch.no_grad(), ctx:
        decoder = OwnDecoder(model)
        _, eager_tokens = steps(decoder)
        compiled = torch.compile(decoder._forward, dynamic=True)
        t = time.perf_counter()
        _, compiled_tokens = steps(decoder, compiled)
        compile_s = time.perf_counter() - t
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(reps):
            times["eager"].append(steps(decoder)[0])
            times["compiled"].append(steps(decoder, compiled)[0])
    b = ids.shape[0] * G
    print(f"{precision}, {b} rows x {n} greedy steps; first compiled run (compiling) {compile_s:.1f} s")
    for name, ts in times.items():
        ms = [1000 * x / n for x in ts]
        print(f"  {name}: {statistics.median(ms):.1f} ms/step ({min(ms):.1f}-{max(ms):.1f})")
    same = (eager_tokens == compiled_tokens).float().mean().item()
    identical = torch.equal(eager_tokens, compiled_tokens)
    print(f"  greedy tokens identical: {identical} ({same:.0%} equal)", flush=True)


def episodes(reps: int) -> None:
    from dataclasses import replace

    from grpokit.config import load_config
    from grpokit.data.tasks import TaskSource
    from grpokit.rollout.episodes import episodes_from_config, sample_episodes

    model, tok = load_model("tiny-calculator")
    spec = episodes_from_config(
        load_config(None, ["model.name_or_path=tiny-calculator", "data.task=calculator"]), tok, "calculator"
    )
    rows = [TaskSource("calculator").row(i) for i in range(16)]
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    rates: dict[str, list[float]] = {"auto": [], "hf": []}
    turns, calls = [], []
    for rep in range(reps + 1):
        for decode in rates:
            t = time.perf_counter()
            r = sample_episodes(
                model, tok, rows, spec.make_env, 8, replace(params, decode=decode),
                torch.Generator().manual_seed(rep), max_turns=3, max_episode_tokens=120,
            )  # fmt: skip
            seconds = time.perf_counter() - t
            if rep:  # the first round starts the tool's worker processes
                rates[decode].append(int(r.trained_mask.sum()) / seconds)
                turns.append(sum(e.num_turns for e in r.episodes) / r.num_rows)
                calls.append(sum(e.num_tool_calls for e in r.episodes) / r.num_rows)
    print(f"calculator episodes, 16 problems x G = 8, torch threads {torch.get_num_threads()}")
    print(f"model turns per episode {statistics.mean(turns):.2f}, tool calls {statistics.mean(calls):.2f}\n")
    print("| path | model tokens/s, median (min-max) |\n|---|---:|")
    for decode, r in rates.items():
        name = "own" if decode == "auto" else "HF forward"
        print(f"| {name} | {statistics.median(r):.0f} ({min(r):.0f}-{max(r):.0f}) |")
    print(f"\nown / HF forward: {statistics.median(rates['auto']) / statistics.median(rates['hf']):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draw", action="store_true")
    ap.add_argument("--truncation", action="store_true", help="SmolLM2 with top-p / top-k (see above)")
    ap.add_argument("--episodes", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--shots", type=int, default=0, help="smollm2: worked examples before each problem")
    a = ap.parse_args()
    if a.draw:
        draw_cost()
        return
    if a.truncation:
        truncation(a.reps)
        return
    if a.episodes:
        episodes(a.reps)
        return
    if a.model == "smollm2":
        smollm2(a.reps, a.compile, a.shots)
        return
    model, tok = load_model("tiny")
    if a.profile:
        profile(model, tok)
        return
    if a.compile:
        compile_cost(model, tok, PROMPTS, 16, 64, a.reps, "float32")
        return
    print(f"shipped tiny model, 4 prompts, torch threads {torch.get_num_threads()}\n")
    table(model, tok, [(G, n, PROMPTS, 1.0) for G in (8, 16) for n in (64, 256)], a.reps)


SIDES = (("own", ours), ("hf_forward", ours_hf_forward), ("generate", hf_generate))


def table(model, tok, cases, reps: int, label: str = "") -> None:
    """One row per (G, max new tokens, prompts, temperature): completion tokens per second of
    grpokit's own decode path, of grpokit's sampler on the HF forward, and of HF ``generate``,
    interleaved, median (min-max) of ``reps``; the ratios are against ``generate``."""
    print(
        f"| {label + ' | ' if label else ''}G | max new tokens | grpokit tok/s "
        "| grpokit on the HF forward tok/s | HF generate tok/s "
        "| grpokit / generate | (HF forward) / generate |"
    )
    print("|" + "---:|" * (7 + bool(label)))
    for G, n, prompts, temperature in cases:
        rates: dict[str, list[float]] = {name: [] for name, _ in SIDES}
        for _name, fn in SIDES:  # warm-up
            fn(model, tok, G, n, 0, prompts, temperature)
        for rep in range(reps):
            for name, fn in SIDES:
                t = time.perf_counter()
                produced = fn(model, tok, G, n, rep, prompts, temperature)
                rates[name].append(produced / (time.perf_counter() - t))
        med = {name: statistics.median(r) for name, r in rates.items()}
        cells = [f"{med[k]:.0f} ({min(r):.0f}-{max(r):.0f})" for k, r in rates.items()]
        print(
            f"| {label and label + ' | '}{G} | {n} | {' | '.join(cells)} | "
            f"{med['own'] / med['generate']:.2f}x | {med['hf_forward'] / med['generate']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
