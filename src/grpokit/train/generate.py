"""The generation stage's loop: draw prompts, sample G completions each, score them, and with DAPO's
dynamic sampling keep only informative groups.

What it does: ``collect_groups`` calls ``draw(score_it)`` -- the trainer's closure that takes the
next prompts, samples them and (when ``score_it``) scores them -- once without dynamic sampling, or
up to ``max_batches`` times with it, keeping the groups whose verifier accuracy (without a verifier:
total reward) is not all-equal until ``quota`` groups are kept (DAPO, Yu et al. 2025,
arXiv:2503.14476, sec. 3.2). On the last allowed batch with nothing kept, that batch is kept whole.

Under torchrun each rank fills its own quota and keeps drawing (without scoring, discarding) until
every rank's is full, so the ranks' random streams and batches stay in step.

What it deliberately does not do: sample or score itself (``draw`` does), or compute advantages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpokit.algo import zero_std_groups
from grpokit.rewards.registry import Scores, concat_scores
from grpokit.rollout.sampler import Rollout, concat_rollouts
from grpokit.train.distributed import Dist

# prompts (one per row), rollout, scores (None when not asked), seconds spent drawing and sampling
Drawn = tuple[list[str], Rollout, Scores | None, float]


def collect_groups(
    draw: Callable[[bool], Drawn],
    quota: int,
    group_size: int,
    *,
    dynamic: bool,
    max_batches: int,
    dist: Dist,
    pad_id: int,
) -> tuple[list[str], Rollout, Scores, dict]:
    """``(prompts_B, rollout, scores, info)`` of this rank's groups; ``info`` holds ``batches``
    (how many were drawn) and ``time_sampling_s`` (drawing and sampling, without scoring)."""
    kept: list[Drawn] = []
    num_kept, sampling_s, batches = 0, 0.0, 0
    for batches in range(1, (max_batches if dynamic else 1) + 1):
        prompts_B, rollout, scores, seconds = draw(num_kept < quota)  # full: keeps in step with other ranks
        sampling_s += seconds
        if not dynamic:
            return prompts_B, rollout, scores, {"batches": 1, "time_sampling_s": sampling_s}
        if scores is not None:
            last = batches == max_batches and not kept
            num_kept += keep_informative(kept, prompts_B, rollout, scores, group_size, quota - num_kept, last)
        if dist.max(float(num_kept < quota)) == 0:  # every rank's quota is full
            break
    return (
        [p for k in kept for p in k[0]],
        concat_rollouts([k[1] for k in kept], pad_id),
        concat_scores([k[2] for k in kept]),
        {"batches": batches, "time_sampling_s": sampling_s},
    )


def keep_informative(
    kept: list, prompts_B: list[str], rollout: Rollout, scores: Scores, G: int, room: int, keep_all: bool
) -> int:
    """Append to ``kept`` up to ``room`` groups whose accuracy (without a verifier: total reward) is not
    all-equal; with none and ``keep_all``, the whole batch. Returns how many groups were kept."""
    signal = scores.total if scores.verifier is None else torch.nan_to_num(scores.verifier)
    groups = (~zero_std_groups(signal, G)).nonzero().flatten().tolist()[:room]
    if not groups and keep_all:
        groups = list(range(rollout.num_rows // G))  # nothing informative at all: train on the last batch
    if groups:
        rows_B = [g * G + j for g in groups for j in range(G)]
        kept.append(([prompts_B[r] for r in rows_B], rollout.take_groups(groups), scores.take(rows_B)))
    return len(groups)
