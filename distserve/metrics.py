"""Prometheus metrics, named as vLLM names them under the `distserve:` prefix, with vLLM's bucket edges.

Each service builds the group it updates and serves them on its own /metrics
port (`serve_metrics`). Histograms are in seconds. The latency histograms also
have edges at common SLO targets (TTFT 0.2, 0.3, 2 s; inter-token 0.02 s), so that
SLO attainment (deploy/grafana) is exact: rate(bucket{le=SLO}) / rate(count).
The launcher (`distserve up`) serves its own group: restarts of the children it
supervises (LauncherMetrics).
"""

from __future__ import annotations

import functools
import logging

from typing import Callable, Iterable, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

PREFIX = "distserve:"
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.25, 0.3, 0.5, 0.75, 1.0, 2.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
TRANSFER_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
BATCH_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Serves /metrics from a background thread; port 0 disables it."""
    if port:
        start_http_server(port, addr=host)
        log.info("metrics on http://%s:%d/metrics", host, port)


def _hist(name: str, doc: str, buckets: list[float], labels: tuple[str, ...] = (), prefix: str = PREFIX) -> Histogram:
    return Histogram(prefix + name, doc, labels, buckets=buckets)


@functools.cache
def records_rejected() -> Counter:
    """Records in Redis dropped for a missing or wrong signature (distserve.record_signing), by kind
    (worker, kv-handle): one counter per process, served with its other metrics."""
    return Counter(PREFIX + "registry_records_rejected", "Registry and KV handle records in Redis ignored "
                   "for a missing or wrong signature (forged or rewritten)", ["kind"])


class RouterMetrics:
    def __init__(self) -> None:
        self.ttft = _hist("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = _hist("inter_token_latency_seconds", "Time between streamed token messages, per token",
                         ITL_BUCKETS)
        self.e2e = _hist("e2e_request_latency_seconds", "End-to-end request latency", REQUEST_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Completion tokens generated")
        self.success = Counter(PREFIX + "request_success", "Finished requests", ["finished_reason"])
        self.failures = Counter(PREFIX + "request_failure", "Requests that ended in an error", ["code"])
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in flight through the router")
        self.retries = Counter(PREFIX + "request_retries", "Requests re-prefilled and moved to other workers "
                               "after a worker or its KV was lost, by the stage that failed", ["stage"])


class PrefillMetrics:
    def __init__(self) -> None:
        self.queue_time = _hist("request_queue_time_seconds", "Time waiting for a prefill batch", REQUEST_BUCKETS)
        self.prefill_time = _hist("request_prefill_time_seconds", "Prefill forward time", REQUEST_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled")
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Prompts waiting for a batch")
        self.queued_tokens = Gauge(PREFIX + "num_prompt_tokens_queued", "Prompt tokens queued or prefilling: "
                                   "the load a prefill autoscaler follows")
        self.running = Gauge(PREFIX + "num_requests_running", "Prompts in the running batch")
        self.kv_transfer_time = _hist("kv_transfer_seconds", "KV transfer time, sending side", TRANSFER_BUCKETS)
        self.kv_transfer_bytes = Counter(PREFIX + "kv_transfer_bytes", "KV bytes sent over UCX")
        self.held_bytes = Gauge(PREFIX + "kv_held_bytes", "KV bytes held for decode workers")
        self.batch_tokens = Histogram(PREFIX + "prefill_batch_tokens", "Packed prompt tokens in the forward that "
                                      "finished a request's prefill (one sample per request)",
                                      buckets=BATCH_TOKEN_BUCKETS)


class DecodeMetrics:
    def __init__(self) -> None:
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        self.cached_blocks = Gauge(PREFIX + "kv_cache_cached_blocks", "KV blocks no sequence holds, kept for "
                                   "prompts that start with their tokens (free for allocation)")
        self.running = Gauge(PREFIX + "num_requests_running", "Sequences in the running batch")
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Sequences waiting to join the batch")
        self.queue_time = _hist("request_queue_time_seconds", "KV loaded to joined the batch", REQUEST_BUCKETS)
        self.decode_time = _hist("request_decode_time_seconds", "Time in the running batch", REQUEST_BUCKETS)
        self.kv_transfer_time = _hist("kv_transfer_seconds", "KV transfer time, receiving side", TRANSFER_BUCKETS)
        self.kv_transfer_bytes = Counter(PREFIX + "kv_transfer_bytes", "KV bytes received over UCX")
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated")
        self.success = Counter(PREFIX + "request_success", "Finished sequences", ["finished_reason"])


class ColocatedMetrics:
    def __init__(self, prefix: str = PREFIX) -> None:
        """`prefix`: another one where these share a process with PrefillMetrics or DecodeMetrics (a
        prefill or decode worker that also serves whole requests)."""
        self.queue_time = _hist("request_queue_time_seconds", "Time waiting for the first prefill step",
                                REQUEST_BUCKETS, prefix=prefix)
        self.prefill_time = _hist("request_prefill_time_seconds", "First to last prefill step", REQUEST_BUCKETS,
                                  prefix=prefix)
        self.decode_time = _hist("request_decode_time_seconds", "Time in the running batch", REQUEST_BUCKETS,
                                 prefix=prefix)
        self.prompt_tokens = Counter(prefix + "prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = Counter(prefix + "generation_tokens", "Tokens generated after the first")
        self.success = Counter(prefix + "request_success", "Finished sequences", ["finished_reason"])
        self.kv_usage = Gauge(prefix + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        self.running = Gauge(prefix + "num_requests_running", "Sequences decoding")
        self.waiting = Gauge(prefix + "num_requests_waiting", "Prompts waiting for (more) prefill")
        self.batch_tokens = Histogram(prefix + "prefill_batch_tokens", "Packed prompt tokens in the step that "
                                      "finished a request's prefill (one sample per request)",
                                      buckets=BATCH_TOKEN_BUCKETS)


class _PrefixCacheCollector:
    """Reads a prefix cache's counters at each scrape (the engine keeps them; vLLM's names, in tokens)."""

    def __init__(self, cache, prefix: str):
        self._cache, self._prefix = cache, prefix

    def collect(self):
        stats, p = self._cache.stats, self._prefix
        families = [
            CounterMetricFamily(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                value=stats.queried_tokens),
            CounterMetricFamily(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)",
                                value=stats.hit_tokens),
            CounterMetricFamily(p + "prefix_cache_evicted_blocks", "Cached blocks evicted for new ones",
                                value=stats.evicted_blocks),
            GaugeMetricFamily(p + "prefix_cache_blocks", "Blocks holding a cached prefix",
                              value=self._cache.num_cached_blocks),
        ]
        return families


def watch_prefix_cache(cache, prefix: str = PREFIX) -> None:
    """Serves `cache`'s hit and query counters (distserve.engine.prefix_cache.PrefixCache; None: nothing)
    on this process's /metrics, named under `prefix`."""
    if cache is not None:
        from prometheus_client import REGISTRY
        REGISTRY.register(_PrefixCacheCollector(cache, prefix))


