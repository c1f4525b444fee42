"""What the benchmark scripts share: the small transformer body, the "median (min-max)" cell, and
the peak-RSS reading.

The bucketing, scaling and TRL benchmarks use one body (hidden 256, 4 layers, 4 heads of which 2
key/value, MLP 704: about 3M parameters plus the embedding), with the architecture, vocabulary
and context length each script needs.
"""

from __future__ import annotations

import resource
import statistics
from pathlib import Path

SMALL_BODY = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def spread(values: list[float], fmt: str = ".2f") -> str:
    """``median (min-max)`` of ``values``."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def peak_rss_kib() -> int:
    """Peak resident set of this process's own memory, in KiB (Linux ``VmHWM``). Not
    ``ru_maxrss``: Linux carries that across ``execve``, so a child process would start with its
    parent's peak (a parent that built a model inflates every child's baseline)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
