"""What the benchmark scripts share: the small transformer body and the "median (min-max)" cell.

The bucketing, scaling and TRL benchmarks use one body (hidden 256, 4 layers, 4 heads of which 2
key/value, MLP 704: about 3M parameters plus the embedding), with the architecture, vocabulary
and context length each script needs.
"""

from __future__ import annotations

import statistics

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
