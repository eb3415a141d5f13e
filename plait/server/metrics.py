"""Prometheus metrics of one HTTP server (`GET /metrics`), in a registry of its own.

Counters and histograms are updated as requests finish (TokenizerManager listener) and as
HTTP responses go out; gauges are refreshed from the scheduler's statistics at each scrape.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from plait.io_struct import ReqState
from plait.tokenizer.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        self.http_requests = Counter(
            "plait_http_requests",
            "HTTP responses by route and status code",
            ["method", "path", "status"],
            registry=r,
        )
        self.finished = Counter(
            "plait_requests_finished",
            "generation requests finished, by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.rate_limited = Counter(
            "plait_rate_limited_requests",
            "requests refused by an API key's rate limit (key: its name or a hash, never the "
            "key; limit: rpm or tpm)",
            ["key", "limit"],
            registry=r,
        )
        self.admissions = Counter(
            "plait_admission_requests",
            "generation requests by priority tier (interactive > 0, default 0, batch < 0) and "
            "whether admission took them or refused them (queue full)",
            ["tier", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "plait_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("plait_generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter(
            "plait_cached_tokens", "prompt tokens served from the radix cache", registry=r
        )
        self.ttft = Histogram(
            "plait_time_to_first_token_seconds",
            "time to first token of streamed requests",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "plait_time_per_output_token_seconds",
            "mean time per output token after the first, streamed requests",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "plait_e2e_request_latency_seconds",
            "request latency from arrival to last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "plait_queue_wait_seconds",
            "time from arrival until the scheduler first ran the request",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.running = Gauge("plait_num_running_requests", "requests being decoded", registry=r)
        self.waiting = Gauge(
            "plait_num_waiting_requests", "requests waiting to be scheduled", registry=r
        )
        self.kv_usage = Gauge(
            "plait_kv_cache_usage", "fraction of KV slots held by requests", registry=r
        )
        self.kv_used = Gauge("plait_kv_cache_used_tokens", "KV slots held by requests", registry=r)
        self.kv_total = Gauge("plait_kv_cache_total_tokens", "KV pool size in tokens", registry=r)
        self.cache_hit_rate = Gauge(
            "plait_cache_hit_rate", "cached prompt tokens / prompt tokens since start", registry=r
        )
        self.healthy = Gauge(
            "plait_healthy", "1 when the scheduler answered this scrape", registry=r
        )
        self._scheduler_stats: dict = {}
        r.register(_SchedulerCounters(self))

    # ------------------------------------------------------------------ updates
    def on_finish(self, state: ReqState) -> None:
        """TokenizerManager listener: every request that finished with output."""
        meta = state.meta
        reason = (state.finished_reason or {}).get("type", "unknown")
        self.finished.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(meta.get("prompt_tokens", state.prompt_tokens))
        self.generation_tokens.inc(meta.get("completion_tokens", len(state.output_ids)))
        self.cached_tokens.inc(meta.get("cached_tokens", 0))
        self.e2e.observe(time.monotonic() - state.created)
        if meta.get("queue_time") is not None:  # reported by schedulers that measure it
            self.queue_wait.observe(meta["queue_time"])

    def observe_stream(self, state: ReqState) -> None:
        """A streamed request's last state: its first token arrived on its own."""
        if state.first_token_time is None:
            return
        self.ttft.observe(state.first_token_time - state.created)
        n = len(state.output_ids)
        if n > 1:
            self.tpot.observe((time.monotonic() - state.first_token_time) / (n - 1))

    def observe_rate_limited(self, key: str, limit: str) -> None:
        self.rate_limited.labels(key=key, limit=limit).inc()

    def observe_admission(self, tier: str, admitted: bool) -> None:
        self.admissions.labels(tier=tier, outcome="admitted" if admitted else "refused").inc()

    def observe_http(self, method: str, path: str, status: int) -> None:
        self.http_requests.labels(method=method, path=path, status=str(status)).inc()

    # ------------------------------------------------------------------ scrape
    async def render(self, tm: TokenizerManager) -> bytes:
        try:
            stats = await tm.get_stats(timeout=2.0)
        except Exception as e:  # a dead or stuck scheduler still leaves the counters readable
            logger.warning("metrics: no scheduler stats (%s)", e)
            self.healthy.set(0)
        else:
            self.healthy.set(1)
            self.running.set(stats.get("num_running", 0))
            self.waiting.set(stats.get("num_waiting", 0))
            self.kv_usage.set(stats.get("kv_usage", 0.0))
            self.kv_used.set(stats.get("kv_used", 0))
            self.kv_total.set(stats.get("max_total_tokens", 0))
            self.cache_hit_rate.set(stats.get("cache_hit_rate", 0.0))
            self._scheduler_stats = stats
        return generate_latest(self.registry)


class _SchedulerCounters:
    """Counters the scheduler keeps (forced tokens, forwards, retractions) and its grammar
    manager's compile statistics, as of the last scrape's stats."""

    COUNTERS = {
        "forced_tokens": "tokens appended by grammar jump-forward (no decode step each)",
        "retractions": "running requests sent back to the queue for lack of KV memory",
        "extend_forwards": "prefill (extend) forward passes",
        "decode_forwards": "decode forward passes",
        "decode_shared_kv_tokens": (
            "KV rows decode attention read once for requests sharing a cached prefix "
            "instead of once per request"
        ),
    }
    GRAMMAR = {
        "cache_hits": "constraint compiles served from the in-memory cache",
        "cache_misses": "constraints that had to be compiled (or loaded from disk)",
        "disk_hits": "compiled constraints loaded from --grammar-cache-dir",
        "failures": "constraints refused or failed to compile",
        "timeouts": "constraint compiles over --grammar-compile-timeout",
    }

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        stats = self.metrics._scheduler_stats
        for key, doc in self.COUNTERS.items():
            family = CounterMetricFamily(f"plait_{key}", doc)
            family.add_metric([], stats.get(key, 0))
            yield family
        yield from self._threads(stats.get("threads") or {})
        grammar = stats.get("grammar") or {}
        for key, doc in self.GRAMMAR.items():
            family = CounterMetricFamily(f"plait_grammar_{key}", doc)
            family.add_metric([], grammar.get(key, 0))
            yield family
        hist = grammar.get("compile_seconds") or {"buckets": {}, "sum": 0.0}
        cumulative, buckets = 0, []
        for bound, count in hist["buckets"].items():
            cumulative += count
            buckets.append((bound, cumulative))
        if not buckets:
            buckets = [("+Inf", 0)]
        family = HistogramMetricFamily(
            "plait_grammar_compile_seconds", "constraint compile time (seconds)"
        )
        family.add_metric([], buckets, hist["sum"])
        yield family

    @staticmethod
    def _threads(threads: dict):
        """The forward's torch thread count (plait/runtime/thread_tuner.py when adaptive)."""
        family = GaugeMetricFamily("plait_forward_threads", "torch threads of the last forward")
        family.add_metric([], threads.get("threads", 0))
        yield family
        family = CounterMetricFamily(
            "plait_forwards_by_threads", "forward passes by torch thread count (adaptive threads)",
            labels=["threads"],
        )
        for n, count in (threads.get("forwards_by_threads") or {}).items():
            family.add_metric([n], count)
        yield family
        for key, doc in (("probes", "runs of a thread count other than the best, to re-measure it"),
                         ("switches", "changes of a forward kind and size's best thread count")):
            family = CounterMetricFamily(f"plait_thread_{key}", f"adaptive threads: {doc}")
            family.add_metric([], threads.get(key, 0))
            yield family
