"""What each hop of the ring costs on this node, measured: compute time in its layers and the
time to hand the result to the next node's relay, per decode step.

Only one-token activations (decode steps) are counted: a prompt's micro-batch of 128 tokens
spreads each weight read over all of them, so mixing it in would make a token look cheaper
than generating one is. Counts start over when a new plan (epoch) arrives, since its hops are
other windows. The head reads them through the Info RPC (`NodeStatus.hop_times`), `prima serve`
shows them in /v1/cluster, and each sample also moves a Prometheus counter labelled by hop.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from prima import metrics
from prima.net.codec import HopTiming


class HopTimes:
    """Running sums per hop index of the current plan epoch; thread-safe (the compute thread
    adds compute samples, relay sends may come from it or from RPC threads on the head)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = 0
        self._hops: dict[int, HopTiming] = {}

    def add_compute(self, epoch: int, hop_index: int, steps: int, ms: float) -> None:
        """`steps` decode steps went through hop `hop_index`'s layers in `ms` milliseconds."""
        with self._lock:
            t = self._at(epoch, hop_index)
            self._hops[hop_index] = replace(t, steps=t.steps + steps, compute_ms=t.compute_ms + ms)
        label = str(hop_index)
        metrics.NODE_HOP_STEPS.labels(label).inc(steps)
        metrics.NODE_HOP_COMPUTE.labels(label).inc(ms / 1e3)

    def add_relay(self, epoch: int, hop_index: int, ms: float) -> None:
        """One decode step's output of hop `hop_index` was handed on in `ms` milliseconds."""
        with self._lock:
            t = self._at(epoch, hop_index)
            self._hops[hop_index] = replace(t, relay_ms=t.relay_ms + ms)
        metrics.NODE_HOP_RELAY.labels(str(hop_index)).inc(ms / 1e3)

    def snapshot(self, epoch: int) -> tuple[HopTiming, ...]:
        """The sums for `epoch` (the plan now loaded), in hop order; none for another epoch."""
        with self._lock:
            if epoch != self._epoch:
                return ()
            return tuple(self._hops[i] for i in sorted(self._hops))

    def _at(self, epoch: int, hop_index: int) -> HopTiming:
        if epoch != self._epoch:
            self._epoch = epoch
            self._hops = {}
        return self._hops.get(hop_index) or HopTiming(hop_index)
