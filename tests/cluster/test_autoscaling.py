"""LLM-aware autoscaling (`cluster.autoscaling`): the policy's decisions on given signals, what
Serve makes of the config, and a real Serve deployment scaled 1 -> 2 by a load ramp and back
to 1 when the load falls, with every request answered throughout."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import openai
import pytest

from tests.cluster.conftest import API_KEY, ENGINE_ARGS, SERVER_ACTOR_OPTIONS, App, Cluster, deploy
from tokenflow.cluster.autoscaling import (
    KV_USAGE,
    RUNNING,
    TTFT,
    WAITING,
    LLMAutoscalingPolicy,
    RecentTTFT,
    Signals,
)
from tokenflow.config import AutoscalingConfig

MODEL = "tokenflow-tiny"


def test_recent_ttft_is_the_90th_percentile_of_the_window() -> None:
    ttft = RecentTTFT(window_s=10)
    assert ttft.p90(now=0) == 0.0
    for i in range(10):
        ttft.observe(0.1 * (i + 1), now=i)
    assert ttft.p90(now=9) == pytest.approx(0.9)
    assert ttft.p90(now=15) == pytest.approx(1.0)  # the first five have left the window
    assert ttft.p90(now=30) == 0.0


POLICY = LLMAutoscalingPolicy(target_ongoing_requests=8, max_waiting_per_replica=2,
                              target_kv_cache_usage=0.8, ttft_slo_s=1.0, downscale_headroom=0.6)


@pytest.mark.parametrize("signals,wanted", [
    (Signals(running=8, waiting=0, kv_usage=0.3, ttft_s=0.2), 1),    # at the target: stay
    (Signals(running=8, waiting=8, kv_usage=0.3, ttft_s=0.2), 2),    # the queue
    (Signals(running=24, waiting=0, kv_usage=0.3, ttft_s=0.2), 3),   # ongoing requests
    (Signals(running=4, waiting=0, kv_usage=0.95, ttft_s=0.2), 2),   # KV pressure
    (Signals(running=4, waiting=0, kv_usage=0.3, ttft_s=1.5), 2),    # TTFT over its SLO
    (Signals(running=4, waiting=3, kv_usage=0.3, ttft_s=0.2), 2),    # a queue, however small
])
def test_any_signal_over_its_target_scales_up(signals: Signals, wanted: int) -> None:
    assert POLICY.desired_replicas(1, signals) == wanted


def test_scale_down_keeps_headroom_and_never_flaps() -> None:
    # 4 replicas, load for 1.4 at the target: down to 3, where every signal is under 0.6x.
    assert POLICY.desired_replicas(4, Signals(11, 0, 0.2, 0.1)) == 3
    assert POLICY.desired_replicas(3, Signals(11, 0, 0.2, 0.1)) == 3  # and it stays there
    # Between the headroom and the target nothing moves, in either direction.
    for running in (5, 6, 7, 8):
        assert POLICY.desired_replicas(1, Signals(running, 0, 0.3, 0.3)) == 1
    assert POLICY.desired_replicas(2, Signals(10, 0, 0.3, 0.3)) == 2
    # TTFT has a floor no replica count lowers: it blocks a scale-down only when it is near
    # its SLO, and over the SLO it asks for one more replica, not for ttft/slo times as many.
    assert POLICY.desired_replicas(2, Signals(1, 0, 0.1, 0.8)) == 2
    assert POLICY.desired_replicas(2, Signals(1, 0, 0.1, 0.5)) == 1
    assert POLICY.desired_replicas(1, Signals(1, 0, 0.1, 5.0)) == 2
    # Waiting requests never let a replica go; idle goes to Serve's min_replicas.
    assert POLICY.desired_replicas(2, Signals(1, 1, 0.1, 0.1)) == 2
    assert POLICY.desired_replicas(3, Signals(0, 0, 0.0, 0.0)) == 0


def test_signals_come_from_every_replicas_report() -> None:
    metrics = {RUNNING: {"a": 3.0, "b": 5.0}, WAITING: {"a": 1.0, "b": 0.0},
               KV_USAGE: {"a": 0.2, "b": 0.6}, TTFT: {"a": 0.5, "b": 1.5}}
    assert POLICY.signals(metrics, 99) == Signals(8.0, 1.0, 0.4, 1.5)
    # Before any replica reports, Serve's own count of requests stands in.
    assert POLICY.signals({}, 7) == Signals(7.0, 0.0, 0.0, 0.0)


def test_serve_takes_the_config_and_builds_the_policy_from_it() -> None:
    from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

    ours = AutoscalingConfig(max_replicas=4, ttft_slo_s=0.5, target_ongoing_requests=12)
    serve_config = ServeAutoscalingConfig(**ours.serve_options())
    assert serve_config.max_replicas == 4 and serve_config.look_back_period_s == 10
    policy_class = serve_config.policy.get_policy()
    policy = policy_class(**serve_config.policy.policy_kwargs)
    assert isinstance(policy, LLMAutoscalingPolicy)
    assert policy.ttft_slo_s == 0.5 and policy.target_ongoing_requests == 12
    # Serve's own policy when asked for: no policy of ours in the options.
    plain = AutoscalingConfig(policy="ongoing_requests").serve_options()
    assert "policy" not in plain
    assert ServeAutoscalingConfig(**plain).policy.is_default_policy_function()
    with pytest.raises(ValueError, match="look_back_period_s"):
        AutoscalingConfig(metrics_interval_s=5, look_back_period_s=5)


# ---------------------------------------------------------------------------- real Serve
APP = "autoscale"
MAX_NUM_SEQS = 4
REQUEST_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def autoscale_app(cluster: Cluster) -> Any:
    from ray import serve

    engine = {**ENGINE_ARGS, "scheduler": {**ENGINE_ARGS["scheduler"],
                                           "max_num_seqs": MAX_NUM_SEQS}}
    app = deploy(cluster, APP, "/autoscale", {
        "engine": engine, "api_key": API_KEY,
        "deployment": {
            "num_replicas": None, "ray_actor_options": SERVER_ACTOR_OPTIONS,
            "autoscaling_config": {
                "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                "policy": "llm", "target_ongoing_requests": MAX_NUM_SEQS,
                "max_waiting_per_replica": 1, "ttft_slo_s": None,
                "upscale_delay_s": 1, "downscale_delay_s": 4,
                "metrics_interval_s": 0.5, "look_back_period_s": 2}}})
    yield app
    serve.delete(APP)  # its replicas' CPUs go back to the rest of the suite


def _running_replicas() -> int:
    from ray import serve

    states = serve.status().applications[APP].deployments["LLMServer"].replica_states
    return states.get("RUNNING", 0)


class Load:
    """Runs `concurrency` streaming completions at a time, one after another, in a thread of
    its own, until stopped; keeps every failure and counts the successes."""

    def __init__(self, app: App, concurrency: int, max_tokens: int) -> None:
        self.app, self.concurrency, self.max_tokens = app, concurrency, max_tokens
        self.done = 0
        self.started = time.monotonic()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        # A late answer is no failure: on a busy machine a request queued behind a dozen others
        # waits minutes for its first byte. A hang is caught by stop() and the test's timeout.
        client = openai.AsyncOpenAI(base_url=f"{self.app.base_url}/v1", api_key=API_KEY,
                                    max_retries=0, timeout=REQUEST_TIMEOUT_S)
        await asyncio.gather(*(self._worker(client, w) for w in range(self.concurrency)))
        await client.close()

    async def _worker(self, client: openai.AsyncOpenAI, w: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                stream = await client.completions.create(
                    model=MODEL, prompt=f"user {w} request {i}", max_tokens=self.max_tokens,
                    temperature=0, stream=True, extra_body={"ignore_eos": True})
                tokens = 0
                async for chunk in stream:
                    tokens += bool(chunk.choices and chunk.choices[0].text)
                    if chunk.choices and chunk.choices[0].finish_reason:
                        assert chunk.choices[0].finish_reason == "length"
                self.done += 1
            except openai.APIStatusError as exc:
                # A streamed answer's body is not read: who answered is in its headers. A
                # text/plain 404 is a "Path not found" of HAProxy or of a Serve proxy (HAProxy's
                # fallback, when it holds our replica DOWN or a pin misses), not our app's.
                headers = {k: v for k, v in exc.response.headers.items()
                           if k in ("content-type", "server", "x-serve-reason")}
                self.failures.append(f"{type(exc).__name__}: {exc} {headers} "
                                     f"at +{time.monotonic() - self.started:.1f}s")
            except Exception as exc:  # noqa: BLE001 - every failure is the test's business
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=REQUEST_TIMEOUT_S + 30)
        assert not self._thread.is_alive(), "the load did not finish"


def _wait_for(what: str, predicate: Any, load: Load, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert not load.failures, load.failures[:3]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a replica start and two load phases, on a machine maybe busy
def test_a_load_ramp_scales_up_and_quiet_scales_back_down(autoscale_app: App) -> None:
    assert _running_replicas() == 1
    report = autoscale_app.server.record_autoscaling_stats.remote().result(timeout_s=30)
    assert set(report) == {RUNNING, WAITING, KV_USAGE, TTFT}  # what the policy reads
    # Four times what one replica runs at once: requests wait, the policy asks for 2.
    ramp = Load(autoscale_app, concurrency=4 * MAX_NUM_SEQS, max_tokens=32)
    try:
        _wait_for("a second replica", lambda: _running_replicas() == 2, ramp)
        served_before = ramp.done
        _wait_for("requests served by 2 replicas", lambda: ramp.done >= served_before + 16,
                  ramp)
    finally:
        ramp.stop()
    assert not ramp.failures, ramp.failures[:3]
    # A trickle (one request at a time) is well under the headroom: back to 1, and the
    # trickle's requests all succeed while the second replica drains and stops.
    trickle = Load(autoscale_app, concurrency=1, max_tokens=16)
    try:
        _wait_for("one replica again", lambda: _running_replicas() == 1, trickle)
        served_before = trickle.done
        _wait_for("requests after the scale-down", lambda: trickle.done >= served_before + 3,
                  trickle)
    finally:
        trickle.stop()
    assert not trickle.failures, trickle.failures[:3]
    assert ramp.done > 0 and trickle.done > 0
