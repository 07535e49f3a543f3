"""The server's Prometheus metrics: requests by endpoint and status, tokens, time to first token,
and the engine's decode steps, queue, slots, prefix-cache and speculative-decoding counts read at
each scrape (an engine without the latter two reports 0).

    metrics = Metrics(engine); metrics.request("chat", 200); body = metrics.text()"""

from __future__ import annotations

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ladder_jax.inference.batching import Engine

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (two apps in one process keep
    their counts apart); the engine's own counts are read when /metrics is scraped. No
    `*_created` series: prometheus_client's switch for them is process-wide, and building
    Metrics turns it off.

        metrics = Metrics(engine); metrics.request("chat", 200); body = metrics.text()"""

    def __init__(self, engine: Engine):
        prom.disable_created_metrics()  # read at each scrape, so it holds for this registry
        self.registry = r = prom.CollectorRegistry()
        self.requests = prom.Counter(
            "ladder_requests",
            "Requests answered, by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = prom.Counter(
            "ladder_prompt_tokens", "Prompt tokens admitted.", registry=r
        )
        self.generated_tokens = prom.Counter(
            "ladder_generation_tokens", "Tokens generated.", registry=r
        )
        self.ttft = prom.Histogram(
            "ladder_time_to_first_token_seconds",
            "From arrival to the first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        r.register(_EngineCounts(engine))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def text(self) -> bytes:
        return prom.generate_latest(self.registry)


# (series, help, the engine's counter): prompt tokens looked up in / reused from the prefix
# cache; tokens drafted by prompt lookup / accepted by the model's verification
ENGINE_COUNTERS = (
    (
        "prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_queried_tokens",
    ),
    (
        "prefix_cache_hit_tokens",
        "Prompt tokens whose KV the prefix cache supplied.",
        "prefix_hit_tokens",
    ),
    ("spec_drafted_tokens", "Tokens drafted by prompt lookup.", "drafted_tokens"),
    ("spec_accepted_tokens", "Drafted tokens the model accepted.", "accepted_tokens"),
    (
        "preemptions",
        "Requests sent back to the queue (to resume later) when the KV pages ran out.",
        "preemptions",
    ),
)


class _EngineCounts(prom.registry.Collector):
    """The engine's decode steps, queue, slots and cache / drafting counts, as they are at each
    scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        yield CounterMetricFamily("ladder_decode_steps", "Batched decode steps run.", e.steps)
        for name, help_, attr in ENGINE_COUNTERS:
            yield CounterMetricFamily(f"ladder_{name}", help_, getattr(e, attr, 0))
        drafted, accepted = getattr(e, "drafted_tokens", 0), getattr(e, "accepted_tokens", 0)
        yield GaugeMetricFamily(
            "ladder_spec_acceptance_rate",
            "Accepted / drafted tokens since start (0 before any draft).",
            accepted / drafted if drafted else 0.0,
        )
        for name, help_, value in (
            ("queue_depth", "Requests waiting for a slot.", e.waiting),
            ("slots_busy", "Slots generating.", e.busy),
            ("slots_total", "Slots (requests decoded together).", e.slots),
        ):
            yield GaugeMetricFamily(f"ladder_{name}", help_, value)
        pool = getattr(e, "pool", None)  # the paged KV cache's
        if pool is not None:
            yield GaugeMetricFamily(
                "ladder_kv_pages_total", "Pages of the KV cache (16 positions each).", pool.capacity
            )
            yield GaugeMetricFamily(
                "ladder_kv_pages_free",
                "KV pages no request holds (free, or keeping a cached prefix).",
                pool.available(),
            )
