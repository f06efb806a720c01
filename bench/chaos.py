"""Chaos: what clients see while parts of the cluster die under load, in every serving mode.

For each serving mode (a fresh Ray cluster each, in a subprocess of this script) and each
scenario, an app is deployed, a clean pass records every greedy request's text, and then
`--minutes` of mixed load (completions and chat, streamed and not, greedy and seeded, at most
`--concurrency` in flight, `ignore_eos` so every length is known) runs while a scheduler kills,
at seeded random intervals (each after the app has recovered from the last one, or given up
waiting):

    replicas  an LLMServer's engine process (SIGKILL), a whole replica (`ray.kill`), and
              in `haproxy` mode HAProxy's TCP connections to one replica (`ss -K`)
    pp2       configs/pp2.yaml's shape (2 pipeline stages per replica): a stage actor
    pd        configs/pd.yaml's shape (prefill/decode disaggregation, one prefill replica):
              the prefill replica
    overload  no kills: each replica bounded (`max_num_seqs` 16 running, `max_queued_requests`
              16 waiting) and twice what all replicas may hold in flight, half the streams
              abandoned by the client after their first chunk; what is refused must be a 503
              with `Retry-After`, and nothing may stay behind (blocks, requests)

Each app has `--replicas` (2) LLMServer replicas (with pd: decode replicas), so that one
survives each kill; the model is the embedded tokenflow-tiny, fast on a CPU.

Every request is counted once: `ok` (200, exactly max_tokens tokens, finish_reason length, a
stream ended by `[DONE]`; a greedy one with the clean pass's text), `clean_error` (a 4xx/5xx
status, or a stream ending in an SSE error event), `conn_error` (the connection failed before
any response byte), `lost` (hung past `--request-timeout`, dropped mid-body without an error
event, truncated), `wrong` (complete, but greedy text that differs from the clean pass) or
`abandoned` (the client closed the stream itself: the overload scenario).
Where the product shows it: requests resumed on another replica (the proxy_ingress modes log
each resume with the request's id) and HAProxy's retries and redispatches (its stats socket;
counters restart when HAProxy reloads, so these are lower bounds). After the load, every
replica must go idle: running, waiting and KV usage 0 (else a leak). Prints progress every
10 s and a table; writes JSON only where `--output` says.

    python bench/chaos.py                                       # 4 modes x 4 scenarios, 1 min
    python bench/chaos.py --modes haproxy,proxy_ingress --scenarios replicas --minutes 0.5 \\
        --concurrency 8 --output /tmp/chaos.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import csv
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Before anything imports ray: a single-node cluster on loopback addresses only.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import httpx  # noqa: E402
import psutil  # noqa: E402

from bench.serve_overhead import wait_until_200  # noqa: E402

MODES = ("haproxy", "proxy", "proxy_ingress", "proxy_ingress_grpc")
SCENARIOS = ("replicas", "pp2", "pd", "overload")
# What each scenario kills; `conns` only where HAProxy is in the path.
KINDS = {"replicas": ("engine", "replica", "conns"), "pp2": ("stage",), "pd": ("prefill",),
         "overload": ()}
OUTCOMES = ("ok", "clean_error", "conn_error", "lost", "wrong", "abandoned")
# The overload scenario's bound per replica (running + waiting) and its share of abandoned
# streams.
OVERLOAD_RUNNING, OVERLOAD_QUEUED, ABANDON_SHARE = 16, 16, 0.5
ENDPOINTS = ("completions", "chat")
NUM_PROMPTS = 16
MAX_TOKENS = (32, 64, 96, 128)  # by prompt index: lengths of every size in the mix
TOPICS = ("the sea", "a paged KV cache", "trains", "prime numbers", "the moon", "bread",
          "a scheduler", "rivers")
PROGRESS_EVERY_S = 10.0
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ workload
@dataclass(frozen=True)
class Spec:
    """One kind of request: the same spec always sends the same body."""

    endpoint: str
    stream: bool
    greedy: bool
    prompt: int  # index into the prompt pool

    @property
    def max_tokens(self) -> int:
        return MAX_TOKENS[self.prompt % len(MAX_TOKENS)]

    @property
    def label(self) -> str:
        return (f"{self.endpoint}/{'stream' if self.stream else 'plain'}/"
                f"{'greedy' if self.greedy else 'seeded'}/p{self.prompt}")


def all_specs() -> list[Spec]:
    return [Spec(e, s, g, p) for e in ENDPOINTS for s in (True, False) for g in (True, False)
            for p in range(NUM_PROMPTS)]


def prompt_text(i: int) -> str:
    return f"Request {i}: write a few sentences about {TOPICS[i % len(TOPICS)]}."


def request_body(spec: Spec, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "ignore_eos": True,
                            "temperature": 0.0 if spec.greedy else 1.0,
                            "stream": spec.stream}
    if not spec.greedy:
        body["seed"] = 1000 + spec.prompt
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt_text(spec.prompt)}]
    else:
        body["prompt"] = prompt_text(spec.prompt)
    return body


@dataclass
class Result:
    """How one request ended. `reason` says why, in a few words (the counts group by it)."""

    spec: Spec
    outcome: str
    reason: str
    start_s: float  # since the load began
    latency_s: float
    status: int | None = None
    response_id: str | None = None
    text: str | None = None
    message: str = ""  # what an error said
    resumed: bool = False


@dataclass
class _Reply:
    """What came back, before it is judged."""

    status: int | None = None  # set once the status line arrived
    body: str = ""
    text: str = ""
    response_id: str | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False  # a stream's [DONE]
    abandoned: bool = False  # the client closed the stream after its first chunk
    retry_after: str | None = None  # the Retry-After header of a refusal
    error: str | None = None  # a stream's error event: its type
    message: str = ""  # what an error said (evidence for the JSON)


async def _read_plain(response: httpx.Response, reply: _Reply) -> None:
    reply.body = (await response.aread()).decode(errors="replace")
    if response.status_code != 200:
        return
    data = json.loads(reply.body)
    choice = data["choices"][0]
    reply.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
    reply.response_id = data.get("id")
    reply.finish_reason = choice.get("finish_reason")
    reply.completion_tokens = (data.get("usage") or {}).get("completion_tokens")
    reply.done = True


async def _read_stream(response: httpx.Response, reply: _Reply, abandon: bool = False) -> None:
    """Read a stream to its end (or, with `abandon`, only to its first chunk: the caller then
    closes the connection, as a client that gave up does)."""
    if response.status_code != 200:
        reply.body = (await response.aread()).decode(errors="replace")
        return
    parts: list[str] = []
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            reply.done = True
            break
        event = json.loads(payload)
        if "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {}
            reply.error = str(error.get("type") or event["error"])
            reply.message = str(error.get("message") or event["error"])[:300]
            continue
        reply.response_id = reply.response_id or event.get("id")
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            parts.append(choice.get("text") or delta.get("content") or "")
            reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
        if event.get("usage"):
            reply.completion_tokens = event["usage"].get("completion_tokens")
        if abandon and parts:
            reply.abandoned = True
            break
    reply.text = "".join(parts)


def judge(spec: Spec, reply: _Reply, expected: str | None) -> tuple[str, str]:
    """(outcome, reason) of a reply that arrived without a transport error."""
    if reply.status != 200:
        kind = "OpenAI JSON" if '"error"' in reply.body else ("empty" if not reply.body
                                                             else "other body")
        if reply.status in (429, 503):
            kind += ", Retry-After" if reply.retry_after else ", no Retry-After"
        reply.message = reply.body[:300]
        return "clean_error", f"status {reply.status} ({kind})"
    if reply.abandoned:
        return "abandoned", "closed by the client after its first chunk"
    if reply.error is not None:
        return "clean_error", f"stream error event ({reply.error})"
    if not reply.done:
        return "lost", "stream closed without [DONE] or error"
    if reply.completion_tokens != spec.max_tokens or reply.finish_reason != "length":
        return "lost", (f"truncated: {reply.completion_tokens}/{spec.max_tokens} tokens, "
                        f"finish {reply.finish_reason}")
    if spec.greedy and expected is not None and reply.text != expected:
        return "wrong", "greedy text differs from the clean pass"
    return "ok", "ok"


async def send(client: httpx.AsyncClient, base_url: str, spec: Spec, model: str,
               expected: str | None, timeout_s: float, t0: float, abandon: bool = False
               ) -> Result:
    """One request, judged. Never raises (but for cancellation), never outlives `timeout_s`.
    `abandon`: a stream is closed by us after its first chunk."""
    path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    reply = _Reply()
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", base_url + path,
                                     json=request_body(spec, model)) as response:
                reply.status = response.status_code
                reply.retry_after = response.headers.get("retry-after")
                if spec.stream:
                    await _read_stream(response, reply, abandon)
                else:
                    await _read_plain(response, reply)
        outcome, reason = judge(spec, reply, expected)
    except TimeoutError:
        outcome, reason = "lost", f"hung: no end in {timeout_s:g} s"
    except httpx.TimeoutException as exc:
        outcome, reason = "lost", f"hung: {type(exc).__name__}"
    except httpx.TransportError as exc:
        # Before the status line the client knows it got nothing; after it, a body cut off
        # without an error event is indistinguishable from a complete one to a naive client.
        outcome, reason = (("conn_error", type(exc).__name__) if reply.status is None
                           else ("lost", f"dropped mid-body ({type(exc).__name__})"))
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        outcome, reason = "lost", f"garbled body ({type(exc).__name__})"
    return Result(spec, outcome, reason, start - t0, time.monotonic() - start, reply.status,
                  reply.response_id, reply.text if reply.done else None, reply.message)


def http_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    # A read timeout shorter than the whole request's: a stream silent that long is hung.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0, read=min(60.0, timeout_s)),
        limits=httpx.Limits(max_connections=concurrency + 8,
                            max_keepalive_connections=concurrency + 8))


async def clean_pass(base_url: str, model: str, concurrency: int, timeout_s: float
                     ) -> tuple[dict[Spec, str], list[Result]]:
    """Every spec once, before any kill: the texts the chaos pass is checked against."""
    specs = all_specs()
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    results: list[Result] = []
    t0 = time.monotonic()
    async with http_client(concurrency, timeout_s) as client:
        async def worker() -> None:
            while not queue.empty():
                results.append(await send(client, base_url, queue.get_nowait(), model, None,
                                          timeout_s, t0))

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    return {r.spec: r.text for r in results if r.outcome == "ok" and r.text is not None}, results


# ------------------------------------------------------------------- the cluster's parts
@dataclass(frozen=True)
class AppUnderTest:
    """One deployed app and what the killers need to find its parts."""

    name: str
    mode: str
    base_url: str
    replicas: dict[str, int]  # deployment -> replicas it should have
    env: dict[str, str]  # the cluster's env (apply_cluster_env): HAProxy's files and ports
    concurrency: int  # the load's requests in flight
    abandon_share: float = 0.0  # of streams, closed by the client after their first chunk


def own_processes() -> list[psutil.Process]:
    """This process's descendants: the Ray cluster it started, and nothing else's."""
    return psutil.Process().children(recursive=True)


def replica_actors(app: str, deployment: str) -> dict[str, Any]:
    """actor name -> handle of each live replica of `deployment` in `app`."""
    import ray

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if f"{app}#{deployment}#" in entry["name"]:
            with contextlib.suppress(ValueError):  # it died since the listing
                out[entry["name"]] = ray.get_actor(entry["name"], namespace=entry["namespace"])
    return out


def stage_actors() -> dict[str, Any]:
    import ray

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith("tokenflow-stage"):
            with contextlib.suppress(ValueError):
                out[entry["name"]] = ray.get_actor(entry["name"], namespace=entry["namespace"])
    return out


def replica_stats(actor: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    """`LLMServer.stats()` of this very replica: Serve's replica actor calls the user's
    `record_routing_stats`, which LLMServer answers with `stats()` (a handle would reach a
    replica of the router's choice)."""
    import ray

    return ray.get(actor.record_routing_stats.remote(), timeout=timeout_s)


def replicas_whole(app: AppUnderTest, deployment: str) -> bool:
    """The deployment has its full count of replica actors and every one answers stats()
    (a replica still starting raises)."""
    live = replica_actors(app.name, deployment)
    if len(live) < app.replicas[deployment]:
        return False
    for actor in live.values():
        replica_stats(actor, timeout_s=5.0)
    return True


def app_healthy(app: AppUnderTest) -> bool:
    """Serve says every deployment of the app is HEALTHY at its full replica count."""
    from ray import serve

    status = serve.status().applications.get(app.name)
    if status is None or status.status != "RUNNING":  # str enums
        return False
    for name, wanted in app.replicas.items():
        deployment = status.deployments.get(name)
        if (deployment is None or deployment.status != "HEALTHY"
                or deployment.replica_states.get("RUNNING", 0) != wanted):
            return False
    return True


# ------------------------------------------------------------------------------- killers
class SkipKill(Exception):
    """Nothing to kill of this kind right now (said why)."""


@dataclass
class Kill:
    """One kill: when, what, and how long until the app was whole again (None: not within
    the recovery timeout)."""

    at_s: float
    kind: str
    target: str
    detail: str = ""
    recovered_s: float | None = None
    settled: Callable[[], bool] | None = field(default=None, repr=False)

    def record(self) -> dict[str, Any]:
        return {"at_s": round(self.at_s, 2), "kind": self.kind, "target": self.target,
                "detail": self.detail, "recovered_s": self.recovered_s}


def _pick(rng: random.Random, actors: dict[str, Any], what: str) -> tuple[str, Any]:
    if not actors:
        raise SkipKill(f"no live {what}")
    name = rng.choice(sorted(actors))
    return name, actors[name]


def kill_engine(app: AppUnderTest, rng: random.Random) -> Kill:
    """SIGKILL one replica's engine process (its pid from that replica's stats())."""
    name, actor = _pick(rng, replica_actors(app.name, "LLMServer"), "LLMServer replica")
    pid = replica_stats(actor).get("engine_pid")
    if pid is None:
        raise SkipKill(f"{name} runs its engine in a thread (no engine_pid)")
    process = psutil.Process(pid)
    # The engine process is a child of the replica process, both descendants of this one: a
    # pid the OS reused since stats() would fail this check.
    if process not in own_processes() or "ServeReplica:" not in " ".join(
            process.parent().cmdline()):
        raise SkipKill(f"pid {pid} is not a replica's engine process of this cluster")
    process.kill()

    def settled() -> bool:
        live = replica_actors(app.name, "LLMServer")
        if name not in live:  # Serve replaced the replica
            return replicas_whole(app, "LLMServer")
        new_pid = replica_stats(live[name]).get("engine_pid")  # or it restarted its engine
        return new_pid not in (None, pid) and psutil.pid_exists(new_pid)

    return Kill(0, "engine", name.rsplit("#", 1)[-1], f"pid {pid}", settled=settled)


def _kill_actor(kind: str, name: str, actor: Any, is_gone: Callable[[], bool]) -> Kill:
    import ray

    ray.kill(actor, no_restart=True)
    return Kill(0, kind, name.rsplit("#", 1)[-1], "ray.kill", settled=is_gone)


def kill_replica(app: AppUnderTest, rng: random.Random) -> Kill:
    """`ray.kill` one LLMServer replica actor (Serve starts a new one)."""
    return _kill_replica_of(app, "LLMServer", "replica", rng)


def _kill_replica_of(app: AppUnderTest, deployment: str, kind: str, rng: random.Random
                     ) -> Kill:
    name, actor = _pick(rng, replica_actors(app.name, deployment), f"{deployment} replica")

    def settled() -> bool:
        # Its name goes at once; Serve's status lags until the controller notices: whole
        # again once a new replica has taken its place and answers.
        return (name not in replica_actors(app.name, deployment)
                and replicas_whole(app, deployment))

    return _kill_actor(kind, name, actor, settled)


def kill_prefill(app: AppUnderTest, rng: random.Random) -> Kill:
    """`ray.kill` one PrefillServer replica actor (decode replicas fall back meanwhile)."""
    return _kill_replica_of(app, "PrefillServer", "prefill", rng)


def kill_stage(app: AppUnderTest, rng: random.Random) -> Kill:
    """`ray.kill` one pipeline stage actor; its replica builds its stages again and goes on
    (or, a second death within a minute of a rebuild, fails and Serve replaces it): either
    way new stages, and the settled check wants every replica's full set back."""
    name, actor = _pick(rng, stage_actors(), "stage actor")
    wanted = 2 * app.replicas["LLMServer"]

    def settled() -> bool:
        live = stage_actors()
        return name not in live and len(live) >= wanted and replicas_whole(app, "LLMServer")

    return _kill_actor("stage", name, actor, settled)


def _listening_ports(process: psutil.Process) -> set[int]:
    with contextlib.suppress(psutil.Error):
        return {c.laddr.port for c in process.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN}
    return set()


def haproxy_processes(app: AppUnderTest) -> list[psutil.Process]:
    """This cluster's HAProxy: the one whose command line names the cluster's own files."""
    base = app.env.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE")
    if not base:
        return []
    found = []
    for process in own_processes():
        with contextlib.suppress(psutil.Error):
            if any(arg.startswith(base + os.sep) for arg in process.cmdline()):
                found.append(process)
    return found


def kill_conns(app: AppUnderTest, rng: random.Random) -> Kill:
    """Abort every TCP connection between HAProxy and one LLMServer replica's HTTP port
    (`ss -K` on each exact 4-tuple, so nothing else on the machine is touched)."""
    block = range(int(app.env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]),
                  int(app.env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]))
    marker = f"ServeReplica:{app.name}:LLMServer"
    replica_ports = sorted(
        port for p in own_processes() if marker in " ".join(_safe_cmdline(p))
        for port in _listening_ports(p) if port in block)
    if not replica_ports:
        raise SkipKill("no replica HTTP port found")
    port = rng.choice(replica_ports)
    pairs = []
    for process in haproxy_processes(app):
        with contextlib.suppress(psutil.Error):
            pairs += [(c.laddr.port, c.raddr.port) for c in process.net_connections(kind="tcp")
                      if c.raddr and c.raddr.port == port
                      and c.status == psutil.CONN_ESTABLISHED]
    killed = 0
    for local, remote in pairs:
        done = subprocess.run(["ss", "-K", "-tn", "src", f"127.0.0.1:{local}",
                               "dst", f"127.0.0.1:{remote}"],
                              capture_output=True, text=True, timeout=10)
        killed += sum(line.startswith("ESTAB") for line in done.stdout.splitlines())
    return Kill(0, "conns", f"port {port}", f"{killed} of {len(pairs)} connections aborted",
                settled=lambda: True)


