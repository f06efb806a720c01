"""LLM-aware autoscaling: what each LLMServer replica reports, and the Serve policy that reads it.

Serve's default policy scales on ongoing requests per replica, a poor measure of an LLM
replica's load: a replica with 8 short chats is idle, one with 8 long prompts is saturated, and a
request the engine has not admitted yet (waiting for a batch slot or KV blocks) counts the same
as one it is decoding. Every LLMServer replica therefore reports, through Serve's
`record_autoscaling_stats` hook, the engine's own view (`replica_stats`): requests running,
requests waiting, KV-cache usage and the recent TTFT. `LLMAutoscalingPolicy`, a Serve class
policy (`autoscaling_config.policy`), turns them into a replica count each control-loop tick;
Serve's wrapper around every custom policy then applies min/max replicas and the upscale and
downscale delays (a decision must hold that long before it is carried out).

Up: any one signal over its target asks for more replicas (as many as the requests and KV blocks
need, or one more for a queue or a TTFT over its SLO). Down: only while nothing waits and TTFT
is under `downscale_headroom` times its SLO, and only to a count at which the requests and KV
blocks would stay under `downscale_headroom` times their targets. The gap between the two is what
keeps the count from flapping; `downscale_delay_s` is the quiet period.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

# The metric names a replica reports (Serve keys its aggregated metrics by them).
RUNNING = "tf_running"
WAITING = "tf_waiting"
KV_USAGE = "tf_kv_usage"
TTFT = "tf_recent_ttft_s"


class RecentTTFT:
    """Owns the TTFTs of the requests that got their first token in the last `window_s`
    seconds, and their 90th percentile (the SLO signal)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (when, ttft), oldest first

    def observe(self, ttft_s: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, ttft_s))

    def p90(self, now: float | None = None) -> float:
        """0 when no request got a first token within the window."""
        cutoff = (time.monotonic() if now is None else now) - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        if not self._samples:
            return 0.0
        ordered = sorted(ttft for _, ttft in self._samples)
        return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def replica_stats(running: int, waiting: int, kv_usage: float, ttft: RecentTTFT
                  ) -> dict[str, float]:
    """One replica's autoscaling report (what `LLMServer.record_autoscaling_stats` returns)."""
    return {RUNNING: float(running), WAITING: float(waiting), KV_USAGE: kv_usage,
            TTFT: ttft.p90()}


@dataclass(frozen=True)
class Signals:
    """The deployment's load as the policy sees it: totals over its replicas, KV usage as a
    mean, TTFT as the worst replica's."""

    running: float
    waiting: float
    kv_usage: float
    ttft_s: float


class LLMAutoscalingPolicy:
    """A Serve autoscaling policy on LLM signals. Serve builds it once per deployment with
    `policy_kwargs` and calls it every control-loop tick with an `AutoscalingContext`; it
    returns a (fractional) replica count, which Serve bounds and delays."""

    def __init__(self, target_ongoing_requests: float = 8.0, max_waiting_per_replica: float = 2.0,
                 target_kv_cache_usage: float = 0.8, ttft_slo_s: float | None = 2.0,
                 downscale_headroom: float = 0.6) -> None:
        if not 0 < downscale_headroom < 1:
            raise ValueError("downscale_headroom must be in (0, 1)")
        self.target_ongoing_requests = target_ongoing_requests
        self.max_waiting_per_replica = max_waiting_per_replica
        self.target_kv_cache_usage = target_kv_cache_usage
        self.ttft_slo_s = ttft_slo_s
        self.downscale_headroom = downscale_headroom

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        n = ctx.current_num_replicas
        if n == 0:  # Serve's wrapper scales up from zero itself, on the requests it holds
            return ctx.target_num_replicas, {}
        signals = self.signals(ctx.aggregated_metrics or {}, ctx.total_num_requests)
        return self.desired_replicas(n, signals), {}

    @staticmethod
    def signals(metrics: dict[str, dict[Any, float]], total_num_requests: float) -> Signals:
        """The deployment's signals from Serve's per-replica aggregates. Before any replica has
        reported (a new deployment), the requests Serve counts stand in for running ones."""
        running, waiting = metrics.get(RUNNING, {}), metrics.get(WAITING, {})
        kv, ttft = metrics.get(KV_USAGE, {}), metrics.get(TTFT, {})
        if not running:
            return Signals(float(total_num_requests), 0.0, 0.0, 0.0)
        return Signals(sum(running.values()), sum(waiting.values()),
                       sum(kv.values()) / len(kv) if kv else 0.0,
                       max(ttft.values(), default=0.0))

    def desired_replicas(self, n: int, s: Signals) -> float:
        """The replica count `s` asks for, with `n` replicas running now."""
        # How many replicas the load needs at its target exactly: requests and KV blocks
        # spread over the replicas.
        need = max((s.running + s.waiting) / self.target_ongoing_requests,
                   n * s.kv_usage / self.target_kv_cache_usage)
        # TTFT and a queue say "more", not how many (TTFT has a floor, the prefill itself,
        # that no replica count lowers): one more replica per decision.
        over_slo = self.ttft_slo_s is not None and s.ttft_s > self.ttft_slo_s
        if over_slo or s.waiting > self.max_waiting_per_replica * n:
            need = max(need, n + 1)
        if need > n:
            return float(math.ceil(need))
        # Down only while nothing waits and TTFT is well inside its SLO, and only as far as
        # every signal stays under the headroom: a count just at the target would be back over
        # it with the next burst. min_replicas (Serve's bound) decides whether an idle
        # deployment goes to zero.
        slack = self.ttft_slo_s is None or s.ttft_s <= self.downscale_headroom * self.ttft_slo_s
        if s.waiting > 0 or not slack:
            return float(n)
        return float(min(n, math.ceil(need / self.downscale_headroom - 1e-9)))
