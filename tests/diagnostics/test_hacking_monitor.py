"""The hacking monitor on synthetic metric streams: each signal fires, a clean run raises nothing."""

from __future__ import annotations

import json
import random

import pytest

from grpokit.config import MonitorConfig, load_config
from grpokit.diagnostics.hacking import HackingMonitor


def clean_step(i: int, rng: random.Random) -> dict:
    """A healthy run: reward and accuracy rise together, KL small and flat, length steady."""
    acc = min(0.9, 0.2 + 0.01 * i) + rng.uniform(-0.02, 0.02)
    return {
        "step": i,
        "reward_mean": acc,
        "accuracy": acc,
        "kl": 0.02 + rng.uniform(-0.005, 0.005),
        "completion_length_mean": 30 + rng.uniform(-2, 2),
        "zero_std_fraction": 0.3 + rng.uniform(-0.1, 0.1),
    }


def run(stream, completions=None):
    monitor = HackingMonitor(MonitorConfig())
    alerts = []
    for i, m in enumerate(stream):
        alerts += monitor.observe(i + 1, m, completions(i) if completions else None)
    return alerts


def varied_texts(i):
    rng = random.Random(i)
    return [
        " ".join(rng.choice("abcdefghijklmnop") + str(rng.randint(0, 99)) for _ in range(12))
        for _ in range(16)
    ]


def test_a_clean_run_raises_no_alarm():
    rng = random.Random(0)
    assert run([clean_step(i, rng) for i in range(150)], varied_texts) == []


def test_proxy_rising_while_the_verifier_stalls():
    rng = random.Random(1)
    stream = []
    for i in range(80):
        m = clean_step(min(i, 30), rng)  # accuracy stops improving at step 30 ...
        if i > 30:
            m["reward_mean"] = m["accuracy"] + 0.02 * (i - 30)  # ... while the reward keeps climbing
        stream.append(m)
    alerts = run(stream)
    kinds = [a.kind for a in alerts]
    assert kinds == ["proxy_up_verifier_flat"]
    assert alerts[0].step > 30 and alerts[0].evidence["reward_change"] >= 0.1


def test_kl_too_high_and_growing_too_fast():
    rng = random.Random(2)
    stream = [clean_step(i, rng) for i in range(30)]
    for i in range(30, 90):
        m = clean_step(i, rng)
        m["kl"] = 0.02 + 0.03 * (i - 30)
        stream.append(m)
    alerts = run(stream)
    kinds = [a.kind for a in alerts]
    assert kinds.index("kl_growth") < kinds.index("kl_high")  # the rate warns before the level
    high = next(a for a in alerts if a.kind == "kl_high")
    window_means = [sum(m["kl"] for m in stream[i - 19 : i + 1]) / 20 for i in range(19, len(stream))]
    first = 19 + next(i for i, v in enumerate(window_means) if v > 1.0)
    assert high.evidence["kl_window_mean"] > 1.0 and high.step == first + 1  # run() numbers steps from 1


def test_single_kl_spikes_raise_nothing():
    # the demo's pattern (3 seeds, exact verifier, beta 0.04): KL around 0.3 per step with single
    # steps reaching 1.25; only a window's mean above kl_max is a high KL
    rng = random.Random(7)
    stream = []
    for i in range(300):
        m = clean_step(i, rng)
        m["kl"] = 1.3 if i % 37 == 20 else 0.3 + 0.1 * rng.random()
        stream.append(m)
    assert [a.kind for a in run(stream)] == []


def test_length_drift_both_ways():
    for factor in (3.0, 0.3):
        rng = random.Random(3)
        stream = [clean_step(i, rng) for i in range(30)]
        for i in range(30, 80):
            m = clean_step(i, rng)
            m["completion_length_mean"] = 30 * factor
            stream.append(m)
        assert [a.kind for a in run(stream)] == ["length_drift"], factor


def test_no_signal_for_a_whole_window():
    rng = random.Random(4)
    stream = [clean_step(i, rng) for i in range(10)] + [
        dict(clean_step(i, rng), zero_std_fraction=1.0) for i in range(10, 40)
    ]
    alerts = run(stream)
    assert [a.kind for a in alerts] == ["no_signal"] and alerts[0].step == 10 + 20


def test_a_phrase_spreading_through_the_batch():
    def texts(i):
        base = varied_texts(i)
        if i < 20:
            return base
        return [t + " as an expert i can confirm" for t in base[:12]] + base[12:]

    rng = random.Random(5)
    alerts = run([clean_step(i, rng) for i in range(30)], texts)
    assert [a.kind for a in alerts] == ["ngram_spread"] and alerts[0].step == 21
    assert alerts[0].evidence["share"] == 0.75


def test_alerts_are_edge_triggered():
    monitor = HackingMonitor(MonitorConfig(window=2))
    hot, cold = {"kl": 5.0}, {"kl": 0.1}
    assert monitor.observe(1, hot) == []  # a window is not full yet
    assert [a.kind for a in monitor.observe(2, hot)] == ["kl_high"]
    assert monitor.observe(3, hot) == []  # still high: not repeated
    assert monitor.observe(4, cold) == [] and monitor.observe(5, cold) == []  # the window cools
    assert "kl_high" in [a.kind for a in monitor.observe(6, hot)]  # cleared, then back (mean 2.55)


def test_in_a_run_alerts_are_logged_and_stop_on_hacking_stops(tmp_path, tiny_dir):
    from grpokit.train.trainer import GRPOTrainer

    def filler(prompts, completions, **_):  # a reward that pays for a phrase; no verifier at all
        return [float(len(c)) for c in completions]

    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_dir}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.quiet=true",
            "train.max_steps=6",
            "train.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.max_new_tokens=4",
            "train.eval_max_prompts=4",
            "algo.beta=0.1",
            "monitor.kl_max=1e-9",
            "monitor.window=2",
            "monitor.stop_on_hacking=true",
        ],
    )
    summary = GRPOTrainer(cfg, rewards=[filler]).train()
    assert summary["stopped_early"] and "kl_high" in summary["stopped_early"]
    assert summary["steps"] < 6 and summary["alerts"][0]["kind"] == "kl_high"
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["hacking_alerts"] == ["kl_high"]
    assert (tmp_path / "run" / "checkpoints").is_dir()  # saved before stopping
    assert "kl_high" in (tmp_path / "run" / "report.html").read_text()


@pytest.mark.parametrize(
    "override,message",
    [
        ("monitor.window=1", "monitor.window: must be >= 2"),
        ("monitor.length_drift=0.5", "monitor.length_drift: must be > 1"),
        ("monitor.kl_rate=-1", "monitor.kl_rate: must be > 0"),
        ("monitor.proxy_rise=0", "monitor.proxy_rise: must be > 0"),
    ],
)
def test_monitor_options_are_validated(override, message):
    from grpokit.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)
