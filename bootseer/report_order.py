"""The order and the statistics both the report (:mod:`bootseer.report`) and its node-level
views (:mod:`bootseer.report_nodes`) use: the phases' order, node names in natural order
(node-2 before node-10), percentiles and the median + 3 MAD straggler threshold.

Why its own module: the two read each other's pieces; here, below both, neither imports the
other for them (:mod:`bootseer.report` re-exports every name, so imports of it keep working).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MAD_FLOOR_FRACTION",
    "MAD_FLOOR_S",
    "MAD_K",
    "PHASE_ORDER",
    "mad",
    "median",
    "natural_key",
    "percentile",
    "phase_key",
    "straggler_threshold",
    "worker_key",
]

PHASE_ORDER = (
    "restart",
    "environment",
    "checkpoint_prefetch",
    "image_prefetch",
    "command_start",
    "first_step",
    "hang",
)
MAD_K = 3.0
MAD_FLOOR_FRACTION = 0.01
MAD_FLOOR_S = 0.010


# -- statistics ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation: robust to the outliers it is used to find."""
    m = median(values)
    return median([abs(v - m) for v in values])


def straggler_threshold(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, MAD, threshold): threshold = median + 3 * max(MAD, 1% of median, 10 ms)."""
    m = median(values)
    d = mad(values)
    return m, d, m + MAD_K * max(d, MAD_FLOOR_FRACTION * abs(m), MAD_FLOOR_S)


# -- order -----------------------------------------------------------------------------------------

_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple[Any, ...]:
    """node-2 before node-10."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in _DIGITS.split(text) if p)


def worker_key(node: str, rank: Any) -> tuple[Any, ...]:
    return (natural_key(node), rank is not None, natural_key(str(rank)) if rank is not None else ())


def phase_key(phase: str) -> tuple[Any, ...]:
    return (PHASE_ORDER.index(phase), "") if phase in PHASE_ORDER else (len(PHASE_ORDER), phase)