def _safe_cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return process.cmdline()
    return []


KILLERS: dict[str, Callable[[AppUnderTest, random.Random], Kill]] = {
    "engine": kill_engine, "replica": kill_replica, "conns": kill_conns,
    "stage": kill_stage, "prefill": kill_prefill}


def ss_kill_works() -> str | None:
    """None if `ss -K` aborts a loopback connection here (it needs root and a kernel with
    CONFIG_INET_DIAG_DESTROY); else why not."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            with accepted:
                try:
                    done = subprocess.run(["ss", "-K", "-tn", "dst", f"127.0.0.1:{port}"],
                                          capture_output=True, text=True, timeout=10)
                except (OSError, subprocess.TimeoutExpired) as exc:
                    return f"ss -K: {exc}"
                try:
                    client.settimeout(2)
                    client.sendall(b"x")
                    client.recv(1)
                except OSError:
                    return None  # aborted: ECONNABORTED / ECONNRESET
                return f"ss -K left the connection open ({done.stderr.strip()[:200]})"


# ---------------------------------------------------------------- side channels: logs, stats
class HAProxyCounters:
    """Retries, redispatches and connection/response errors summed over HAProxy's backends,
    from its stats socket. A reload (Serve rewrites the config when replicas change) starts
    a new process whose counters start at 0: a counter that went down restarted, and its new
    value is all new. What happened between the last poll and a reload is missed."""

    FIELDS = ("wretr", "wredis", "econ", "eresp")

    def __init__(self, sock_path: str | None) -> None:
        self.sock_path = sock_path
        self.totals = dict.fromkeys(self.FIELDS, 0)
        self._last: dict[tuple[str, str, str], int] = {}

    def poll(self) -> None:
        if not self.sock_path:
            return
        # Serve puts the socket in a directory per node beside the configured path.
        d, f = os.path.split(self.sock_path)
        rows = [(sock, row)
                for sock in sorted({self.sock_path, *map(str, Path(d).glob(f"*/{f}"))})
                for row in _haproxy_stat(sock)]
        for sock, row in rows:
            if row.get("svname") != "BACKEND":
                continue
            for name in self.FIELDS:
                value = int(row.get(name) or 0)
                key = (sock, row.get("pxname", ""), name)
                last = self._last.get(key, 0)
                self.totals[name] += value - last if value >= last else value
                self._last[key] = value


def _haproxy_stat(sock_path: str) -> list[dict[str, str]]:
    try:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(2)
            conn.connect(sock_path)
            conn.sendall(b"show stat\n")
            data = b"".join(iter(lambda: conn.recv(65536), b""))
    except OSError:
        return []
    lines = data.decode(errors="replace").lstrip("# ").splitlines()
    return list(csv.DictReader(lines)) if lines else []


class LogTail:
    """New lines of the cluster's log files since `mark()`: where the ingress says which
    request it resumed ("request <id> lost its replica ... resuming")."""

    RESUME = re.compile(r"request (\S+) lost its replica \((\w+)\) after (\d+) tokens")

    def __init__(self) -> None:
        import ray

        try:  # private, but the only way to the in-process cluster's session directory
            self.dir: Path | None = Path(ray._private.worker._global_node.get_logs_dir_path())
        except Exception:
            self.dir = None
        self._offsets: dict[Path, int] = {}

    def mark(self) -> None:
        self._offsets = {p: p.stat().st_size for p in self._files()}

    def resumed_ids(self) -> set[str]:
        ids = set()
        for path in self._files():
            with contextlib.suppress(OSError), path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                for line in f.read().decode(errors="replace").splitlines():
                    if (match := self.RESUME.search(line)) is not None:
                        ids.add(match.group(1))
        return ids

    def _files(self) -> list[Path]:
        if self.dir is None:
            return []
        return [p for p in self.dir.rglob("*") if p.is_file() and p.suffix in (".err", ".out",
                                                                               ".log")]


# ------------------------------------------------------------------------------ scenarios
def engine_args(model: str) -> dict[str, Any]:
    # Small and fast (tests/cluster/conftest.py's shape): room for 64 running per replica.
    return {"model": {"model": model, "num_threads": 1},
            "cache": {"block_size": 16, "num_blocks": 512},
            "scheduler": {"max_model_len": 512, "max_num_seqs": 64,
                          "max_num_batched_tokens": 2048}}


def app_args(scenario: str, mode: str, model: str, replicas: int) -> dict[str, Any]:
    """The AppConfig of a scenario (fractional CPUs: the machine may have 2 cores)."""
    deployment = {"num_replicas": replicas, "ray_actor_options": {"num_cpus": 0.5}}
    engine = engine_args(model)
    if scenario == "pp2":  # configs/pp2.yaml: the replica reserves nothing, its stages do
        engine["parallel"] = {"pipeline_parallel_size": 2, "stage_num_cpus": 0.5,
                              "placement_strategy": "PACK"}
        deployment["ray_actor_options"] = {"num_cpus": 0}
    if scenario == "overload":  # a small bound, so that twice it stays cheap
        engine["scheduler"] = {**engine["scheduler"], "max_num_seqs": OVERLOAD_RUNNING}
        deployment["max_queued_requests"] = OVERLOAD_QUEUED
    args: dict[str, Any] = {"engine": engine, "deployment": deployment, "serving_mode": mode}
    if scenario == "pd":  # configs/pd.yaml: one prefill replica, torch_p2p (gloo)
        args["engine"] = {**engine, "kv_transfer": {"connector": "torch_p2p",
                                                    "role": "consumer"}}
        args["prefill"] = {
            "engine": {**engine, "kv_transfer": {"connector": "torch_p2p", "role": "producer",
                                                 "lease_s": 10}},
            "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}}
    return args


def deploy(scenario: str, mode: str, args: argparse.Namespace, base_url: str,
           env: dict[str, str]) -> AppUnderTest:
    from ray import serve

    from tokenflow.cluster.app import build_app

    name = f"chaos-{scenario}"
    serve.run(build_app(app_args(scenario, mode, args.model, args.replicas)), name=name,
              route_prefix="/")
    # `serve.run` returns when the app is RUNNING; HAProxy learns its routes a moment later.
    wait_until_200(f"{base_url}/health", None, base_url, "the Serve logs", 180, poll_s=0.5)
    replicas = {"LLMServer": args.replicas}
    if scenario == "pd":
        replicas["PrefillServer"] = 1
    if scenario == "overload":  # twice what the replicas may hold
        return AppUnderTest(name, mode, base_url, replicas, env,
                            2 * args.replicas * (OVERLOAD_RUNNING + OVERLOAD_QUEUED),
                            ABANDON_SHARE)
    return AppUnderTest(name, mode, base_url, replicas, env, args.concurrency)


@dataclass
class Tally:
    """What the load saw so far (the progress line and the final counts)."""

    results: list[Result] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    in_flight: int = 0

    def counts(self) -> dict[str, int]:
        c = collections.Counter(r.outcome for r in self.results)
        return {o: c.get(o, 0) for o in OUTCOMES}

    def kills_by_kind(self) -> dict[str, int]:
        return dict(collections.Counter(k.kind for k in self.kills))

    def line(self, elapsed_s: float) -> str:
        counts = ", ".join(f"{o} {n}" for o, n in self.counts().items())
        kills = ", ".join(f"{k} {n}" for k, n in self.kills_by_kind().items()) or "none"
        return (f"{elapsed_s:5.0f}s: {len(self.results)} done ({counts}); "
                f"{self.in_flight} in flight; kills: {kills}")


async def load(app: AppUnderTest, args: argparse.Namespace, expected: dict[Spec, str],
               tally: Tally, stop: asyncio.Event, t0: float) -> None:
    """`app.concurrency` clients, each sending seeded random specs back to back until `stop`
    (abandoning `app.abandon_share` of its streams after their first chunk)."""
    specs = all_specs()
    async with http_client(app.concurrency, args.request_timeout) as client:
        async def client_loop(i: int) -> None:
            rng = random.Random(args.seed * 1_000 + i)
            while not stop.is_set():
                spec = rng.choice(specs)
                abandon = spec.stream and rng.random() < app.abandon_share
                tally.in_flight += 1
                try:
                    tally.results.append(await send(client, app.base_url, spec, args.model,
                                                    expected.get(spec), args.request_timeout,
                                                    t0, abandon))
                finally:
                    tally.in_flight -= 1

        await asyncio.gather(*(client_loop(i) for i in range(app.concurrency)))


async def wait_recovered(app: AppUnderTest, kill: Kill | None, timeout_s: float
                         ) -> float | None:
    """Seconds until the killed part is gone or replaced and Serve reports the app whole;
    None if not within `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            # Serve's status first: cheap, and it keeps stats() calls off starting replicas.
            whole = await asyncio.to_thread(
                lambda: app_healthy(app)
                and (kill is None or kill.settled is None or kill.settled()))
        except Exception:  # a replica died under the check itself: not yet
            whole = False
        if whole:
            return round(time.monotonic() - start, 2)
        await asyncio.sleep(0.5)
    return None


async def chaos(label: str, app: AppUnderTest, kinds: list[str], args: argparse.Namespace,
                tally: Tally, stop: asyncio.Event, t0: float, skipped: dict[str, str]) -> None:
    """Kill, wait for the app to recover (bounded), wait a random interval, kill the next
    kind (round robin over a seeded shuffle, so each kind gets its share)."""
    rng = random.Random(args.seed)
    low, high = args.kill_interval
    order = list(kinds)
    rng.shuffle(order)
    i = 0
    while order:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(low, high))
        if stop.is_set():
            return
        kind = order[i % len(order)]
        i += 1
        at = time.monotonic() - t0
        try:
            kill = await asyncio.to_thread(KILLERS[kind], app, rng)
        except SkipKill as exc:
            print(f"  [{label}] {at:5.1f}s: no {kind} kill: {exc}", flush=True)
            skipped[kind] = str(exc)
            continue
        except Exception as exc:  # a target that died meanwhile, a Ray hiccup: try again later
            print(f"  [{label}] {at:5.1f}s: {kind} kill failed: {type(exc).__name__}: {exc}",
                  flush=True)
            skipped[kind] = f"{type(exc).__name__}: {exc}"
            continue
        kill.at_s = at
        tally.kills.append(kill)
        print(f"  [{label}] {at:5.1f}s: killed {kind} {kill.target} ({kill.detail})",
              flush=True)
        kill.recovered_s = await wait_recovered(app, kill, args.recovery_timeout)
        print(f"  [{label}] {time.monotonic() - t0:5.1f}s: "
              + (f"not whole {args.recovery_timeout:g} s after the {kind} kill"
                 if kill.recovered_s is None
                 else f"whole again {kill.recovered_s:.1f} s after the {kind} kill"),
              flush=True)


async def progress(label: str, tally: Tally, stop: asyncio.Event, t0: float,
                   counters: HAProxyCounters) -> None:
    last_print = time.monotonic()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        await asyncio.to_thread(counters.poll)
        if time.monotonic() - last_print >= PROGRESS_EVERY_S:
            last_print = time.monotonic()
            print(f"  [{label}] {tally.line(last_print - t0)}", flush=True)


def idle_check(app: AppUnderTest, timeout_s: float) -> dict[str, Any]:
    """Every replica's running, waiting and KV usage, once all are 0 or after `timeout_s`
    (a KV-transfer lease may hold blocks a few seconds): anything left is a leak."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows, errors = [], []
        for deployment in app.replicas:
            for name, actor in sorted(replica_actors(app.name, deployment).items()):
                try:
                    s = replica_stats(actor)
                except Exception as exc:
                    errors.append(f"{name}: {type(exc).__name__}")
                    continue
                rows.append({"deployment": deployment, "replica": name.rsplit("#", 1)[-1],
                             **{k: s.get(k) for k in ("running", "waiting", "kv_usage",
                                                      "waiting_for_remote_kv", "requests",
                                                      "prefill_fallbacks")}})
        busy = [r for r in rows if r["running"] or r["waiting"] or r["kv_usage"]]
        if (not busy and not errors) or time.monotonic() > deadline:
            return {"replicas": rows, "errors": errors, "leaked": bool(busy),
                    "max_running": max((r["running"] for r in rows), default=0),
                    "max_waiting": max((r["waiting"] for r in rows), default=0),
                    "max_kv_usage": max((r["kv_usage"] for r in rows), default=0.0)}
        time.sleep(1.0)


def longest_stall(results: list[Result], duration_s: float) -> float:
    """The longest stretch of the load in which no request ended (ok or not): an outage
    every client waited through."""
    ends = sorted(min(r.start_s + r.latency_s, duration_s) for r in results)
    edges = [0.0, *ends, duration_s]
    return round(max(b - a for a, b in zip(edges, edges[1:], strict=False)), 1)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _kill_during(result: Result, kills: list[Kill], slack_s: float = 1.0) -> str:
    """The kinds of kill whose outage (from the kill until the app was whole again, the rest
    of the run if never) overlapped the request's time in flight, `slack_s` either side:
    what most likely failed it; "no kill" for a failure with no outage around it."""
    end = result.start_s + result.latency_s

    def overlaps(k: Kill) -> bool:
        outage_end = float("inf") if k.recovered_s is None else k.at_s + k.recovered_s
        return k.at_s <= end + slack_s and outage_end >= result.start_s - slack_s

    return "+".join(sorted({k.kind for k in kills if overlaps(k)})) or "no kill"


def summarize(mode: str, scenario: str, tally: Tally, clean: list[Result],
              expected: dict[Spec, str], resumed_ids: set[str], counters: HAProxyCounters,
              idle: dict[str, Any], skipped: dict[str, str], duration_s: float
              ) -> dict[str, Any]:
    for r in tally.results:
        r.resumed = r.response_id is not None and any(i.startswith(r.response_id)
                                                      for i in resumed_ids)
    reasons: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in tally.results:
        reasons[r.outcome][r.reason] += 1
    clean_texts = {r.spec: r.text for r in clean if r.outcome == "ok"}
    # Greedy text must not depend on streaming: the clean pass compares the two.
    stream_vs_plain = sum(
        1 for s, text in clean_texts.items()
        if s.greedy and s.stream and clean_texts.get(Spec(s.endpoint, False, True, s.prompt))
        not in (None, text))
    # Seeded sampling reproduces an uninterrupted run; a resumed one need not (information).
    seeded_differs = sum(1 for r in tally.results if r.outcome == "ok" and not r.spec.greedy
                         and clean_texts.get(r.spec) not in (None, r.text))
    by_kill = collections.Counter(_kill_during(r, tally.kills) for r in tally.results
                                  if r.outcome not in ("ok", "abandoned"))
    recovered = [k.recovered_s for k in tally.kills if k.recovered_s is not None]
    ok_latency = [r.latency_s for r in tally.results if r.outcome == "ok"]
    failures = [{"spec": r.spec.label, "outcome": r.outcome, "reason": r.reason,
                 "start_s": round(r.start_s, 2), "latency_s": round(r.latency_s, 2),
                 "status": r.status, "id": r.response_id, "message": r.message,
                 "during": _kill_during(r, tally.kills)}
                for r in tally.results if r.outcome not in ("ok", "abandoned")]
    return {
        "mode": mode, "scenario": scenario, "duration_s": round(duration_s, 1),
        "requests": len(tally.results), "counts": tally.counts(),
        "reasons": {o: dict(c.most_common()) for o, c in reasons.items()},
        "failures_by_kill": dict(by_kill.most_common()),
        "resumed": sum(r.resumed for r in tally.results),
        "resumed_ok": sum(r.resumed and r.outcome == "ok" for r in tally.results),
        "resume_log_lines": len(resumed_ids),
        "haproxy": dict(counters.totals) if counters.sock_path else None,
        "kills": [k.record() for k in tally.kills], "kills_by_kind": tally.kills_by_kind(),
        "kills_unrecovered": sum(k.recovered_s is None for k in tally.kills),
        "recovery_s_median": statistics.median(recovered) if recovered else None,
        "skipped_kinds": skipped, "idle": idle,
        "clean_pass": {"specs": len(clean), "ok": len(clean_texts),
                       "failed": [f"{r.spec.label}: {r.reason}" for r in clean
                                  if r.outcome != "ok"],
                       "greedy_stream_vs_plain_differs": stream_vs_plain},
        "greedy_checked": sum(1 for r in tally.results if r.spec.greedy
                              and r.spec in expected and r.outcome in ("ok", "wrong")),
        "seeded_text_differs": seeded_differs,
        "ok_latency_s": {"p50": _pct(ok_latency, 0.5), "p99": _pct(ok_latency, 0.99)},
        "longest_stall_s": longest_stall(tally.results, duration_s),
        "failures": failures[:200], "failures_dropped": max(0, len(failures) - 200),
    }


async def run_scenario(app: AppUnderTest, scenario: str, args: argparse.Namespace,
                       ss_problem: str | None) -> dict[str, Any]:
    """Clean pass, chaos under load, recovery and the idle check, on a deployed app."""
    mode, base_url, env = app.mode, app.base_url, app.env
    label = f"{mode}/{scenario}"
    expected, clean = await clean_pass(base_url, args.model, args.concurrency,
                                       args.request_timeout)
    print(f"  [{label}] clean pass: {len(expected)}/{len(clean)} ok; "
          f"{args.minutes:g} min of chaos", flush=True)
    kinds = [k for k in KINDS[scenario] if args.kinds is None or k in args.kinds]
    skipped: dict[str, str] = {}
    if "conns" in kinds and (mode != "haproxy" or ss_problem):
        kinds.remove("conns")
        if mode == "haproxy":
            skipped["conns"] = f"ss -K unusable: {ss_problem}"
            print(f"  [{label}] NOTE: not killing HAProxy connections: {ss_problem}",
                  flush=True)
    logs = LogTail()
    await asyncio.to_thread(logs.mark)
    counters = HAProxyCounters(env.get("RAY_SERVE_HAPROXY_SOCKET_PATH"))
    await asyncio.to_thread(counters.poll)
    tally, stop = Tally(), asyncio.Event()
    t0 = time.monotonic()
    tasks = [asyncio.create_task(load(app, args, expected, tally, stop, t0)),
             asyncio.create_task(chaos(label, app, kinds, args, tally, stop, t0, skipped)),
             asyncio.create_task(progress(label, tally, stop, t0, counters))]
    try:
        await asyncio.sleep(args.minutes * 60)
    finally:
        stop.set()  # clients finish what they sent (each bounded by --request-timeout)
        await asyncio.gather(*tasks, return_exceptions=True)
    duration = time.monotonic() - t0
    await asyncio.to_thread(counters.poll)
    print(f"  [{label}] {tally.line(duration)}; waiting for recovery and idle", flush=True)
    await wait_recovered(app, None, args.recovery_timeout)
    idle = await asyncio.to_thread(idle_check, app, args.idle_timeout)
    resumed = await asyncio.to_thread(logs.resumed_ids)
    return summarize(mode, scenario, tally, clean, expected, resumed, counters, idle,
                     skipped, duration)


def run_one_mode(mode: str, args: argparse.Namespace, result_path: Path) -> None:
    """In a subprocess of its own: a Ray cluster set up for `mode`, every scenario on it in
    turn, the results to `result_path` (JSON), and the cluster stopped whatever happens."""
    from tokenflow.config import ServingMode
    from tokenflow.net import free_port
    from tokenflow.ops.cluster_env import apply_cluster_env, release_cluster_env

    os.environ.pop("RAY_ADDRESS", None)  # a cluster of our own, never someone else's
    # A stats() call that timed out on a starting replica fails later, unread: Ray would
    # print each such error here. The checks treat a timeout as "not yet" already.
    os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
    env = apply_cluster_env(ServingMode(mode))  # Serve reads it at import and start
    # For the parent, should this process die without its cleanup: HAProxy's files.
    result_path.with_suffix(".env.json").write_text(json.dumps(env))
    ss_problem = ss_kill_works() if mode == "haproxy" else None
    results: list[dict[str, Any]] = []
    import ray
    from ray import serve

    try:
        http_port = free_port()
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        for scenario in args.scenarios:
            try:
                started = time.monotonic()
                app = deploy(scenario, mode, args, f"http://127.0.0.1:{http_port}", env)
                print(f"  [{mode}/{scenario}] deployed in {time.monotonic() - started:.0f} s;"
                      " clean pass", flush=True)
                try:
                    results.append(asyncio.run(run_scenario(app, scenario, args, ss_problem)))
                finally:
                    serve.delete(app.name)
            except Exception as exc:  # one scenario's failure is a row, not the end
                print(f"  [{mode}/{scenario}] FAILED: {type(exc).__name__}: {exc}", flush=True)
                results.append({"mode": mode, "scenario": scenario,
                                "error": f"{type(exc).__name__}: {exc}"})
            result_path.write_text(json.dumps(results))
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        release_cluster_env(env)


# ---------------------------------------------------------------------- the parent process
def child_timeout_s(args: argparse.Namespace) -> float:
    """A generous bound on one mode: start, and per scenario deploy, clean pass, load, the
    last requests, recovery, idle check and delete."""
    per_scenario = (args.minutes * 60 + 2 * args.request_timeout + args.recovery_timeout
                    + args.idle_timeout + 300)
    return 180 + len(args.scenarios) * per_scenario


def run_mode_subprocess(mode: str, args: argparse.Namespace, argv: list[str]
                        ) -> tuple[list[dict[str, Any]], bool]:
    """`--_one-mode MODE` in a new session (so a terminal's Ctrl-C reaches only this process,
    which passes it on as SIGINT). Past its bound, or if it will not stop, it and every
    process it started (tracked while it runs) are killed, and its HAProxy files removed.
    Returns its results (the scenarios it finished) and whether we were interrupted."""
    workdir = Path(tempfile.mkdtemp(prefix=f"chaos-{mode}-"))
    result_path = workdir / "result.json"
    child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv,
                              "--_one-mode", mode, "--_result", str(result_path)],
                             cwd=ROOT, start_new_session=True)
    tree: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + child_timeout_s(args)
    interrupted = False
    try:
        while child.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                for p in psutil.Process(child.pid).children(recursive=True):
                    tree.setdefault(p.pid, p)
            time.sleep(2)
        if child.poll() is None:
            print(f"[{mode}] no result in {child_timeout_s(args):.0f} s: stopping it",
                  flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print(f"[{mode}] interrupted: stopping its cluster", flush=True)
    finally:
        _stop_child(child, tree, result_path)
    results = json.loads(result_path.read_text()) if result_path.exists() else []
    shutil.rmtree(workdir, ignore_errors=True)
    done = {r["scenario"] for r in results}
    why = "interrupted" if interrupted else f"mode process exited {child.returncode} first"
    return results + [{"mode": mode, "scenario": s, "error": f"not finished ({why})"}
                      for s in args.scenarios if s not in done], interrupted


def _stop_child(child: subprocess.Popen, tree: dict[int, psutil.Process],
                result_path: Path) -> None:
    if child.poll() is None:
        child.send_signal(signal.SIGINT)  # its finally: serve.shutdown, ray.shutdown
        try:
            child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    # Anything of its cluster that outlived it (psutil refuses a pid reused since).
    for process in tree.values():
        with contextlib.suppress(psutil.Error):
            if process.is_running():
                process.kill()
    env_file = result_path.with_suffix(".env.json")
    if env_file.exists():
        from tokenflow.ops.cluster_env import release_cluster_env

        release_cluster_env(json.loads(env_file.read_text()))


COLUMNS = ("mode", "scenario", "requests", "ok", "resumed", "retried", "clean errors",
           "conn errors", "lost", "wrong", "abandoned", "kills (unrecovered)", "recovery s", "ok p99 s",
           "longest stall s", "idle after: run/wait/kv")


def table_row(row: dict[str, Any]) -> list[str]:
    if "error" in row:
        return [row["mode"], row["scenario"], "ERROR"] + ["-"] * (len(COLUMNS) - 3)
    c, idle, recovery = row["counts"], row["idle"], row["recovery_s_median"]
    kills = ", ".join(f"{k} {n}" for k, n in row["kills_by_kind"].items()) or "none"
    if row["kills_unrecovered"]:
        kills += f" ({row['kills_unrecovered']})"
    haproxy = row["haproxy"]
    p99 = row["ok_latency_s"]["p99"]
    return [row["mode"], row["scenario"], str(row["requests"]), str(c["ok"]),
            str(row["resumed"]) if row["mode"].startswith("proxy_ingress") else "-",
            "-" if haproxy is None else str(haproxy["wretr"] + haproxy["wredis"]),
            str(c["clean_error"]), str(c["conn_error"]), str(c["lost"]), str(c["wrong"]),
            str(c["abandoned"]), kills, "-" if recovery is None else f"{recovery:.1f}",
            "-" if p99 is None else f"{p99:.1f}", f"{row['longest_stall_s']:.1f}",
            f"{idle['max_running']}/{idle['max_waiting']}/{idle['max_kv_usage']:.2f}"
            + (" LEAK" if idle["leaked"] else "")]


def report(rows: list[dict[str, Any]]) -> str:
    """A markdown table, one row per mode x scenario, then what its columns mean."""
    cells = [list(COLUMNS), *map(table_row, rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) + " |"
             for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [f"ERROR {r['mode']}/{r['scenario']}: {r['error']}" for r in rows if "error" in r]
    return "\n".join([*lines, "", LEGEND])


LEGEND = """\
Every request is counted once: ok, clean errors (4xx/5xx, or a stream's error event), conn
errors (no response byte), lost (hung, dropped mid-body, truncated), wrong (complete, but
greedy text other than the clean pass's), abandoned (closed by the client: overload). resumed: requests the ingress resumed on another
replica (its log; proxy_ingress modes). retried: HAProxy's retries + redispatches (its stats;
a lower bound: a reload restarts them). recovery s: median from a kill until Serve had the app
whole again. longest stall s: the longest time in which no request ended. idle after: the
largest running / waiting / KV usage of any replica once the load stopped (0/0/0.00 expected)."""


def reasons_report(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        for outcome, reasons in (row.get("reasons") or {}).items():
            if outcome in ("ok", "abandoned"):
                continue
            text = "; ".join(f"{n} {reason}" for reason, n in reasons.items())
            lines.append(f"  {row['mode']}/{row['scenario']} {outcome}: {text}")
        if row.get("failures_by_kill"):
            text = "; ".join(f"{n} during {kind}" for kind, n in row["failures_by_kill"].items())
            lines.append(f"  {row['mode']}/{row['scenario']} failures by kill: {text}")
    return "\n".join(["why requests failed:", *lines]) if lines else ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def names(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
        def parse(text: str) -> list[str]:
            chosen = [n.strip() for n in text.split(",") if n.strip()]
            bad = [n for n in chosen if n not in allowed]
            if bad or not chosen:
                raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}")
            return chosen
        return parse

    def interval(text: str) -> tuple[float, float]:
        low, _, high = text.partition(":")
        return float(low), float(high or low)

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", type=names(MODES), default=list(MODES),
                   help="comma-separated serving modes (default: all four)")
    p.add_argument("--scenarios", type=names(SCENARIOS), default=list(SCENARIOS),
                   help="comma-separated: replicas, pp2, pd, overload (default: all)")
    p.add_argument("--kinds", type=names(tuple(KILLERS)), default=None,
                   help="only these kills (engine, replica, conns, stage, prefill)")
    p.add_argument("--minutes", type=float, default=1.0, help="load per scenario")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--replicas", type=int, default=2,
                   help="LLMServer replicas (the decode side with pd; prefill has 1)")
    p.add_argument("--model", default="tokenflow-tiny")
    p.add_argument("--kill-interval", type=interval, default=(3.0, 8.0), metavar="LOW:HIGH",
                   help="seconds between a recovery and the next kill, uniform")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="a request with no end after this long is lost (hung)")
    p.add_argument("--recovery-timeout", type=float, default=90.0,
                   help="how long to wait for the app to be whole after a kill")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="how long the replicas get to go idle after the load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", "--out", help="write the JSON of every run to this file")
    p.add_argument("--_one-mode", dest="one_mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--_result", dest="result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # SIGINT and SIGTERM both stop what runs, cleanly (a shell's background job starts with
    # SIGINT ignored: take it back).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    if args.one_mode is not None:
        try:
            run_one_mode(args.one_mode, args, Path(args.result))
        except KeyboardInterrupt:  # the cluster is stopped (run_one_mode's finally)
            sys.exit(130)
        return None
    rows: list[dict[str, Any]] = []
    interrupted = False
    for mode in args.modes:
        print(f"[{mode}] starting a cluster", flush=True)
        results, interrupted = run_mode_subprocess(mode, args, argv)
        rows += results
        if interrupted:
            break
    print()
    print(report(rows))
    if why := reasons_report(rows):
        print()
        print(why)
    config = {k: v for k, v in vars(args).items() if k not in ("one_mode", "result")}
    record = {"config": config, "results": rows, "interrupted": interrupted}
    if args.output:
        Path(args.output).write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"\nJSON in {args.output}")
    return record


if __name__ == "__main__":
    main_record = main()
    sys.exit(130 if main_record is not None and main_record["interrupted"] else 0)
