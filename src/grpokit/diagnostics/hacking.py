"""The live reward-hacking monitor: flags, with the step and the evidence, the signatures of a policy
gaming its reward.

What it does: ``HackingMonitor.observe(step, metrics, completions)`` is fed every step's metrics
(and the step's completions) and returns the alerts that *start* at this step:

- ``proxy_up_verifier_flat``: over the last ``window`` steps the total (proxy) reward rose by at
  least ``proxy_rise`` while the verifier accuracy (rewards marked ``verifier: true``) moved by at
  most ``verifier_stall`` -- reward is being earned some other way than by being right;
- ``kl_high`` / ``kl_growth``: the KL's mean over the window above ``kl_max``, or its least-squares
  slope over the window above ``kl_rate`` per step;
- ``length_drift``: mean completion length over the window more than ``length_drift`` times (or
  less than 1/``length_drift`` of) the first window's;
- ``no_signal``: ``zero_std_fraction`` at least ``zero_std_max`` for ``window`` steps running;
- ``ngram_spread``: one word n-gram appears in more than ``ngram_share`` of the step's completions
  (a filler phrase spreading through the batch).

Alerts are edge-triggered: one alert when a condition starts, another only after it has cleared.

What it deliberately does not do: stop training (the trainer does, only with
``monitor.stop_on_hacking: true``), or decide what the right reward is.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from grpokit.config import MonitorConfig


@dataclass
class Alert:
    step: int
    kind: str
    message: str
    evidence: dict = field(default_factory=dict)


class HackingMonitor:
    """Keeps the recent metric history and reports alerts as they start."""

    def __init__(self, settings: MonitorConfig | None = None) -> None:
        self.s = settings or MonitorConfig()
        self.history: deque[dict] = deque(maxlen=self.s.window)
        self.first_window: list[float] = []
        self.no_signal_run = 0
        self.active: set[str] = set()
        self.alerts: list[Alert] = []

    def observe(self, step: int, metrics: dict, completions: list[str] | None = None) -> list[Alert]:
        self.history.append(metrics)
        length = metrics.get("completion_length_mean")
        if length is not None and len(self.first_window) < self.s.window:
            self.first_window.append(float(length))
        found = {}
        for check in (self._proxy_vs_verifier, self._kl, self._length, self._no_signal):
            for kind, (message, evidence) in check(metrics).items():
                found[kind] = (message, evidence)
        if completions:
            found.update(self._ngrams(completions))
        new = [Alert(step, kind, msg, ev) for kind, (msg, ev) in found.items() if kind not in self.active]
        self.active = set(found)
        self.alerts += new
        return new

    # -- the checks: each returns {kind: (message, evidence)} for conditions that hold now --------

    def _full(self) -> bool:
        return len(self.history) == self.s.window

    def _halves(self, key: str) -> tuple[float, float] | None:
        values = [m.get(key) for m in self.history]
        if not self._full() or any(v is None for v in values):
            return None
        half = len(values) // 2
        return sum(values[:half]) / half, sum(values[half:]) / (len(values) - half)

    def _proxy_vs_verifier(self, m: dict) -> dict:
        proxy, verifier = self._halves("reward_mean"), self._halves("accuracy")
        if proxy is None or verifier is None:
            return {}
        d_proxy, d_verifier = proxy[1] - proxy[0], verifier[1] - verifier[0]
        if d_proxy >= self.s.proxy_rise and d_verifier <= self.s.verifier_stall:
            return {
                "proxy_up_verifier_flat": (
                    f"reward rose {d_proxy:+.3f} over the last {self.s.window} steps while verifier "
                    f"accuracy moved {d_verifier:+.3f}: the reward is being earned without being right",
                    {"reward_change": d_proxy, "accuracy_change": d_verifier},
                )
            }
        return {}

    def _kl(self, m: dict) -> dict:
        out = {}
        values = [h.get("kl") for h in self.history]
        if self._full() and all(v is not None for v in values):
            # the window's mean, not one step's value: a per-step KL estimate from a few hundred
            # tokens is noisy (the demo's single steps reach 3-4x their window's mean)
            mean = sum(values) / len(values)
            if mean > self.s.kl_max:
                out["kl_high"] = (
                    f"KL to the reference averaged {mean:.3f} over the last {self.s.window} steps "
                    f"(> {self.s.kl_max})",
                    {"kl_window_mean": mean, "kl": values[-1]},
                )
            slope = _slope(values)
            if slope > self.s.kl_rate:
                out["kl_growth"] = (
                    f"KL grows {slope:.4f} per step over the last {self.s.window} steps (> {self.s.kl_rate})",
                    {"kl_slope": slope, "kl": values[-1]},
                )
        return out

    def _length(self, m: dict) -> dict:
        values = [h.get("completion_length_mean") for h in self.history]
        if not self._full() or len(self.first_window) < self.s.window or any(v is None for v in values):
            return {}
        start, now = sum(self.first_window) / len(self.first_window), sum(values) / len(values)
        ratio = now / max(start, 1e-9)
        if ratio > self.s.length_drift or ratio < 1 / self.s.length_drift:
            return {
                "length_drift": (
                    f"completion length {now:.1f} tokens vs {start:.1f} at the start ({ratio:.2f}x)",
                    {"length_now": now, "length_start": start},
                )
            }
        return {}

    def _no_signal(self, m: dict) -> dict:
        z = m.get("zero_std_fraction")
        self.no_signal_run = self.no_signal_run + 1 if z is not None and z >= self.s.zero_std_max else 0
        if self.no_signal_run >= self.s.window:
            return {
                "no_signal": (
                    f"{z:.0%} of groups had all-equal rewards for {self.no_signal_run} steps: "
                    "almost no learning signal",
                    {"zero_std_fraction": z, "steps": self.no_signal_run},
                )
            }
        return {}

    def _ngrams(self, completions: list[str]) -> dict:
        n = self.s.ngram
        counts: Counter = Counter()
        eligible = 0
        for text in completions:
            words = text.lower().split()
            if len(words) < n:
                continue
            eligible += 1
            counts.update({tuple(words[i : i + n]) for i in range(len(words) - n + 1)})
        if eligible < 8 or not counts:
            return {}
        gram, count = counts.most_common(1)[0]
        share = count / len(completions)
        if share > self.s.ngram_share:
            phrase = " ".join(gram)
            return {
                "ngram_spread": (
                    f"the phrase {phrase!r} is in {share:.0%} of this step's completions",
                    {"ngram": phrase, "share": share},
                )
            }
        return {}


def _slope(values: list[float]) -> float:
    """Least-squares slope of values against 0..n-1."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den if den else 0.0
