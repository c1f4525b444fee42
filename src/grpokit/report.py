"""Run directory -> ``report.html``: plots of the training curves and a table of sampled completions.

What it does: reads ``metrics.jsonl``, ``samples.jsonl``, ``summary.json`` and ``config.yaml`` of a
run directory and writes one self-contained HTML file (PNG plots embedded as base64, no scripts,
no network) with the before/after accuracy, the curves of reward, accuracy, KL, completion
length, clip fraction and entropy over steps, and the most recent sampled completions.

What it deliberately does not do: compute anything new about the run; every number shown is one
the run logged.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import yaml

from grpokit.errors import MissingFileError

PANELS = [
    ("reward_mean", "reward (mean)"),
    ("accuracy", "accuracy (sampled, train batch)"),
    ("kl", "KL to reference"),
    ("completion_length_mean", "completion length (tokens)"),
    ("clip_fraction", "clip fraction"),
    ("entropy", "entropy (nats/token)"),
]


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_report(run_dir: str | Path, max_samples: int = 24) -> Path:
    """Write ``run_dir/report.html`` and return its path."""
    run_dir = Path(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if not metrics:
        raise MissingFileError(
            f"{run_dir} has no metrics.jsonl with any step: is it a grpokit run directory?"
        )
    samples = read_jsonl(run_dir / "samples.jsonl")[-max_samples:]
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    )
    config = (
        yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    )

    page = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>grpokit report: {html.escape(run_dir.name)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>grpokit run <code>{html.escape(str(run_dir))}</code></h1>",
        _headline(summary, metrics, config),
        f"<img class='curves' alt='training curves' src='data:image/png;base64,{_plot(metrics)}'>",
        _warnings(summary),
        _samples_table(samples),
        _config_block(config),
        "</body></html>",
    ]
    out = run_dir / "report.html"
    out.write_text("\n".join(page))
    return out


def _fmt(v, spec: str = ".3f") -> str:
    if v is None:
        return "&ndash;"
    return format(v, spec) if isinstance(v, float) else html.escape(str(v))


def _headline(summary: dict, metrics: list[dict], config: dict) -> str:
    cells = [
        ("steps", _fmt(summary.get("steps", metrics[-1]["step"]))),
        ("wall time", f"{summary['wall_time_s']:.1f} s" if "wall_time_s" in summary else "&ndash;"),
    ]
    if "accuracy_before" in summary:
        cells += [
            ("held-out accuracy before", _fmt(summary.get("accuracy_before"), ".1%")),
            ("held-out accuracy after", _fmt(summary.get("accuracy_after"), ".1%")),
        ]
    task = summary.get("task") or (config.get("data") or {}).get("task")
    model = (config.get("model") or {}).get("name_or_path")
    cells += [("task", _fmt(task)), ("model", _fmt(model)), ("algorithm", _fmt(config.get("algorithm")))]
    body = "".join(
        f"<div class='kpi'><div class='k'>{k}</div><div class='v'>{v}</div></div>" for k, v in cells
    )
    return f"<div class='kpis'>{body}</div>"


def _plot(metrics: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        ys = [m.get(key) for m in metrics]
        pts = [(s, y) for s, y in zip(steps, ys, strict=True) if y is not None]
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)
        if not pts:
            ax.text(
                0.5,
                0.5,
                "not logged in this run",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="grey",
            )
            continue
        xs, vals = zip(*pts, strict=True)
        ax.plot(xs, vals, color="#9ecae1", linewidth=1, label="per step")
        window = max(1, len(vals) // 20)
        if window > 1:
            smooth = [
                sum(vals[max(0, i - window + 1) : i + 1]) / len(vals[max(0, i - window + 1) : i + 1])
                for i in range(len(vals))
            ]
            ax.plot(xs, smooth, color="#08519c", linewidth=2, label=f"mean of {window}")
            ax.legend(fontsize=8, loc="best")
        if key == "accuracy":
            evals = [(m["step"], m["eval_accuracy"]) for m in metrics if m.get("eval_accuracy") is not None]
            if evals:
                ax.plot(*zip(*evals, strict=True), "o-", color="#e6550d", label="held-out (greedy)")
                ax.legend(fontsize=8, loc="best")
        ax.set_xlabel("step")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _warnings(summary: dict) -> str:
    alerts = summary.get("alerts") or []
    if not alerts:
        return ""
    items = "".join(
        f"<li><b>step {a.get('step')}</b> {html.escape(a.get('kind', ''))}: "
        f"{html.escape(a.get('message', ''))}</li>"
        for a in alerts
    )
    return f"<h2>Warnings</h2><ul class='alerts'>{items}</ul>"


def _samples_table(samples: list[dict]) -> str:
    if not samples:
        return "<h2>Samples</h2><p>No samples were logged (train.log_samples = 0).</p>"
    rows = "".join(
        f"<tr><td>{s['step']}</td><td><code>{html.escape(s['prompt'])}</code></td>"
        f"<td><code>{html.escape(s['completion'])}</code></td><td>{s['reward']:.3f}</td>"
        f"<td>{s['advantage']:+.3f}</td></tr>"
        for s in reversed(samples)
    )
    head = "<tr><th>step</th><th>prompt</th><th>completion</th><th>reward</th><th>advantage</th></tr>"
    return f"<h2>Latest sampled completions</h2><table class='samples'>{head}{rows}</table>"


def _config_block(config: dict) -> str:
    if not config:
        return ""
    text = html.escape(yaml.safe_dump(config, sort_keys=False))
    return f"<details><summary>Resolved configuration</summary><pre>{text}</pre></details>"


_CSS = """
body { font-family: -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif; margin: 2rem auto;
       max-width: 1200px; color: #222; padding: 0 1rem; }
h1 { font-size: 1.4rem; } h1 code { font-size: 1.1rem; color: #555; }
h2 { font-size: 1.15rem; margin-top: 2rem; border-bottom: 1px solid #ddd; padding-bottom: .3rem; }
.kpis { display: flex; flex-wrap: wrap; gap: .8rem; margin: 1rem 0 1.5rem; }
.kpi { background: #f4f7fb; border: 1px solid #dde5f0; border-radius: 8px; padding: .6rem 1rem;
       min-width: 9rem; }
.kpi .k { font-size: .75rem; color: #667; text-transform: uppercase; letter-spacing: .03em; }
.kpi .v { font-size: 1.25rem; font-weight: 600; margin-top: .2rem; }
img.curves { width: 100%; border: 1px solid #eee; border-radius: 6px; }
table.samples { border-collapse: collapse; width: 100%; font-size: .9rem; }
table.samples th, table.samples td { border-bottom: 1px solid #eee; padding: .35rem .6rem; text-align: left; }
table.samples th { background: #fafafa; }
table.samples td:nth-child(4), table.samples td:nth-child(5) { font-variant-numeric: tabular-nums; }
ul.alerts li { color: #a33; margin: .3rem 0; }
pre { background: #f8f8f8; padding: 1rem; border-radius: 6px; overflow-x: auto; font-size: .8rem; }
"""
