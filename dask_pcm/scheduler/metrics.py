"""Prometheus metrics of the scheduler plugin, scraped from the scheduler's ``/metrics``
with Dask's own: ``dask_pcm_context_workers{context,state}``,
``dask_pcm_ready_workers{context}``, ``dask_pcm_load_seconds{context}`` (histogram of
resident-context load times) and ``dask_pcm_tasks_total{context,worker}`` (context tasks
finished per worker).

One collector per process, registered once, reads every live plugin's
:class:`~dask_pcm.scheduler.state.ContextStates`. ``prometheus_client`` is a dependency;
Dask treats it as optional, so a missing one only turns the metrics off.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import Any

from dask_pcm.protocol import READY
from dask_pcm.scheduler.state import ContextStates

logger = logging.getLogger(__name__)

LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

_live: weakref.WeakSet[ContextStates] = weakref.WeakSet()
_collector: Any = None


def track(states: ContextStates) -> None:
    """Report ``states`` in the metrics (until :func:`untrack`)."""
    global _collector
    _live.add(states)
    if _collector is not None:
        return
    try:
        import prometheus_client
    except ImportError:  # pragma: no cover - a dependency; Dask treats it as optional
        logger.info("prometheus_client is not installed: no dask_pcm metrics")
        return
    _collector = _Collector()
    prometheus_client.REGISTRY.register(_collector)


def untrack(states: ContextStates) -> None:
    _live.discard(states)


class _Collector:
    def describe(self) -> list[Any]:
        return []  # names are known only when collecting; skip the registry's check

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        states = GaugeMetricFamily(
            "dask_pcm_context_workers",
            "Workers per context and state",
            labels=["context", "state"],
        )
        ready = GaugeMetricFamily(
            "dask_pcm_ready_workers", "Workers where the context is ready", labels=["context"]
        )
        loads = HistogramMetricFamily(
            "dask_pcm_load_seconds",
            "Time to build a resident context (level full) on a worker",
            labels=["context"],
        )
        tasks = CounterMetricFamily(
            "dask_pcm_tasks",
            "Context tasks finished, per worker",
            labels=["context", "worker"],
        )
        for live in list(_live):
            for name, by_worker in sorted(live.placements.items()):
                counts: dict[str, int] = {}
                for p in by_worker.values():
                    counts[p.state] = counts.get(p.state, 0) + 1
                    tasks.add_metric([name, p.worker], p.tasks)
                for state, n in sorted(counts.items()):
                    states.add_metric([name, state], n)
                ready.add_metric([name], counts.get(READY, 0))
                durations = live.load_durations.get(name, [])
                buckets = [(str(b), sum(1 for d in durations if d <= b)) for b in LOAD_BUCKETS]
                buckets.append(("+Inf", len(durations)))
                loads.add_metric([name], buckets, sum(durations))
        yield from (states, ready, loads, tasks)
