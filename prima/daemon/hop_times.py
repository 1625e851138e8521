"""What each hop of the ring costs on this node, measured: compute time in its layers and the
time to hand the result to the next node's relay, per decode step.

Only one-token activations (decode steps) are counted: a prompt's micro-batch of 128 tokens
spreads each weight read over all of them, so mixing it in would make a token look cheaper
than generating one is. Counts start over when a new plan (epoch) arrives, since its hops are
other windows. The head reads them through the Info RPC (`NodeStatus.hop_times`), `prima serve`
shows them in /v1/cluster, and Prometheus reads the running totals by hop when it scrapes
(HopTimesCollector).

Adding a sample is a lock and three additions: it runs on every hop of every token, often on a
core that has just woken with cold caches, where each Prometheus update is slow; Prometheus
reads the totals when it scrapes instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from prima.net.node_status import HopTiming


class _Sums:
    """Running sums of one hop (mutable, unlike the HopTiming it is reported as)."""

    __slots__ = ("steps", "compute_ms", "relay_ms")

    def __init__(self) -> None:
        self.steps = 0
        self.compute_ms = 0.0
        self.relay_ms = 0.0

    def timing(self, hop_index: int) -> HopTiming:
        return HopTiming(hop_index, self.steps, self.compute_ms, self.relay_ms)


class HopTimes:
    """Running sums per hop index, for the current plan epoch and since the daemon started;
    thread-safe (the compute thread adds compute samples, relay sends may come from it or from
    RPC threads on the head)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = 0
        self._hops: dict[int, _Sums] = {}
        # Prometheus counters never go back, so its totals outlive a plan change.
        self._since_start: dict[int, _Sums] = {}

    def add_compute(self, epoch: int, hop_index: int, steps: int, ms: float) -> None:
        """`steps` decode steps went through hop `hop_index`'s layers in `ms` milliseconds."""
        with self._lock:
            for sums in self._sums(epoch, hop_index):
                sums.steps += steps
                sums.compute_ms += ms

    def add_relay(self, epoch: int, hop_index: int, ms: float) -> None:
        """One decode step's output of hop `hop_index` was handed on in `ms` milliseconds."""
        with self._lock:
            for sums in self._sums(epoch, hop_index):
                sums.relay_ms += ms

    def snapshot(self, epoch: int) -> tuple[HopTiming, ...]:
        """The sums for `epoch` (the plan now loaded), in hop order; none for another epoch."""
        with self._lock:
            if epoch != self._epoch:
                return ()
            return tuple(self._hops[i].timing(i) for i in sorted(self._hops))

    def since_start(self) -> tuple[HopTiming, ...]:
        """The sums of every plan this daemon has run, by hop index, in hop order."""
        with self._lock:
            return tuple(self._since_start[i].timing(i) for i in sorted(self._since_start))

    def _sums(self, epoch: int, hop_index: int) -> tuple[_Sums, _Sums]:
        if epoch != self._epoch:
            self._epoch = epoch
            self._hops = {}
        current = self._hops.get(hop_index)
        if current is None:
            current = self._hops[hop_index] = _Sums()
        total = self._since_start.get(hop_index)
        if total is None:
            total = self._since_start[hop_index] = _Sums()
        return current, total


class HopTimesCollector(Collector):
    """Each hop's decode steps, compute and relay time since the daemon started, read at scrape
    time from `totals()` (HopTimes.since_start): the compute thread only adds to sums."""

    def __init__(self, totals: Callable[[], Iterable[HopTiming]]) -> None:
        self._totals = totals

    def collect(self) -> Iterator[CounterMetricFamily]:
        steps = CounterMetricFamily(
            "prima_node_hop_steps",
            "Decode steps (one-token activations) through each hop of this node",
            labels=["hop"],
        )
        compute = CounterMetricFamily(
            "prima_node_hop_compute_seconds", "Time decode steps spent in each hop's layers", labels=["hop"]
        )
        relay = CounterMetricFamily(
            "prima_node_hop_relay_seconds",
            "Time to hand each hop's decode steps to the next node",
            labels=["hop"],
        )
        for t in self._totals():
            hop = [str(t.hop_index)]
            steps.add_metric(hop, t.steps)
            compute.add_metric(hop, t.compute_ms / 1e3)
            relay.add_metric(hop, t.relay_ms / 1e3)
        yield from (steps, compute, relay)


def register_hop_times(totals: Callable[[], Iterable[HopTiming]]) -> HopTimesCollector:
    collector = HopTimesCollector(totals)
    REGISTRY.register(collector)
    return collector
