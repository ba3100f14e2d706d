"""raypipe.counters on a real Ray cluster: a counter made with known tag sets is exported at 0 before any increment."""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from tests.helpers import scrape_metrics

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
class _Holder:
    """Keeps the counter's process alive while the endpoint is scraped (a process's metrics end with it)."""

    def __init__(self, run: str) -> None:
        from raypipe.counters import counter

        self.zeroed = counter("raypipe_test_zeroed", "A probe.", ("run",), [{"run": run}])
        self.counted = counter("raypipe_test_counted", "A probe.", ("run",), [{"run": run}])
        self.counted.inc(2, {"run": run})

    def ready(self) -> bool:
        return True


def test_a_counter_is_exported_at_zero_for_its_known_tags_and_counts_up_from_there(ray_cluster: str) -> None:
    run = f"probe-{uuid.uuid4().hex[:8]}"
    holder = _Holder.remote(run)
    ray.get(holder.ready.remote())
    names = ["ray_raypipe_test_zeroed_total", "ray_raypipe_test_counted_total"]
    deadline = time.monotonic() + 60
    while True:  # an export between the 0 and the increment shows the counted one at 0 first
        lines = scrape_metrics(ray_cluster, names)
        values = {n: [line.rsplit(" ", 1)[1] for line in lines[n] if f'run="{run}"' in line] for n in names}
        if values[names[1]] == ["2.0"] or time.monotonic() > deadline:
            break
        time.sleep(2)
    ray.kill(holder)
    assert values == {names[0]: ["0.0"], names[1]: ["2.0"]}, values
