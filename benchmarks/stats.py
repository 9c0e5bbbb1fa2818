"""The benchmarks' one percentile (nearest rank over the sorted samples)."""

from __future__ import annotations


def pct(values: list[float], p: float) -> float:
    """The ``p``-th percentile of ``values`` (NaN for none)."""
    s = sorted(values)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]
