"""The `tokenflow_*` metrics of one LLMServer replica, through `ray.util.metrics`.

Ray exports them from every worker to the node's metrics agent, so they show up in the Ray
dashboard and in its Prometheus endpoint (as `ray_tokenflow_*`; counters gain `_total`). Every
metric is tagged with the served model's name and, through `ray.serve.metrics`, with the Serve
`application`, `deployment` and `replica` it comes from (outside a replica, e.g. in a unit test,
those three tags are simply absent): the Grafana dashboards filter and group by them.

Two feeds, neither per token:
- `observe_request` once per finished request, from its `RequestMetrics` timestamps;
- `observe_engine` from a periodic poll of the engine's `EngineState`: gauges now, and its
  cumulative counters (turned into counter increments here).

What the latencies measure (all wall clock, seconds):
- TTFT: engine arrival -> first token of any sequence.
- inter-token latency: (last token - first token) / (tokens of the longest sequence - 1), one
  observation per request (the mean gap), so the hot path records nothing per token.
- e2e: engine arrival -> finished.
- queue time: the ingress received the HTTP request -> the engine accepted it. This is the time
  spent in Serve's routing and replica queues plus tokenization; time spent in the engine's own
  waiting queue is not separable from prefill with the engine's timestamps and is part of TTFT
  (the `tokenflow_num_requests_waiting` gauge shows that queue's length).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from ray.serve.metrics import Counter, Gauge, Histogram

from tokenflow.scheduler import SchedulerStats

if TYPE_CHECKING:  # the engine's module imports torch; this one is read by the ingress too
    from tokenflow.replica.engine.engine import EngineState

_LATENCY_BUCKETS_S = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                      7.5, 10.0, 20.0, 40.0, 80.0]
_ITL_BUCKETS_S = [0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                  0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
_TAG_KEYS = ("model",)
_M = TypeVar("_M", Counter, Gauge, Histogram)


@dataclass(frozen=True)
class RequestTiming:
    """One finished request, as the metrics need it (timestamps are `time.time()`)."""

    received_time: float | None  # when the ingress got the HTTP request; None if unknown
    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    max_sequence_tokens: int  # tokens of the longest of the n sequences


class ServerMetrics:
    """Owns one replica's `tokenflow_*` metric objects and the counter totals already reported.

    Ray aggregates the same metric name across replicas by their tags, so each replica creates
    its own objects; the model tag tells deployments of different models apart.
    """

    def __init__(self, model_name: str) -> None:
        self.names: list[str] = []  # every metric this replica defines

        def tagged(metric: _M) -> _M:
            # A fresh dict per metric: Serve's set_default_tags adds its own tags to the dict it
            # is given (and, unlike ray.util.metrics, returns None).
            metric.set_default_tags({"model": model_name})
            self.names.append(metric.info["name"])
            return metric

        def gauge(name: str, doc: str) -> Gauge:
            return tagged(Gauge(name, doc, tag_keys=_TAG_KEYS))

        def counter(name: str, doc: str) -> Counter:
            return tagged(Counter(name, doc, tag_keys=_TAG_KEYS))

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return tagged(Histogram(name, doc, buckets, tag_keys=_TAG_KEYS))

        self.running = gauge("tokenflow_num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("tokenflow_num_requests_waiting", "Requests waiting for admission.")
        self.kv_usage = gauge("tokenflow_kv_cache_usage", "Fraction of KV blocks in use (0-1).")
        self.prefix_queries = counter("tokenflow_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("tokenflow_prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache.")
        self.preemptions = counter("tokenflow_num_preemptions", "Requests preempted.")
        self.prompt_tokens = counter("tokenflow_prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("tokenflow_generation_tokens", "Tokens generated.")
        self.ttft = histogram("tokenflow_time_to_first_token_seconds",
                              "Engine arrival to first token.", _LATENCY_BUCKETS_S)
        self.itl = histogram("tokenflow_inter_token_latency_seconds",
                             "Mean gap between tokens of a request.", _ITL_BUCKETS_S)
        self.e2e = histogram("tokenflow_e2e_request_latency_seconds",
                             "Engine arrival to the request's last token.", _LATENCY_BUCKETS_S)
        self.queue_time = histogram("tokenflow_request_queue_time_seconds",
                                    "Ingress receipt to engine arrival.", _LATENCY_BUCKETS_S)
        self.waiting_remote_kv = gauge(
            "tokenflow_num_requests_waiting_for_remote_kv",
            "Requests waiting for their prompt's KV from a prefill replica.")
        self.kv_transfer_bytes = counter("tokenflow_kv_transfer_bytes",
                                         "KV-cache bytes received from other replicas.")
        self.kv_transfer_seconds = counter("tokenflow_kv_transfer_seconds",
                                           "Seconds spent receiving KV from other replicas.")
        self.kv_transfer_failures = counter(
            "tokenflow_kv_transfer_failures",
            "KV loads that failed (their prompts were recomputed locally).")
        self.spec_drafts = counter("tokenflow_spec_decode_num_drafts",
                                   "Steps in which a request verified draft tokens.")
        self.spec_draft_tokens = counter("tokenflow_spec_decode_num_draft_tokens",
                                         "Draft tokens verified.")
        self.spec_accepted = counter("tokenflow_spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted.")
        self.spec_accepted_per_pos = tagged(Counter(
            "tokenflow_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of a step's drafts (0: the first).",
            tag_keys=(*_TAG_KEYS, "position")))
        self.lora_requests = tagged(Counter(
            "tokenflow_lora_requests", "Finished requests, per LoRA adapter.",
            tag_keys=(*_TAG_KEYS, "lora")))
        self.lora_generation_tokens = tagged(Counter(
            "tokenflow_lora_generation_tokens", "Tokens generated, per LoRA adapter.",
            tag_keys=(*_TAG_KEYS, "lora")))
        self.lora_loads = counter("tokenflow_lora_loads",
                                  "LoRA adapters loaded into a slot (each stage counts once).")
        self.lora_evictions = counter("tokenflow_lora_evictions",
                                      "LoRA adapters evicted from a slot for another.")
        self._reported = SchedulerStats()  # the counter totals already reported

    def observe_request(self, t: RequestTiming) -> None:
        """Record one finished request's latencies and token counts."""
        _inc(self.prompt_tokens, t.num_prompt_tokens)
        _inc(self.generation_tokens, t.num_generation_tokens)
        if t.received_time is not None:
            self.queue_time.observe(max(0.0, t.arrival_time - t.received_time))
        if t.first_token_time is not None:
            self.ttft.observe(max(0.0, t.first_token_time - t.arrival_time))
            if t.last_token_time is not None and t.max_sequence_tokens > 1:
                gap = (t.last_token_time - t.first_token_time) / (t.max_sequence_tokens - 1)
                self.itl.observe(max(0.0, gap))
        if t.finished_time is not None:
            self.e2e.observe(max(0.0, t.finished_time - t.arrival_time))

    def observe_engine(self, state: EngineState) -> None:
        """Set the gauges; add what the engine's counters gained since the last call."""
        self.running.set(state.num_running)
        self.waiting.set(state.num_waiting)
        self.kv_usage.set(state.kv_usage)
        self.waiting_remote_kv.set(state.num_waiting_for_remote_kvs)
        now, last = state.totals, self._reported
        for metric, name in ((self.prefix_queries, "prefix_cache_queries"),
                             (self.prefix_hits, "prefix_cache_hits"),
                             (self.preemptions, "num_preemptions"),
                             (self.kv_transfer_bytes, "kv_transfer_bytes"),
                             (self.kv_transfer_seconds, "kv_transfer_seconds"),
                             (self.kv_transfer_failures, "kv_transfer_failures"),
                             (self.spec_drafts, "num_drafts"),
                             (self.spec_draft_tokens, "num_draft_tokens"),
                             (self.spec_accepted, "num_accepted_tokens"),
                             (self.lora_loads, "lora_loads"),
                             (self.lora_evictions, "lora_evictions")):
            _inc(metric, getattr(now, name) - getattr(last, name))
        before = last.num_accepted_tokens_per_pos
        for pos, total in enumerate(now.num_accepted_tokens_per_pos):
            gained = total - (before[pos] if pos < len(before) else 0)
            if gained > 0:
                self.spec_accepted_per_pos.inc(gained, tags={"position": str(pos)})
        for metric, mine, theirs in (
                (self.lora_requests, now.lora_requests, last.lora_requests),
                (self.lora_generation_tokens, now.lora_generated_tokens,
                 last.lora_generated_tokens)):
            for name, total in mine.items():
                if total > theirs.get(name, 0):
                    metric.inc(total - theirs.get(name, 0), tags={"lora": name})
        # A copy: the engine's totals go on changing (in this process, with an engine thread).
        self._reported = dataclasses.replace(
            now, num_accepted_tokens_per_pos=list(now.num_accepted_tokens_per_pos),
            lora_requests=dict(now.lora_requests),
            lora_generated_tokens=dict(now.lora_generated_tokens))


def _inc(counter: Counter, amount: float) -> None:
    # Ray counters reject increments <= 0; "nothing happened" is simply not recorded.
    if amount > 0:
        counter.inc(amount)
