"""``python -m grpokit`` (and ``torchrun -m grpokit``) runs the command line."""

from grpokit.cli import entry

entry()
