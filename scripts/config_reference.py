"""Write docs/configuration.md from the config dataclasses (every option, default, help).

.venv/bin/python scripts/config_reference.py        # rewrite the file
.venv/bin/python scripts/config_reference.py --check # exit 1 if it is out of date (the tests do this)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grpokit.config import describe

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

HEADER = """# Configuration reference

Generated from `src/grpokit/config.py` by `scripts/config_reference.py`; do not edit by hand.

A run is configured by one YAML file (`grpokit train --config FILE`) plus overrides
(`--set train.max_steps=6`, values parsed as YAML). Unknown keys, wrong types and bad values fail
before any model is loaded, with a message naming the key and what is allowed.

`algo.*` fields left at `null` are filled from the `algorithm` preset (docs/algorithms.md).

| key | default | meaning |
|---|---|---|
"""


def render() -> str:
    rows = []
    for key, default, help_text in describe():
        cell = help_text.replace("|", "\\|")  # a bare | would split the markdown cell
        rows.append(f"| `{key}` | `{json.dumps(default)}` | {cell} |")
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if DOC.read_text() == text else 1)
    DOC.write_text(text)
    print(f"wrote {DOC}")
