"""Ray counters that exist from the start, at 0.

A counter Prometheus has never seen is "no data" in Grafana, not 0: the
dashboard's skipped non-finite steps showed "no data" on every healthy run.
Ray 2.60's `Counter.inc` refuses 0, but the recorder under it exports a
recorded 0 as a series at 0 (tests/test_counters.py), so `counter` records 0
for each tag set known when the counter is made.
"""

from __future__ import annotations

from ray.util.metrics import Counter

from raypipe.compat.ray import record_zero


def counter(name: str, description: str, tag_keys: tuple[str, ...], known: list[dict[str, str]]) -> Counter:
    """A Ray counter exported at 0 for each of the `known` tag sets until it is incremented."""
    made = Counter(name, description, tag_keys)
    for tags in known:
        record_zero(made, tags)  # `inc(0)` raises ValueError
    return made
