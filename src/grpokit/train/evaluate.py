"""Held-out evaluation: greedy completions (pass@1) scored by the configured rewards.

What it does: decodes each held-out prompt greedily (no random stream is touched, so evaluating
more or less often never changes the training trajectory), scores with the rewards, and returns
the mean reward and, where a verifier reward exists, accuracy.

What it deliberately does not do (yet): pass@k / maj@k with sampling -- issue #6's ``grpokit eval``.
"""

from __future__ import annotations

import torch

from grpokit.rewards.registry import WeightedReward, score
from grpokit.rollout.sampler import SamplingParams, sample


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
) -> dict:
    """Greedy pass@1 over ``prompts`` (with their dataset ``rows`` as reward columns).

    Returns ``{"reward_mean", "accuracy" (None without a verifier), "num_prompts", "examples"}``;
    ``examples`` holds the first five prompts with their completion, reward and ``answer`` column.
    """
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    totals, verified, examples = [], [], []
    for s in range(0, len(prompts), batch_size):
        chunk_rows, chunk_prompts = rows[s : s + batch_size], prompts[s : s + batch_size]
        rollout = sample(model, tokenizer, chunk_prompts, 1, params)
        columns = {k: [r.get(k) for r in chunk_rows] for k in chunk_rows[0]}
        scores = score(rewards, chunk_prompts, rollout.completions, columns)
        totals.append(scores.total)
        if scores.verifier is not None:
            verified.append(scores.verifier)
        for row, p, c, r in zip(
            chunk_rows, chunk_prompts, rollout.completions, scores.total.tolist(), strict=True
        ):
            if len(examples) < 5:
                examples.append({"prompt": p, "completion": c, "reward": r, "answer": row.get("answer")})
    accuracy = float(torch.cat(verified).nanmean()) if verified else None
    return {
        "reward_mean": float(torch.cat(totals).mean()),
        "accuracy": accuracy,
        "num_prompts": len(prompts),
        "examples": examples,
    }
