"""The command line parses and says plainly what is not built yet."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpokit import __version__
from grpokit.cli import main


def test_version():
    out = subprocess.run([sys.executable, "-m", "grpokit", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"grpokit {__version__}"


@pytest.mark.parametrize("command", ["demo", "train"])
def test_unbuilt_commands_say_not_yet_and_fail(command, capsys):
    assert main([command]) == 2
    assert "not yet available" in capsys.readouterr().err
