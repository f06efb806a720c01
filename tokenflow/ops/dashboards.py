"""tokenflow's Grafana dashboards, generated from one list of panels.

`PANELS` is the single source: each panel names its dashboard, a title and its PromQL queries.
`dashboards()` turns the list into Grafana dashboard JSON models (overview, engine, cluster),
each with a Prometheus datasource variable and application / replica filters. The same JSON is
written by `tokenflow dashboards render DIR`, shipped by the Helm chart as ConfigMaps for
Grafana's sidecar, and pushed by `tokenflow dashboards push`.

Metric names are Ray's Prometheus names: Ray prefixes every `ray.util.metrics` name with `ray_`,
counters gain `_total` and histograms `_bucket` / `_sum` / `_count`. The `application`,
`deployment` and `replica` labels come from Serve (`tokenflow.cluster.metrics` uses
`ray.serve.metrics`); `ray_serve_*` are Serve's own metrics. Every `tokenflow_*` metric of
`ServerMetrics` must appear in some panel: tests/cluster/test_dashboards.py checks it, so a new
metric forces a panel here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Filters from the dashboard variables. `$application` and `$replica` are regexes ("All" is .*).
_APP = 'application=~"$application"'
_TF = '{' + _APP + ', replica=~"$replica"}'
_SERVE = '{' + _APP + '}'
_SERVER = '{' + _APP + ', deployment="LLMServer", replica=~"$replica"}'
_RATE = "[$__rate_interval]"
QUANTILES = (0.5, 0.9, 0.99)


def metric(name: str, suffix: str = "") -> str:
    """Ray's Prometheus name of a `tokenflow_*` metric (`suffix`: _total, _bucket, ...)."""
    return f"ray_{name}{suffix}"