class BrokerMetrics:
    def __init__(self) -> None:
        self.operations = Counter(PREFIX + "kv_handle_operations", "Handle operations", ["operation", "outcome"])


class GatewayMetrics:
    """Registered in their own registry (one per app), served by the gateway's /metrics route."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_start_time_seconds: restarts, as the other services
        self.requests = Counter(PREFIX + "http_requests", "HTTP requests answered", ["path", "status"],
                                registry=self.registry)
        self.duration = Histogram(PREFIX + "http_request_duration_seconds", "HTTP request duration, to the last "
                                  "byte", ["path"], buckets=REQUEST_BUCKETS, registry=self.registry)


class Child(Protocol):
    """What LauncherMetrics reads of a supervised child (distserve.launcher.ManagedProcess)."""

    name: str
    state: str  # "running" | "restarting" | "failed"
    restarts: int


CHILD_STATES = ("running", "restarting", "failed")


class _ChildrenCollector:
    """Reads restarts and state from the children at each scrape: the supervisor keeps the counts on them."""

    def __init__(self, children: Callable[[], Iterable[Child]]):
        self._children = children

    def collect(self):
        restarts = CounterMetricFamily(PREFIX + "service_restarts", "Restarts of a child by the launcher's "
                                       "supervisor", labels=["service"])
        state = GaugeMetricFamily(PREFIX + "service_state", "1 for the state a supervised child is in "
                                  "(failed: a crash loop, left down)", labels=["service", "state"])
        for child in self._children():
            restarts.add_metric([child.name], child.restarts)
            for name in CHILD_STATES:
                state.add_metric([child.name, name], float(child.state == name))
        return [restarts, state]


class LauncherMetrics:
    """The launcher's own group, in its own registry (one per Cluster): restarts and state of its children."""

    def __init__(self, children: Callable[[], Iterable[Child]]):
        self.registry = CollectorRegistry()
        self.registry.register(_ChildrenCollector(children))
        self._server = None

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        log.info("launcher metrics on http://%s:%d/metrics", host, port)

    def stop(self) -> None:
        """Stops serving. Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
