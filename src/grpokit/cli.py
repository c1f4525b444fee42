"""The ``grpokit`` command line: ``grpokit train | demo | eval | report | export | lab``.

Each subcommand is a thin wrapper over the Python API; this file parses arguments and reports
errors: a grpokit ``UserError`` (bad options, data, files) as one line with exit code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NoReturn

import grpokit
from grpokit.config import BUILTIN_CONFIGS, load_config
from grpokit.errors import ConfigError, MissingFileError, RunExistsError, TrainingInterrupted, UserError

# grpokit demo --model NAME: (built-in config, what the banner calls the model)
DEMO_MODELS = {
    "tiny": ("demo", "the embedded tiny model"),
    "smollm2": ("smollm2", "SmolLM2-135M-Instruct"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpokit", description="Post-train language models with GRPO.")
    parser.add_argument("--version", action="version", version=f"grpokit {grpokit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train a model with GRPO from a YAML config")
    train.add_argument(
        "--config", help="YAML config file or a built-in config name (demo); omitted: all defaults"
    )
    train.add_argument(
        "--resume",
        metavar="DIR|auto",
        help="continue a run: a run directory or checkpoint (its config.yaml is used unless --config is "
        "given), or 'auto': the newest good checkpoint in the output dir, else a fresh start",
    )
    _add_run_options(train)

    demo = sub.add_parser("demo", help="train a small model on a built-in task and show it improve")
    demo.add_argument(
        "--model",
        choices=tuple(DEMO_MODELS),
        default="tiny",
        help="tiny: the embedded 104K-parameter model on sort (about 30 s); smollm2: SmolLM2-135M-Instruct "
        "on arithmetic word problems (about 35 min on 2 cores; needs grpokit[smollm2])",
    )
    demo.add_argument(
        "--task",
        help="built-in task (default: the model's demo task; see grpokit.data.tasks); calculator: the tiny "
        "model learns to call a calculator tool (configs/demo-calculator.yaml, about 2 min)",
    )
    demo.add_argument(
        "--steps",
        type=int,
        help="GRPO steps (default: the demo config's: 300 tiny, 200 calculator, 45 smollm2)",
    )
    demo.add_argument("--seed", type=int, help="seed of the run (default: 0)")
    _add_run_options(demo)

    ev = sub.add_parser("eval", help="evaluate a model: greedy pass@1, sampled pass@k and maj@k, to JSON")
    ev.add_argument(
        "--model", required=True, help="model directory, a run directory (its final/ model), or 'tiny'"
    )
    src = ev.add_mutually_exclusive_group(required=True)
    src.add_argument("--task", help="a built-in task: its held-out set")
    src.add_argument("--dataset", help="a JSONL file of rows")
    ev.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="NAME",
        help="reward (repeatable; default with --task: task_verifier); 'module:function' works",
    )
    ev.add_argument("--difficulty", type=int, help="task difficulty (default: the task's)")
    ev.add_argument("--limit", type=int, default=500, help="evaluate at most this many prompts (default 500)")
    ev.add_argument(
        "--n", type=int, default=8, help="samples per prompt for pass@k / maj@k (default 8; 0: greedy only)"
    )
    ev.add_argument("--k", type=int, nargs="+", default=[1, 4, 8], help="k values (default 1 4 8), each <= n")
    ev.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature for pass@k (default 1.0)"
    )
    ev.add_argument("--max-new-tokens", type=int, default=32, help="longest completion (default 32)")
    ev.add_argument("--prompt-column", default="prompt")
    ev.add_argument("--answer-column", default="answer")
    ev.add_argument("--template", help="format string for the prompt, as data.template")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument(
        "--decode",
        choices=("auto", "hf"),
        default="auto",
        help="the sampler's forward, as rollout.decode (default auto: grpokit's own where it can)",
    )
    ev.add_argument(
        "--no-reorder-weights",
        dest="reorder_weights",
        action="store_false",
        help="no oneDNN weight copies on the own decode path, for memory (rollout.reorder_weights: false)",
    )
    ev.add_argument(
        "--no-share-prompts",
        dest="share_prompts",
        action="store_false",
        help="G copies of each prompt's keys on the own decode path (rollout.share_prompts: false)",
    )
    ev.add_argument("--out", help="also write the JSON result to this file")

    export = sub.add_parser("export", help="write a plain Hugging Face model directory from a run")
    export.add_argument("run_dir", help="a grpokit run directory")
    export.add_argument("--out", required=True, help="output directory (must not exist)")
    export.add_argument(
        "--checkpoint",
        help="step-N to export instead of the final model (default: final/, else the newest good checkpoint)",
    )

    report = sub.add_parser("report", help="write report.html for a run directory")
    report.add_argument("run_dir", help="a grpokit run directory")

    lab = sub.add_parser("lab", help="built-in experiments: `grpokit lab hacking`")
    lab.add_argument("experiment", choices=["hacking"], help="hacking: GRPO on a deliberately flawed reward")
    lab.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    lab.add_argument("--steps", type=int, default=150, help="GRPO steps per run (default 150)")
    lab.add_argument("--eval-prompts", type=int, default=200, help="held-out problems per evaluation")
    lab.add_argument("--output-dir", default="runs/lab-hacking", help="where summary.json and report.html go")
    lab.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a training option of every run",
    )

    return parser


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one option, e.g. --set train.max_steps=6 (repeatable)",
    )
    p.add_argument("--output-dir", help="run directory (same as --set train.output_dir=DIR)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (same as --set train.quiet=true)")


def _overrides(args: argparse.Namespace) -> list[str]:
    out = list(args.overrides)
    if args.output_dir:
        out.append(f"train.output_dir={json.dumps(args.output_dir)}")
    if args.quiet:
        out.append("train.quiet=true")
    return out


def cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from grpokit.train.distributed import shutdown
    from grpokit.train.trainer import GRPOTrainer

    config, overrides = args.config, _overrides(args)
    if args.resume and args.resume != "auto" and config is None:
        where = Path(args.resume)
        run_dir = where.parent.parent if where.name.startswith("step-") else where
        if not (run_dir / "config.yaml").is_file():
            raise MissingFileError(
                f"--resume {args.resume}: no config.yaml in {run_dir}; is it a grpokit run?"
            )
        config = run_dir / "config.yaml"
        overrides = [f"train.output_dir={json.dumps(str(run_dir))}", *overrides]
    cfg = load_config(config, overrides)
    trainer = GRPOTrainer(cfg)
    summary = trainer.train(resume=args.resume)
    shutdown(trainer.dist)
    if trainer.dist.is_main:
        print(f"done: {summary['steps']} steps in {summary['wall_time_s']:.1f} s -> {cfg.train.output_dir}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from grpokit.train.distributed import init_distributed, shutdown
    from grpokit.train.trainer import GRPOTrainer

    overrides = [f"data.task={args.task}"] if args.task else []
    overrides += [f"train.max_steps={args.steps}"] if args.steps is not None else []
    overrides += [f"train.seed={args.seed}"] if args.seed is not None else []
    d = init_distributed()  # under torchrun: every rank must agree on the run directory's name
    if not args.output_dir:
        stamp = d.broadcast(time.strftime("%Y%m%d-%H%M%S"))
        overrides.append(f"train.output_dir=runs/demo-{args.model}-{stamp}")
    config_name, model_name = DEMO_MODELS[args.model]
    if args.task and args.model == "tiny" and (BUILTIN_CONFIGS / f"demo-{args.task}.yaml").is_file():
        config_name = f"demo-{args.task}"  # a task with its own demo (calculator: its model and tools)
    cfg = load_config(config_name, overrides + _overrides(args))
    console = Console(quiet=not d.is_main)
    console.print(
        f"[bold]grpokit demo[/]: GRPO on {model_name}, task [cyan]{cfg.data.task}[/], "
        f"{cfg.train.max_steps} steps x {cfg.train.prompts_per_step} prompts "
        f"x {cfg.rollout.group_size} samples, "
        f"held-out greedy accuracy on {cfg.train.eval_max_prompts} problems before and after."
    )
    trainer = GRPOTrainer(cfg)
    summary = trainer.train()
    shutdown(trainer.dist)

    table = Table(
        title=f"held-out accuracy, task {cfg.data.task} (greedy, {cfg.train.eval_max_prompts} problems)"
    )
    for col in ("", "before", "after"):
        table.add_column(col)
    table.add_row(
        "accuracy", f"{summary['accuracy_before']:.1%}", f"[bold green]{summary['accuracy_after']:.1%}"
    )
    table.add_row("reward", f"{summary['reward_before']:.3f}", f"{summary['reward_after']:.3f}")
    console.print(table)
    samples = Table(title="sample completions (held-out)")
    for col in ("prompt", "expected", "before", "after"):
        samples.add_column(col)
    for b, a in zip(summary["eval_examples_before"], summary["eval_examples_after"], strict=True):
        mark = {1.0: "[green]", 0.0: "[red]"}
        samples.add_row(
            b["prompt"],
            str(b.get("answer")),
            f"{mark.get(b['reward'], '')}{b['completion']}",
            f"{mark.get(a['reward'], '')}{a['completion']}",
        )
    console.print(samples)
    _print_transcripts(console, summary["eval_examples_after"])
    console.print(
        f"{summary['steps']} steps in {summary['wall_time_s']:.1f} s; run directory: "
        f"{cfg.train.output_dir}; report: {cfg.train.output_dir}/report.html"
    )
    return 0


def _print_transcripts(console, examples: list[dict]) -> None:
    """Multi-turn runs: the first held-out episodes after training, each turn as the model saw it."""
    from rich.markup import escape

    for ex in [e for e in examples if "transcript" in e][:2]:
        console.print(f"[bold]episode[/] {escape(ex['prompt'])!s} (reward {ex['reward']:g}):")
        console.print(escape(ex["transcript"]), highlight=False)


def _model_dir(path: str):
    """A model directory from --model: itself, a run's final/, or the run's newest good checkpoint."""
    from pathlib import Path

    from grpokit.train.checkpoint import find_checkpoint

    p = Path(path)
    if (
        path in ("tiny", "tiny-calculator")
        or (p / "config.json").is_file()
        or (p / "adapter_config.json").is_file()
    ):
        return path
    if any((p / "final" / name).is_file() for name in ("config.json", "adapter_config.json")):
        return str(p / "final")
    ckpt = find_checkpoint(p, fallback=True)
    if ckpt is None:
        raise MissingFileError(f"{path}: not a model directory, and no final/ model or checkpoint in it")
    return str(ckpt / "model")


def cmd_eval(args: argparse.Namespace) -> int:
    from grpokit.config import RewardSpec
    from grpokit.data.datasets import format_prompt, load_rows
    from grpokit.data.tasks import TaskSource
    from grpokit.models.loading import load_model
    from grpokit.rewards.registry import build_rewards
    from grpokit.train.evaluate import evaluate, evaluate_sampled

    if args.task:
        held = TaskSource(args.task, difficulty=args.difficulty, split="eval", eval_size=args.limit)
        rows = [held.row(i) for i in range(len(held))]
    else:
        rows = load_rows(args.dataset, args.prompt_column)[: args.limit]
    names = args.reward or (["task_verifier"] if args.task else [])
    if not names:
        raise ConfigError("--dataset needs at least one --reward (e.g. a 'module:function' verifier)")
    rewards = build_rewards([RewardSpec(name=name) for name in names], task=args.task)
    prompts = [format_prompt(r, args.prompt_column, args.template) for r in rows]
    model_dir = _model_dir(args.model)
    model, tok = load_model(model_dir)
    options = dict(
        prompt_column=args.prompt_column,
        answer_column=args.answer_column,
        decode=args.decode,
        reorder_weights=args.reorder_weights,
        share_prompts=args.share_prompts,
    )
    greedy = evaluate(model, tok, rows, prompts, rewards, max_new_tokens=args.max_new_tokens, **options)
    result = {
        "model": model_dir,
        "task": args.task,
        "dataset": args.dataset,
        "num_prompts": len(rows),
        "greedy": {"pass@1": greedy["accuracy"], "reward_mean": greedy["reward_mean"]},
    }
    if args.n > 0:
        result["sampled"] = evaluate_sampled(
            model,
            tok,
            rows,
            prompts,
            rewards,
            n=args.n,
            ks=args.k,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            **options,
        )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from grpokit.models.loading import load_model, merged
    from grpokit.train.checkpoint import find_checkpoint

    run_dir, out = Path(args.run_dir), Path(args.out)
    if out.exists():
        raise RunExistsError(f"--out {out} already exists; choose a new directory")
    if args.checkpoint:
        src = find_checkpoint(run_dir / "checkpoints" / args.checkpoint) / "model"
    elif any((run_dir / "final" / name).is_file() for name in ("config.json", "adapter_config.json")):
        src = run_dir / "final"
    else:
        ckpt = find_checkpoint(run_dir, fallback=True)
        if ckpt is None:
            raise MissingFileError(f"{run_dir}: no final/ model and no checkpoint to export")
        src = ckpt / "model"
    model, tok = load_model(str(src))
    model = merged(model)  # LoRA runs: adapters merged into the base, a plain model comes out
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"exported {src} -> {out} (load it with AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    from grpokit.lab import run_lab

    summary = run_lab(args.output_dir, args.seeds, args.steps, args.eval_prompts, overrides=args.overrides)
    for arm, a in summary["arms"].items():
        m = a["mean"]
        print(
            f"{arm:15s} exploit {m['exploit_rate']:.2f}  true acc {m['true_accuracy']:.2f}  "
            f"proxy {m['proxy_reward']:.2f}  KL {m['mean_kl']:.3f}"
        )
    for f in summary["findings"]:
        print(f"{'holds' if f['holds'] else 'DOES NOT HOLD'}: {f['claim']} ({f['evidence']})")
    print(f"{summary['wall_time_s']} s; report: {args.output_dir}/report.html")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from grpokit.report import write_report

    print(f"wrote {write_report(args.run_dir)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        commands = {
            "train": cmd_train,
            "demo": cmd_demo,
            "eval": cmd_eval,
            "export": cmd_export,
            "report": cmd_report,
            "lab": cmd_lab,
        }
        return commands[args.command](args)
    except TrainingInterrupted as e:
        print(f"grpokit {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum
    except UserError as e:  # input the user can fix: one line. Anything else is a bug: its traceback.
        if os.environ.get("GRPOKIT_DEBUG"):
            raise
        kind = "configuration error: " if isinstance(e, ConfigError) else ""
        print(f"grpokit {args.command}: {kind}{e}", file=sys.stderr)
        return 2


def entry() -> NoReturn:
    """The ``grpokit`` command and ``python -m grpokit`` (``torchrun -m grpokit``): :func:`main`,
    then exit with its code. A process that ran a process group leaves by
    ``train.distributed.exit_process``: a gloo worker thread can otherwise abort it at interpreter
    exit after a finished run (pytorch/pytorch#179291)."""
    code = main()
    distributed = sys.modules.get("grpokit.train.distributed")  # not imported: no group was started
    if distributed is not None and distributed.group_started():
        distributed.exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
