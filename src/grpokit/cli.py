"""The ``grpokit`` command line: ``grpokit demo | train | eval | report | export | lab``.

Each subcommand is a thin wrapper over the Python API; this file parses arguments and nothing
else. Subcommands whose issue has not landed yet say so plainly and exit non-zero rather than
printing anything that looks like training output.
"""

from __future__ import annotations

import argparse
import sys

import grpokit

# Subcommands of DESIGN.md that are not built yet, and the issue that builds each.
_NOT_YET = {
    "train": "the trainer (issue #3)",
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
    for name, what in _NOT_YET.items():
        p = sub.add_parser(name, help=f"(not yet available: {what})")
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    print(
        f"grpokit {args.command}: not yet available -- it arrives with {_NOT_YET[args.command]}. "
        "Today grpokit ships the GRPO math core, grpokit.algo.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
