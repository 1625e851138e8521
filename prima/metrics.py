"""Prometheus metrics of `prima serve` and `primad`: the API's in SERVE_REGISTRY (prima serve's
/metrics, which adds its ring's nodes as read from them: prima.api.node_metrics), a daemon's in
prometheus_client's default registry (primad --metrics-port). Kept apart, neither exports the
other's families as zeros.

Counters and histograms are module objects, updated where the work happens; a daemon's residency
(resident bytes, budget, bytes read) is read when scraped, through `ResidencyCollector`, so a
scrape measures what is in memory now (mincore) instead of a number cached at the last token.
Its per-hop timings are read when scraped too (prima.daemon.hop_times.HopTimesCollector): a hop
runs on every token, where each counter update costs microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from prima.weights.window import Residency

# Seconds: from a loopback token (a few ms) to a model streamed from disk (seconds).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# -- the API (prima serve) ---------------------------------------------------------------------
SERVE_REGISTRY = CollectorRegistry()
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # as the default registry has
    SERVE_REGISTRY.register(_collector)
# How a request ended (prima.api.service.request_outcome): ok; cancelled (the client went away or
# the server is stopping); busy (the queue was full or the wait too long); bad_request (the input
# could not run, e.g. past the context); node_lost (a ring node failed or stopped answering);
# error (anything else).
REQUEST_OUTCOMES = ("ok", "cancelled", "busy", "bad_request", "node_lost", "error")
REQUESTS = Counter(
    "prima_requests",
    f"Generation requests answered, by outcome ({', '.join(REQUEST_OUTCOMES)})",
    ["outcome"],
    registry=SERVE_REGISTRY,
)
PROMPT_TOKENS = Counter("prima_prompt_tokens", "Prompt tokens processed", registry=SERVE_REGISTRY)
PROMPT_CACHED_TOKENS = Counter(
    "prima_prompt_cached_tokens",
    "Prompt tokens whose KV an earlier request left in the cache (not computed again)",
    registry=SERVE_REGISTRY,
)
GENERATED_TOKENS = Counter("prima_generated_tokens", "Tokens generated", registry=SERVE_REGISTRY)
TIME_TO_FIRST_TOKEN = Histogram(
    "prima_time_to_first_token_seconds",
    "From a request reaching the engine queue to its first token",
    buckets=_LATENCY_BUCKETS,
    registry=SERVE_REGISTRY,
)
TOKEN_LATENCY = Histogram(
    "prima_token_latency_seconds",
    "One decode step (a forward pass of one token)",
    buckets=_LATENCY_BUCKETS,
    registry=SERVE_REGISTRY,
)
QUEUE_DEPTH = Gauge("prima_queue_depth", "Requests waiting for the engine", registry=SERVE_REGISTRY)

# -- a daemon (primad) -------------------------------------------------------------------------
NODE_COMPUTE = Histogram(
    "prima_node_compute_seconds",
    "Time a micro-batch spends in this node's layers (one or more consecutive hops)",
    buckets=_LATENCY_BUCKETS,
)
NODE_RELAY_SEND = Histogram(
    "prima_node_relay_send_seconds",
    "Time to hand an activation to the next node's relay stream",
    buckets=_LATENCY_BUCKETS,
)
NODE_RELAYED = Counter(
    "prima_node_relayed_activations",
    "Activations this node sent on to another, by transport: its activation link, or gRPC where the "
    "peer has none that answers",
    ["transport"],
)
NODE_QUEUE_DEPTH = Gauge("prima_node_queue_depth", "Activations waiting for this node's compute thread")
NODE_SESSIONS = Gauge("prima_node_sessions", "Sessions open on this node")
NODE_ERRORS = Counter("prima_node_errors", "Sessions this node had to fail, by kind", ["kind"])


class ResidencyCollector(Collector):
    """The layer windows' residency, read at scrape time from `residency()` (None: no plan)."""

    def __init__(self, residency: Callable[[], Residency | None]) -> None:
        self._residency = residency

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        r = self._residency()
        if r is None:
            return
        yield GaugeMetricFamily(
            "prima_node_resident_weight_bytes", "Layer weights in memory now (mincore)", r.resident_bytes
        )
        yield GaugeMetricFamily(
            "prima_node_owned_weight_bytes", "Layer weights this node computes", r.owned_bytes
        )
        yield GaugeMetricFamily(
            "prima_node_weight_budget_bytes",
            "Layer weights it may keep resident (0: no limit)",
            r.budget_bytes,
        )
        yield GaugeMetricFamily(
            "prima_node_pinned_layers", "Layers kept resident while the rest stream", r.pinned_layers
        )
        yield CounterMetricFamily(
            "prima_node_prefetches", "Layers read in by the prefetch thread", r.prefetches
        )
        yield CounterMetricFamily("prima_node_releases", "Layers dropped from memory", r.releases)
        yield CounterMetricFamily(
            "prima_node_disk_read_bytes", "Bytes the prefetch thread read", r.bytes_read
        )
        yield CounterMetricFamily(
            "prima_node_read_wait_seconds", "Time compute waited for reads", r.wait_ms / 1e3
        )


def register_residency(residency: Callable[[], Residency | None]) -> ResidencyCollector:
    collector = ResidencyCollector(residency)
    REGISTRY.register(collector)
    return collector
