"""Independent float64 references, written from the papers' formulas with Python floats and loops.

Nothing here imports grpokit or vectorises: each function is the formula as printed, so a test
that compares grpokit.algo against it compares two independent derivations.
"""

from __future__ import annotations

import math


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def std_unbiased(xs: list[float]) -> float:
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def advantages(rewards: list[float], G: int, estimator: str, scale: str, eps: float) -> list[float]:
    """DeepSeekMath GRPO / Dr. GRPO / RLOO advantages, group by group."""
    out: list[float] = []
    batch_std = std_unbiased(rewards)
    for g0 in range(0, len(rewards), G):
        group = rewards[g0 : g0 + G]
        if max(group) == min(group):
            out += [0.0] * G
            continue
        for i, r in enumerate(group):
            if estimator == "rloo":
                others = group[:i] + group[i + 1 :]
                a = r - sum(others) / (G - 1)
            else:
                a = r - mean(group)
            if scale == "group":
                a /= std_unbiased(group) + eps
            elif scale == "batch":
                a /= batch_std + eps
            out.append(a)
    return out


def decoupled(rewards_K: list[list[float]], weights: list[float], G: int, eps: float) -> list[float]:
    """GDPO: per-reward GRPO advantages, weighted sum, then batch mean/std normalisation."""
    per = [advantages(r, G, "grpo", "group", eps) for r in rewards_K]
    summed = [sum(w * a[i] for w, a in zip(weights, per, strict=True)) for i in range(len(rewards_K[0]))]
    if all(x == 0 for x in summed):
        return summed
    m, s = mean(summed), std_unbiased(summed)
    return [(x - m) / (s + eps) for x in summed]


def kl(logp: float, ref_logp: float, kind: str) -> float:
    """Schulman's k1/k2/k3 estimators of KL(pi || ref) at one sampled token."""
    log_ratio = ref_logp - logp
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return math.exp(log_ratio) - log_ratio - 1


def kl_shaped_rewards(rewards, logp, ref_logp, mask, beta, kind):
    """r_i - beta * sum over the real tokens of sequence i of the per-token KL estimator."""
    out = []
    for r, lp_row, ref_row, m_row in zip(rewards, logp, ref_logp, mask, strict=True):
        total = sum(kl(a, b, kind) for a, b, m in zip(lp_row, ref_row, m_row, strict=True) if m)
        out.append(r - beta * total)
    return out


def policy_loss(
    logp: list[list[float]],
    old_logp: list[list[float]],
    adv: list[float],
    mask: list[list[int]],
    *,
    ref_logp: list[list[float]] | None,
    beta: float,
    clip_low: float,
    clip_high: float,
    ratio_level: str,
    aggregation: str,
    max_completion_length: int | None,
    kl_kind: str = "k3",
    surrogate: str = "clip",
    delta: float | None = None,
    cispo_max_ratio: float = 5.0,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    pg_mask: list[list[int]] | None = None,
    is_weights: list[list[float]] | None = None,
) -> float:
    """DeepSeekMath eq. 3 (negated), with GSPO's sequence ratio, DAPO / Dr. GRPO aggregations,
    and the CISPO / SAPO / two-sided-clip surrogates, term by term; ``is_weights`` scale each
    token's policy-gradient term (not the KL term)."""
    per_token: list[list[float]] = []  # the loss term of each valid token, sequence by sequence
    for i in range(len(logp)):
        valid = [t for t in range(len(logp[i])) if mask[i][t]]
        if ratio_level == "sequence" and valid:
            s = math.exp(sum(logp[i][t] - old_logp[i][t] for t in valid) / len(valid))
        terms = []
        for t in valid:
            r = s if ratio_level == "sequence" else math.exp(logp[i][t] - old_logp[i][t])
            a = adv[i]
            if surrogate == "clip":
                clipped = min(max(r, 1 - clip_low), 1 + clip_high)
                r_unclipped = min(r, delta) if (delta is not None and a < 0) else r
                term = -min(r_unclipped * a, clipped * a)
            elif surrogate == "cispo":  # the weight is a constant; the value is -w A logp
                term = -min(r, cispo_max_ratio) * a * logp[i][t]
            else:  # sapo
                tau = tau_pos if a > 0 else tau_neg
                term = -(4 / tau) / (1 + math.exp(-tau * (r - 1))) * a
            if is_weights is not None:
                term *= is_weights[i][t]
            if pg_mask is not None and not pg_mask[i][t]:
                term = 0.0
            if beta > 0:
                term += beta * kl(logp[i][t], ref_logp[i][t], kl_kind)
            terms.append(term)
        per_token.append(terms)
    seqs = [terms for terms in per_token if terms]
    if aggregation == "seq_mean_token_mean":
        return sum(sum(ts) / len(ts) for ts in seqs) / len(seqs)
    if aggregation == "token_mean":
        return sum(sum(ts) for ts in seqs) / sum(len(ts) for ts in seqs)
    if aggregation == "seq_mean_token_sum_norm":
        return sum(sum(ts) for ts in seqs) / (len(seqs) * max_completion_length)
    raise ValueError(aggregation)


def log_softmax_at(logits: list[float], token: int, temperature: float = 1.0) -> float:
    z = [x / temperature for x in logits]
    m = max(z)
    return z[token] - (m + math.log(sum(math.exp(x - m) for x in z)))


def mismatch(old_logp, sampler_logp, mask, lo=0.9, hi=1.1) -> tuple[float, int, int]:
    """(sum |old - sampler|, tokens with exp(old - sampler) outside [lo, hi], tokens), valid tokens."""
    total, outside, n = 0.0, 0, 0
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            if mask[i][t]:
                d = old_logp[i][t] - sampler_logp[i][t]
                total += abs(d)
                outside += not (lo <= math.exp(d) <= hi)
                n += 1
    return total, outside, n


def correction_weights(old_logp, sampler_logp, mask, mode: str, cap: float) -> list[list[float]]:
    """TIS: w_t = min(pi_old / pi_sampler, C). Seq-MIS: rho = prod_t pi_old / pi_sampler over the
    sequence's valid tokens; w_t = rho if rho <= C else 0. Padding: 0."""
    out = []
    for i in range(len(mask)):
        valid = [t for t in range(len(mask[i])) if mask[i][t]]
        if mode == "token_truncated":
            w = {t: min(math.exp(old_logp[i][t] - sampler_logp[i][t]), cap) for t in valid}
        else:
            rho = math.exp(sum(old_logp[i][t] - sampler_logp[i][t] for t in valid))
            w = dict.fromkeys(valid, rho if rho <= cap else 0.0)
        out.append([w.get(t, 0.0) for t in range(len(mask[i]))])
    return out
