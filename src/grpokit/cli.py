"""The ``grpokit`` command line: ``grpokit train | demo | eval | report | export | lab``.

Each subcommand is a thin wrapper over the Python API; this file parses arguments and reports
errors as one clear line (exit code 2 for a bad configuration), nothing else. Subcommands whose
issue has not landed yet say so plainly and exit non-zero rather than print anything that looks
like training output.
"""

from __future__ import annotations

import argparse
import json
import sys

import grpokit
from grpokit.config import ConfigError, load_config

# Subcommands of DESIGN.md that are not built yet, and the issue that builds each.
_NOT_YET = {
    "demo": "the embedded demo (issue #4)",
    "eval": "evaluation (issue #6)",
    "export": "export (issue #6)",
    "report": "the run report (issue #4)",
    "lab": "the reward-hacking lab (issue #10)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpokit", description="Post-train language models with GRPO.")
    parser.add_argument("--version", action="version", version=f"grpokit {grpokit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train a model with GRPO from a YAML config")
    train.add_argument("--config", help="YAML config file (see docs/configuration.md); omitted: all defaults")
    _add_run_options(train)

    for name, what in _NOT_YET.items():
        p = sub.add_parser(name, help=f"(not yet available: {what})")
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
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
    from grpokit.train.trainer import GRPOTrainer

    cfg = load_config(args.config, _overrides(args))
    summary = GRPOTrainer(cfg).train()
    print(f"done: {summary['steps']} steps in {summary['wall_time_s']:.1f} s -> {cfg.train.output_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in _NOT_YET:
        print(
            f"grpokit {args.command}: not yet available -- it arrives with {_NOT_YET[args.command]}.",
            file=sys.stderr,
        )
        return 2
    try:
        return {"train": cmd_train}[args.command](args)
    except ConfigError as e:
        print(f"grpokit {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError) as e:
        print(f"grpokit {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