def rate(name: str, suffix: str = "_total", by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric(name, suffix)}{_TF}{_RATE}))"


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a panel and the legend of its series."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """One time-series panel: which dashboard it is on, its title, unit and queries."""

    dashboard: str
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""


def quantiles(name: str) -> tuple[Query, ...]:
    """p50 / p90 / p99 of a `tokenflow_*` histogram over all selected replicas."""
    buckets = f"sum by (le) (rate({metric(name, '_bucket')}{_TF}{_RATE}))"
    return tuple(Query(f"histogram_quantile({q}, {buckets})", f"p{round(q * 100)}")
                 for q in QUANTILES)


def _overview() -> list[Panel]:
    e2e = "tokenflow_e2e_request_latency_seconds"
    return [
        Panel("overview", "Finished requests / s", (
            Query(f"sum by (model) (rate({metric(e2e, '_count')}{_TF}{_RATE}))", "{{model}}"),),
            "reqps", "Requests the engines finished, per served model."),
        Panel("overview", "HTTP requests / s by status", (
            Query(f"sum by (status_code) (rate(ray_serve_num_http_requests_total{_SERVE}{_RATE}))",
                  "{{status_code}}"),), "reqps", "Every HTTP request the Serve proxy answered."),
        Panel("overview", "Errors / s", (
            Query(f"sum by (error_code) (rate(ray_serve_num_http_error_requests_total{_SERVE}"
                  f"{_RATE}))", "{{error_code}}"),), "reqps",
              "HTTP requests answered with an error status (4xx, 5xx), by status code."),
        Panel("overview", "Throughput (tokens / s)", (
            Query(rate("tokenflow_prompt_tokens"), "prompt"),
            Query(rate("tokenflow_generation_tokens"), "generation")), "short",
              "Prompt tokens processed and tokens generated, all selected replicas."),
        Panel("overview", "Time to first token", quantiles("tokenflow_time_to_first_token_seconds"),
              "s", "Engine arrival to the first token."),
        Panel("overview", "Inter-token latency", quantiles("tokenflow_inter_token_latency_seconds"),
              "s", "Mean gap between the tokens of a request (one observation per request)."),
        Panel("overview", "End-to-end latency", quantiles(e2e), "s",
              "Engine arrival to the request's last token."),
        Panel("overview", "Queue time", quantiles("tokenflow_request_queue_time_seconds"), "s",
              "Ingress receipt to engine arrival: Serve routing, replica queue, tokenization."),
    ]


def _engine() -> list[Panel]:
    hits, queries = "tokenflow_prefix_cache_hits", "tokenflow_prefix_cache_queries"
    return [
        Panel("engine", "Requests running / waiting", (
            Query(f"sum({metric('tokenflow_num_requests_running')}{_TF})", "running"),
            Query(f"sum({metric('tokenflow_num_requests_waiting')}{_TF})", "waiting")), "short",
              "Requests in the engines' running batches and waiting queues."),
        Panel("engine", "KV cache usage", (
            Query(f"max by (replica) ({metric('tokenflow_kv_cache_usage')}{_TF})", "{{replica}}"),),
              "percentunit", "Fraction of each replica's KV blocks in use."),
        Panel("engine", "Prefix-cache hit rate", (
            Query(f"{rate(hits)} / {rate(queries)}", "hit rate"),), "percentunit",
              "Prompt tokens served from the prefix cache / prompt tokens looked up."),
        Panel("engine", "Prefix-cache lookups (tokens / s)", (
            Query(rate(queries), "looked up"), Query(rate(hits), "hit")), "short"),
        Panel("engine", "Preemptions / s", (
            Query(rate("tokenflow_num_preemptions", by="replica"), "{{replica}}"),), "short",
              "Requests preempted for lack of KV blocks (their blocks are freed and recomputed)."),
        *_speculative(),
        Panel("engine", "LoRA adapters: requests / s", (
            Query(rate("tokenflow_lora_requests", by="lora"), "{{lora}}"),), "reqps",
              "Finished requests per LoRA adapter (the base model's are not counted here)."),
        Panel("engine", "LoRA adapters: generated tokens / s", (
            Query(rate("tokenflow_lora_generation_tokens", by="lora"), "{{lora}}"),), "short",
              "Tokens generated per LoRA adapter."),
        Panel("engine", "LoRA adapter slot loads and evictions / s", (
            Query(rate("tokenflow_lora_loads"), "loads"),
            Query(rate("tokenflow_lora_evictions"), "evictions")), "short",
              "Adapters loaded into a slot (from CPU memory or disk), and evicted for another."),
        Panel("engine", "Batch size (running requests per replica)", (
            Query(f"sum by (replica) ({metric('tokenflow_num_requests_running')}{_TF})",
                  "{{replica}}"),), "short", "Sequences in each replica's running batch."),
    ]


def _speculative() -> list[Panel]:
    """Speculative decoding: how many drafts the model accepts."""
    drafts, tokens = "tokenflow_spec_decode_num_drafts", "tokenflow_spec_decode_num_draft_tokens"
    accepted = "tokenflow_spec_decode_num_accepted_tokens"
    per_pos = "tokenflow_spec_decode_num_accepted_tokens_per_pos"
    return [
        Panel("engine", "Speculative decoding: acceptance rate", (
            Query(f"{rate(accepted)} / clamp_min({rate(tokens)}, 1e-9)", "accepted / drafted"),),
              "percentunit", "Share of draft tokens the model accepted (0 without drafts)."),
        Panel("engine", "Speculative decoding: mean accepted length", (
            Query(f"{rate(accepted)} / clamp_min({rate(drafts)}, 1e-9)", "tokens per step"),),
              "short", "Draft tokens accepted per verifying step (each step adds one more)."),
        Panel("engine", "Speculative decoding: accepted per position", (
            Query(rate(per_pos, by="position"), "position {{position}}"),), "short",
              "Accepted draft tokens per second at each position of a step's drafts."),
    ]


def _cluster() -> list[Panel]:
    running, waiting = "tokenflow_num_requests_running", "tokenflow_num_requests_waiting"
    return [
        Panel("cluster", "Replicas", (
            Query(f"sum by (deployment) (ray_serve_deployment_replica_healthy{_SERVE})",
                  "{{deployment}} healthy"),
            Query(f"sum by (deployment) (ray_serve_autoscaling_target_replicas{_SERVE})",
                  "{{deployment}} target")), "short",
              "Healthy replicas per deployment, and the autoscaler's target."),
        Panel("cluster", "Load per replica (engine)", (
            Query(f"sum by (replica) ({metric(running)}{_TF} + {metric(waiting)}{_TF})",
                  "{{replica}}"),), "short", "Running plus waiting requests in each engine."),
        Panel("cluster", "Ongoing requests per replica (Serve)", (
            Query(f"sum by (replica) (ray_serve_replica_processing_queries{_SERVER})",
                  "{{replica}}"),), "short",
              "Requests Serve has handed to each LLMServer replica (what autoscaling sees)."),
        Panel("cluster", "Generation throughput per replica", (
            Query(rate("tokenflow_generation_tokens", by="replica"), "{{replica}}"),), "short",
              "Tokens generated per second by each replica."),
        *_kv_transfer(),
    ]


def _kv_transfer() -> list[Panel]:
    """Prefill/decode disaggregation: the KV the decode replicas load from prefill replicas."""
    received, seconds = "tokenflow_kv_transfer_bytes", "tokenflow_kv_transfer_seconds"
    waiting = "tokenflow_num_requests_waiting_for_remote_kv"
    return [
        Panel("cluster", "KV transfer (bytes / s received)", (
            Query(rate(received, by="replica"), "{{replica}}"),), "Bps",
              "KV-cache bytes decode replicas load from prefill replicas."),
        Panel("cluster", "KV transfer bandwidth", (
            # clamp_min: no transfer in the window reads 0, not 0/0.
            Query(f"{rate(received)} / clamp_min({rate(seconds)}, 1e-9)", "while receiving"),),
              "Bps", "Bytes received per second spent receiving (0 while nothing moves)."),
        Panel("cluster", "KV transfer failures / s", (
            Query(rate("tokenflow_kv_transfer_failures", by="replica"), "{{replica}}"),),
              "short", "Loads that failed (dead producer, timeout, checksum): the decode "
              "replica computed those prompts itself."),
        Panel("cluster", "Requests waiting for remote KV", (
            Query(f"sum by (replica) ({metric(waiting)}{_TF})", "{{replica}}"),), "short",
              "Requests parked while their prompt's KV loads."),
    ]


PANELS: tuple[Panel, ...] = (*_overview(), *_engine(), *_cluster())

# name -> (uid, title); the uid is stable so that a push updates, never duplicates.
DASHBOARDS: dict[str, tuple[str, str]] = {
    "overview": ("tokenflow-overview", "tokenflow / Overview"),
    "engine": ("tokenflow-engine", "tokenflow / Engine"),
    "cluster": ("tokenflow-cluster", "tokenflow / Cluster"),
}
_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": _DATASOURCE,
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}


def _templating() -> dict[str, Any]:
    running = metric("tokenflow_num_requests_running")
    return {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0},
        _variable("application", "Application", f"label_values({running}, application)"),
        _variable("replica", "Replica",
                  f'label_values({running}{{application=~"$application"}}, replica)'),
    ]}


def _panel_json(panel: Panel, index: int) -> dict[str, Any]:
    width = 12
    return {
        "id": index + 1, "type": "timeseries", "title": panel.title,
        "description": panel.description, "datasource": _DATASOURCE,
        "gridPos": {"h": 8, "w": width, "x": (index % 2) * width, "y": (index // 2) * 8},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": _DATASOURCE, "expr": q.expr,
                     "legendFormat": q.legend or "__auto", "range": True}
                    for i, q in enumerate(panel.queries)],
    }


def dashboard(name: str) -> dict[str, Any]:
    """The Grafana JSON model of one dashboard (`overview`, `engine` or `cluster`)."""
    if name not in DASHBOARDS:
        raise ValueError(f"unknown dashboard {name!r}; valid: {', '.join(DASHBOARDS)}")
    uid, title = DASHBOARDS[name]
    panels = [p for p in PANELS if p.dashboard == name]
    return {
        "uid": uid, "title": title, "tags": ["tokenflow"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"}, "graphTooltip": 1,
        "templating": _templating(),
        "links": [{"type": "dashboards", "tags": ["tokenflow"], "asDropdown": False,
                   "title": "tokenflow", "includeVars": True, "keepTime": True}],
        "panels": [_panel_json(p, i) for i, p in enumerate(panels)],
    }


def dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard, by file name (`tokenflow-overview.json`, ...)."""
    return {f"{DASHBOARDS[name][0]}.json": dashboard(name) for name in DASHBOARDS}


def to_json(model: dict[str, Any]) -> str:
    """The one serialization used for files, the chart's ConfigMaps and comparisons."""
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


def render(directory: str | Path) -> list[Path]:
    """Write every dashboard's JSON into `directory` (created if missing); returns the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for file_name, model in dashboards().items():
        path = out / file_name
        path.write_text(to_json(model))
        paths.append(path)
    return paths


def expand(expr: str, interval: str = "1m", selected: str = ".*") -> str:
    """A panel's query as Grafana sends it, with every variable at `selected` (All)."""
    return (expr.replace("$__rate_interval", interval).replace("$application", selected)
            .replace("$replica", selected))
