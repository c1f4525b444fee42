"""Held-out evaluation: greedy pass@1, and sampled pass@k / maj@k, scored by the configured rewards.

What it does: ``evaluate`` decodes each held-out prompt greedily (no random stream is touched, so
evaluating more or less often never changes the training trajectory) and returns the mean reward
and, where a verifier reward exists, accuracy. ``evaluate_sampled`` draws n samples per prompt
from its own seeded generator and reports unbiased pass@k and majority-vote maj@k.

What it deliberately does not do: extract answers for maj@k beyond stripping whitespace (the
built-in tasks' answers are the whole completion); a reward-specific extractor can come later.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from grpokit.errors import ConfigError
from grpokit.rewards.registry import WeightedReward, conversational_prompts, reward_columns, score
from grpokit.rollout.episodes import EpisodeSpec, episode_columns, rollout_rows
from grpokit.rollout.sampler import SamplingParams


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    rows: list[dict],
    prompts: list[str],
    rewards: list[WeightedReward],
    *,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    batch_size: int = 64,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    episodes: EpisodeSpec | None = None,
    decode: str = "auto",
    reorder_weights: bool = True,
    share_prompts: bool = True,
) -> dict:
    """Greedy pass@1 over ``prompts`` (with their dataset ``rows`` as reward columns); with
    ``episodes``, of multi-turn episodes (the examples then also hold each ``transcript``).
    ``decode`` / ``reorder_weights`` / ``share_prompts``: the sampler's, as ``rollout.decode`` /
    ``rollout.reorder_weights`` / ``rollout.share_prompts``.

    ``prompt_column`` / ``answer_column`` name the dataset columns (the answer reaches the rewards
    as ``answer``, as in training).

    Returns ``{"reward_mean", "accuracy" (None without a verifier), "num_prompts", "num_verified"
    (prompts the verifier scored), "examples"}``; ``examples`` holds the first five prompts with
    their completion, reward and ``answer`` column.
    """
    params = SamplingParams(
        max_new_tokens, 0.0, stop=stop, decode=decode, reorder_weights=reorder_weights,
        share_prompts=share_prompts,
    )  # fmt: skip
    totals, verified, examples = [], [], []
    for s in range(0, len(prompts), batch_size):
        chunk_rows, chunk_prompts = rows[s : s + batch_size], prompts[s : s + batch_size]
        rollout = rollout_rows(model, tokenizer, chunk_rows, chunk_prompts, 1, params, episodes=episodes)
        columns = reward_columns(chunk_rows, 1, prompt_column, answer_column) | episode_columns(rollout)
        messages = conversational_prompts(chunk_rows, 1, prompt_column)
        ids = rollout.completion_token_lists()
        scores = score(rewards, chunk_prompts, rollout.completions, columns, ids, messages=messages)
        totals.append(scores.total)
        if scores.verifier is not None:
            verified.append(scores.verifier)
        for i, (row, p, c, r) in enumerate(
            zip(chunk_rows, chunk_prompts, rollout.completions, scores.total.tolist(), strict=True)
        ):
            if len(examples) < 5:
                examples.append({"prompt": p, "completion": c, "reward": r, "answer": row.get(answer_column)})
                if rollout.episodes is not None:
                    examples[-1]["transcript"] = rollout.episodes[i].transcript()
    accuracy = float(torch.cat(verified).nanmean()) if verified else None
    return {
        "reward_mean": float(torch.cat(totals).mean()),
        "accuracy": accuracy,
        "num_prompts": len(prompts),
        "num_verified": int((~torch.cat(verified).isnan()).sum()) if verified else 0,
        "examples": examples,
    }


def combine_evaluations(parts: list[dict]) -> dict:
    """One :func:`evaluate` result from results on disjoint shards of the prompts, in order: means
    weighted by their counts, the first five examples overall."""
    n = sum(p["num_prompts"] for p in parts)
    v = sum(p["num_verified"] for p in parts)
    scored = [p for p in parts if p["accuracy"] is not None]
    return {
        "reward_mean": sum(p["reward_mean"] * p["num_prompts"] for p in parts) / max(n, 1),
        "accuracy": sum(p["accuracy"] * p["num_verified"] for p in scored) / v if v else None,
        "num_prompts": n,
        "num_verified": v,
        "examples": [e for p in parts for e in p["examples"]][:5],
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021, arXiv:2107.03374, eq. 1):
    ``1 - C(n - c, k) / C(n, k)``."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: list[str], correct: list[bool]) -> bool:
    """maj@k for one prompt: is the most frequent answer (first seen wins a tie) a correct one?"""
    counts = Counter(answers)
    best = max(counts.values())
    winner = next(a for a in answers if counts[a] == best)
    return correct[answers.index(winner)]


@torch.no_grad()
def evaluate_sampled(
    model,
    tokenizer,
    rows: list[dict],
    prompts: list[str],
    rewards: list[WeightedReward],
    *,
    n: int,
    ks: list[int],
    temperature: float,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    seed: int = 0,
    batch_prompts: int = 16,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    episodes: EpisodeSpec | None = None,
    decode: str = "auto",
    reorder_weights: bool = True,
    share_prompts: bool = True,
) -> dict:
    """pass@k (unbiased, from n samples per prompt) and maj@k (majority vote over the first k samples,
    answers compared after stripping whitespace), judged by the verifier rewards.
    ``decode`` / ``reorder_weights`` / ``share_prompts``: the sampler's, as ``rollout.decode`` /
    ``rollout.reorder_weights`` / ``rollout.share_prompts``.

    Returns ``{"n", "temperature", "reward_mean", "pass@k": {k: ...}, "maj@k": {k: ...}}``.
    """
    if not any(r.verifier for r in rewards):
        raise ConfigError("pass@k / maj@k need a verifier reward (verifier: true), e.g. task_verifier")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ConfigError(f"every k must be in [1, n={n}], got {bad}")
    params = SamplingParams(
        max_new_tokens, temperature, stop=stop, decode=decode, reorder_weights=reorder_weights,
        share_prompts=share_prompts,
    )  # fmt: skip
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    pass_sums = dict.fromkeys(ks, 0.0)
    maj_sums = dict.fromkeys(ks, 0.0)
    totals = []
    for s in range(0, len(prompts), batch_prompts):
        chunk_rows, chunk_prompts = rows[s : s + batch_prompts], prompts[s : s + batch_prompts]
        rollout = rollout_rows(
            model, tokenizer, chunk_rows, chunk_prompts, n, params, generator, episodes=episodes
        )
        columns = reward_columns(chunk_rows, n, prompt_column, answer_column) | episode_columns(rollout)
        prompts_n = [p for p in chunk_prompts for _ in range(n)]
        messages = conversational_prompts(chunk_rows, n, prompt_column)
        ids = rollout.completion_token_lists()
        scores = score(rewards, prompts_n, rollout.completions, columns, ids, messages=messages)
        totals.append(scores.total)
        ok = (scores.verifier == 1.0).tolist()
        for i in range(len(chunk_prompts)):
            group_ok = ok[i * n : (i + 1) * n]
            answers = [c.strip() for c in rollout.completions[i * n : (i + 1) * n]]
            for k in ks:
                pass_sums[k] += pass_at_k(n, sum(group_ok), k)
                maj_sums[k] += float(majority_correct(answers[:k], group_ok[:k]))
    num = len(prompts)
    return {
        "n": n,
        "temperature": temperature,
        "reward_mean": float(torch.cat(totals).mean()),
        "pass@k": {k: v / num for k, v in pass_sums.items()},
        "maj@k": {k: v / num for k, v in maj_sums.items()},
    }


def evaluate_sharded(
    model, tokenizer, rows: list[dict], render, rewards: list[WeightedReward], cfg, dist, episodes=None
) -> dict:
    """Greedy evaluation of ``rows`` (prompts built by ``render(row)``) with the run's config ``cfg``;
    under torchrun each rank decodes a contiguous share and the results are combined (rank 0's share
    holds the first examples)."""
    W, r, d = dist.world_size, dist.rank, cfg.data
    rows = rows[r * len(rows) // W : (r + 1) * len(rows) // W]
    result = {"reward_mean": 0.0, "accuracy": None, "num_prompts": 0, "num_verified": 0, "examples": []}
    if rows:
        result = evaluate(
            model,
            tokenizer,
            rows,
            [render(row) for row in rows],
            rewards,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop=tuple(cfg.rollout.stop),
            prompt_column=d.prompt_column,
            answer_column=d.answer_column,
            episodes=episodes,
            decode=cfg.rollout.decode,
            reorder_weights=cfg.rollout.reorder_weights,
            share_prompts=cfg.rollout.share_prompts,
        )
    return combine_evaluations(dist.all_gather_objects(result)) if dist.enabled else result
