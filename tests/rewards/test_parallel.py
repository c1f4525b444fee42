"""Rewards in worker processes: a per-completion timeout, the error policy, and the failure count."""

from __future__ import annotations

import time

import pytest

from grpokit.config import ConfigError, load_config
from grpokit.rewards.registry import ParallelReward, WeightedReward, score


def picky(prompts, completions, **columns):
    """1.0 for 'ok', hangs on 'hang', raises on 'bad'; reads the `answer` column."""
    out = []
    for c, a in zip(completions, columns["answer"], strict=True):
        if c == "hang":
            time.sleep(60)
        if c == "bad":
            raise ValueError("cannot score this")
        out.append(float(c == a))
    return out


NAME = "tests.rewards.test_parallel:picky"


def test_timeouts_and_errors_score_zero_and_are_counted():
    reward = ParallelReward(NAME, {}, workers=2, timeout_s=1.5, error="zero")
    t0 = time.monotonic()
    s = score(
        [WeightedReward("picky", reward)],
        ["p"] * 4,
        ["ok", "hang", "bad", "no"],
        {"answer": ["ok", "x", "x", "x"]},
    )
    assert s.total.tolist() == [1.0, 0.0, 0.0, 0.0] and s.num_failed == 2
    assert time.monotonic() - t0 < 20  # the hanging sample was killed at its timeout


def test_error_raise_stops_with_the_reason():
    reward = ParallelReward(NAME, {}, workers=1, timeout_s=5.0, error="raise")
    with pytest.raises(RuntimeError, match=r"failed on completion 1: ValueError: cannot score this"):
        score([WeightedReward("picky", reward)], ["p"] * 2, ["ok", "bad"], {"answer": ["ok", "ok"]})


def test_config_fields_are_validated():
    cfg = load_config(None, [f'rewards=[{{name: "{NAME}", workers: 2, timeout_s: 3, error: zero}}]'])
    assert cfg.rewards[0].workers == 2 and cfg.rewards[0].error == "zero"
    with pytest.raises(ConfigError, match=r"rewards\[0\].error: 'skip' is not allowed"):
        load_config(None, ["rewards=[{name: task_verifier, error: skip}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].timeout_s: must be > 0"):
        load_config(None, ["rewards=[{name: task_verifier, timeout_s: 0}]"])
