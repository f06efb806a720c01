"""Overhead of each serving mode: one trace against the in-process `AsyncEngine` and against
`tokenflow serve` in every serving mode, side by side in one run, at several concurrencies. The
in-process engine runs first and last, and once more with its loop in an engine process of its
own; each served mode is compared with the fastest of those runs.

Each served mode is a fresh `tokenflow serve` process (its own Ray cluster, set up for the
mode) with the engine config of `--config`, the model replaced by `--model`; the client is
this process, the same one that runs the in-process engine. Reported per mode and
concurrency: output throughput, TTFT p50/p99, ITL p50/p99, the loss against the in-process
engine, and the CPU seconds each process of the server spent during the measured run. Then,
per mode, the paired TTFT at concurrency 1 (`--paired-ttft N`): the server and the in-process
engine (its loop in a thread, and in an engine process) take turns, prompt by prompt, so that
the machine's drift over minutes cancels out; the median of the per-prompt differences is what
the serving path adds to TTFT. Writes JSON only where `--out` says; `--profile MODE` records a
py-spy profile of that mode's Python server processes at the highest concurrency and prints
where their time goes.

    python bench/serve_overhead.py                                   # every mode, c 1 8 32
    python bench/serve_overhead.py --modes proxy_ingress haproxy --concurrency 32 \
        --profile proxy_ingress
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import yaml  # noqa: E402

from bench.datasets import BenchRequest, random_requests  # noqa: E402
from bench.serve import SendFn, http_send_fn, measure_request, run_benchmark  # noqa: E402
from tokenflow.config import AppConfig, load_app_config  # noqa: E402
from tokenflow.net import free_port  # noqa: E402
from tokenflow.replica.engine.async_engine import AsyncEngine  # noqa: E402
from tokenflow.scheduler import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# py-spy installs a binary next to the interpreter (the dev extra); else whatever PATH has.
PY_SPY = (str(Path(sys.executable).parent / "py-spy")
          if (Path(sys.executable).parent / "py-spy").exists() else "py-spy")


@dataclass(frozen=True)
class ServedMode:
    """One served configuration: a serving mode, the stream interval (chunk coalescing), the
    engine loop and the request router. The modes measured before the engine process existed
    keep the thread loop they were measured with; `haproxy_engine_process` is the default
    configuration."""

    label: str
    serving_mode: str
    stream_interval_s: float = 0.0
    engine_loop: str = "thread"
    request_router: str | None = None  # None: the config's


MODES = {m.label: m for m in (
    ServedMode("proxy_ingress", "proxy_ingress"),
    ServedMode("proxy_ingress_grpc", "proxy_ingress_grpc"),
    ServedMode("proxy", "proxy"),
    ServedMode("haproxy", "haproxy"),
    ServedMode("haproxy_engine_process", "haproxy", engine_loop="process"),
    ServedMode("haproxy_least_connections", "haproxy", engine_loop="process",
               request_router="least_connections"),
    ServedMode("haproxy_coalesce50ms", "haproxy", 0.05),
)}
# The in-process references: the AsyncEngine in this process, its loop in a thread here or in
# an engine process of its own. Each served mode is compared with the fastest of them.
INPROCESS = ("in-process", "in-process, engine process", "in-process (again)")

# What each server process is, from its command line (the first pattern that matches).
ROLES = (
    ("LLMServer replica", r"ServeReplica:[^:]+:LLMServer"),
    ("OpenAIIngress replica", r"ServeReplica:[^:]+:OpenAIIngress"),
    ("ReplicaRouter replica", r"ServeReplica:[^:]+:ReplicaRouter"),
    ("Serve proxy", r"ProxyActor"),
    ("Serve controller", r"ServeController"),
    ("HAProxy", r"haproxy"),
    ("engine process", r"spawn_main"),
    ("tokenflow serve (driver)", r"tokenflow serve"),
)


class EngineSender:
    """The benchmark's send function for an in-process AsyncEngine (no HTTP, no Serve)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def __call__(self, request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0,
                                ignore_eos=True)
        async for delta in self.engine.generate(request.prompt, params):
            yield time.perf_counter(), sum(len(c.token_ids) for c in delta.outputs)


def role_of(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return "gone"
    for role, pattern in ROLES:
        if re.search(pattern, cmd):
            return role
    return "Ray core and workers"


def cpu_by_process(root: psutil.Process) -> dict[int, tuple[str, float]]:
    """pid -> (role, user+system CPU seconds so far) for `root` and all its descendants."""
    out = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            out[proc.pid] = (role_of(proc), t.user + t.system)
        except psutil.Error:
            continue
    return out


def cpu_spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
              ) -> dict[str, float]:
    spent: dict[str, float] = collections.defaultdict(float)
    for pid, (role, seconds) in after.items():
        spent[role] += seconds - before.get(pid, (role, 0.0))[1]
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def wait_until_200(url: str, proc: subprocess.Popen | None, what: str, log: str,
                   timeout_s: float, poll_s: float = 1.0) -> None:
    """Until `url` answers 200; fails at once if `proc` (the server, if it is one) exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{what} not ready in {timeout_s} s; see {log}")


class Server:
    """`tokenflow serve` in a subprocess (its own Ray cluster), stopped with SIGINT."""

    def __init__(self, config: dict[str, Any], log: Path) -> None:
        self.port = free_port()
        fd, self._config_path = tempfile.mkstemp(suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump({**config, "port": self.port}, f)
        self._log = log.open("w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "RAY_SERVE_LOG_TO_STDERR": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenflow.cli", "serve", "--config", self._config_path,
             "--metrics-port", str(free_port()), "--no-dashboard"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        wait_until_200(f"{self.url}/v1/models", self.proc, "tokenflow serve", self._log.name,
                       timeout_s)

    def python_pids(self) -> list[int]:
        """The Python processes that serve HTTP or run the engine (for py-spy)."""
        root = psutil.Process(self.proc.pid)
        keep = ("LLMServer replica", "OpenAIIngress replica", "ReplicaRouter replica",
                "Serve proxy")
        return [p.pid for p in root.children(recursive=True) if role_of(p) in keep]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: only what we began
                self.proc.wait()
        self._log.close()
        os.unlink(self._config_path)


def requests_for(concurrency: int, args: argparse.Namespace) -> list[BenchRequest]:
    n = max(args.min_prompts, args.prompts_per_slot * concurrency)
    return random_requests(n, args.input_len, args.output_len, args.seed)


async def warm_up(send: Any, c: int, args: argparse.Namespace) -> None:
    """Enough requests to touch every code path (connections, tokenizer, allocator) first."""
    requests = random_requests(max(c, args.warmup), args.input_len, args.output_len,
                               args.seed + 1)
    await run_benchmark(send, requests, math.inf, c, args.seed, progress=False)


async def measure_served(mode: ServedMode, base_config: dict[str, Any],
                         args: argparse.Namespace, log_dir: Path,
                         paired: dict[str, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    config = {**base_config, "serving_mode": mode.serving_mode,
              "stream_interval_s": mode.stream_interval_s}
    config["engine"] = {**config.get("engine", {}), "engine_loop": mode.engine_loop}
    if mode.request_router is not None:
        config["deployment"] = {**config.get("deployment", {}),
                                "request_router": mode.request_router}
    server = Server(config, log_dir / f"{mode.label}.log")
    results: dict[int, dict[str, Any]] = {}
    try:
        server.wait_ready()
        root = psutil.Process(server.proc.pid)
        async with http_send_fn(server.url, "completions", args.model) as send:
            for c in args.concurrency:
                requests = requests_for(c, args)
                await warm_up(send, c, args)
                profile = (start_profile(server, args, mode.label, c)
                           if args.profile == mode.label and c == max(args.concurrency)
                           else None)
                before = cpu_by_process(root)
                t0 = time.process_time()
                result = await run_benchmark(send, requests, math.inf, c, args.seed,
                                             progress=False)
                client_cpu = time.process_time() - t0
                cpu = cpu_spent(before, cpu_by_process(root))
                cpu["bench client (this process)"] = client_cpu
                if profile is not None:
                    finish_profile(profile)
                results[c] = {"result": result.to_dict(per_request=False), "cpu_s": cpu}
                print(f"  {mode.label:<26} c={c:<3} {result.summary_line()}", flush=True)
            if args.paired_ttft:
                paired[mode.label] = await paired_ttft(send, load_app_config(base_config),
                                                       args)
                print(f"  {mode.label:<26} {paired_line(paired[mode.label])}", flush=True)
    finally:
        server.stop()
    return results


async def paired_ttft(served: SendFn, config: AppConfig, args: argparse.Namespace
                      ) -> dict[str, Any]:
    """TTFT at concurrency 1, the served mode and the in-process engine (its loop in a thread
    here, and in an engine process) taking turns: each prompt goes to each of them, one
    request at a time, in an order that rotates from prompt to prompt. Each engine sees every
    prompt once (no prefix-cache hit anywhere), and the machine's drift hits all of them
    alike, so the per-prompt difference is what the serving path adds."""
    engines = {label: AsyncEngine(config.engine.model_copy(update={"engine_loop": loop}))
               for label, loop in (("in-process", "thread"),
                                   ("in-process, engine process", "process"))}
    senders: dict[str, SendFn] = {**{k: EngineSender(e) for k, e in engines.items()},
                                  "served": served}
    ttft_ms: dict[str, list[float]] = {name: [] for name in senders}
    try:
        for send in senders.values():
            await warm_up(send, 1, args)
        names = list(senders)
        requests = random_requests(args.paired_ttft, args.input_len, args.output_len,
                                   args.seed + 2)
        for i, request in enumerate(requests):
            for name in names[i % len(names):] + names[:i % len(names)]:
                result = await measure_request(senders[name], request, 600.0,
                                               time.perf_counter())
                if result.ttft is None:
                    raise RuntimeError(f"paired TTFT, {name}: {result.error}")
                ttft_ms[name].append(1000 * result.ttft)
    finally:
        for engine in engines.values():
            engine.shutdown()
    served_ms = ttft_ms.pop("served")
    return {"prompts": len(served_ms),
            "ttft_ms_p50": {"served": statistics.median(served_ms),
                            **{k: statistics.median(v) for k, v in ttft_ms.items()}},
            "added_ms_p50": {k: statistics.median([s - r for s, r in zip(served_ms, v,
                                                                          strict=True)])
                             for k, v in ttft_ms.items()}}


def paired_line(paired: dict[str, Any]) -> str:
    p50, added = paired["ttft_ms_p50"], paired["added_ms_p50"]
    return (f"paired TTFT c=1, {paired['prompts']} prompts: p50 served {p50['served']:.1f} ms, "
            f"in-process {p50['in-process']:.1f}, engine process "
            f"{p50['in-process, engine process']:.1f}; added (median of per-prompt "
            f"differences) {added['in-process']:+.1f} / "
            f"{added['in-process, engine process']:+.1f} ms")


async def measure_inprocess(config: AppConfig, args: argparse.Namespace,
                            engine_loop: str = "thread") -> dict[int, dict[str, Any]]:
    engine = AsyncEngine(config.engine.model_copy(update={"engine_loop": engine_loop}))
    label = "in-process" if engine_loop == "thread" else "in-process, engine process"
    results: dict[int, dict[str, Any]] = {}
    try:
        send = EngineSender(engine)
        for c in args.concurrency:
            requests = requests_for(c, args)
            await warm_up(send, c, args)
            engine_process = (psutil.Process(engine.engine_pid) if engine.engine_pid
                              else None)
            engine_cpu = _cpu_s(engine_process)
            t0 = time.process_time()
            result = await run_benchmark(send, requests, math.inf, c, args.seed,
                                         progress=False)
            cpu = {"engine and client (this process)": time.process_time() - t0}
            if engine_process is not None:
                cpu = {"client (this process)": cpu.popitem()[1],
                       "engine process": _cpu_s(engine_process) - engine_cpu}
            results[c] = {"result": result.to_dict(per_request=False), "cpu_s": cpu}
            print(f"  {label:<26} c={c:<3} {result.summary_line()}", flush=True)
    finally:
        engine.shutdown()
    return results


def _cpu_s(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    t = proc.cpu_times()
    return t.user + t.system


# ------------------------------------------------------------------------------ profiling
@dataclass
class Profile:
    label: str
    procs: list[tuple[int, subprocess.Popen, Path]]
    out_dir: Path


def start_profile(server: Server, args: argparse.Namespace, label: str, c: int) -> Profile:
    out_dir = Path(args.profile_out or tempfile.mkdtemp(prefix="serve-profile-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for pid in server.python_pids():
        raw = out_dir / f"{label}-c{c}-{pid}.txt"
        procs.append((pid, subprocess.Popen(
            [PY_SPY, "record", "--pid", str(pid), "--rate", "100", "--format", "raw",
             "--nonblocking", "-o", str(raw), "--duration", str(args.profile_s)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), raw))
    return Profile(label, procs, out_dir)


def finish_profile(profile: Profile) -> None:
    """Print, per process, the share of samples by the outermost frame of interest and the
    hottest leaf functions."""
    print(f"\npy-spy profile of {profile.label} (raw stacks in {profile.out_dir}):")
    for pid, proc, raw in profile.procs:
        proc.wait()
        if not raw.exists():
            print(f"  pid {pid}: no profile (py-spy needs ptrace rights)")
            continue
        print(summarize_stacks(pid, raw.read_text()))


def summarize_stacks(pid: int, collapsed: str, top: int = 12) -> str:
    leaves: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        leaves[_frame(frames[-1])] += n
    if not total:
        return f"  pid {pid}: no samples"
    role = role_of(psutil.Process(pid)) if psutil.pid_exists(pid) else f"pid {pid}"
    lines = [f"  {role} (pid {pid}), {total} samples; by thread: " + ", ".join(
        f"{t} {100 * n / total:.0f}%" for t, n in threads.most_common(4))]
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in leaves.most_common(top)]
    return "\n".join(lines)


def _frame(frame: str) -> str:
    # "function (file.py:line)" -> "function (file.py)": group a function's lines together
    return re.sub(r":\d+\)$", ")", frame.replace(str(ROOT) + "/", ""))


# ---------------------------------------------------------------------------------- report
def report(results: dict[str, dict[int, dict[str, Any]]], concurrencies: list[int],
           paired: dict[str, dict[str, Any]]) -> str:
    head = (f"{'mode':<26}{'c':>4}{'tok/s':>9}{'loss':>8}{'TTFT p50':>10}{'p99':>8}"
            f"{'+TTFT p50':>11}{'ITL p50':>9}{'p99':>8}   CPU s by process")
    lines = [head, "-" * len(head)]
    for c in concurrencies:
        ref = max((results[k][c]["result"] for k in INPROCESS if k in results),
                  key=lambda r: r["output_throughput"])
        for label, per_c in results.items():
            r, cpu = per_c[c]["result"], per_c[c]["cpu_s"]
            loss = 1 - r["output_throughput"] / ref["output_throughput"]
            added = r["ttft_ms"]["p50"] - ref["ttft_ms"]["p50"]
            cpu_text = ", ".join(f"{k} {v:.1f}" for k, v in cpu.items() if v >= 0.05)
            lines.append(f"{label:<26}{c:>4}{r['output_throughput']:>9.1f}{100 * loss:>7.1f}%"
                         f"{r['ttft_ms']['p50']:>10.1f}{r['ttft_ms']['p99']:>8.1f}"
                         f"{added:>+11.1f}{r['itl_ms']['p50']:>9.1f}{r['itl_ms']['p99']:>8.1f}"
                         f"   {cpu_text}")
        lines.append("")
    if paired:
        lines.append("TTFT at c=1, paired with the in-process engine (thread / engine process):")
        lines += [f"{label:<26}  {paired_line(p)}" for label, p in paired.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--model", default="tokenflow-tiny",
                   help="engine.model.model for every run (default tokenflow-tiny: this "
                        "measures the serving path, not the model)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--prompts-per-slot", type=int, default=6,
                   help="requests per run = this x concurrency (at least --min-prompts)")
    p.add_argument("--min-prompts", type=int, default=20)
    p.add_argument("--warmup", type=int, default=16, help="warm-up requests before each run")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=1,
                   help="engine.model.num_threads everywhere (default 1: on 2 cores torch's "
                        "second thread only contends with the HTTP side)")
    p.add_argument("--profile", choices=list(MODES),
                   help="py-spy the Python server processes of this mode at the highest "
                        "concurrency")
    p.add_argument("--profile-s", type=int, default=8, help="seconds of profile")
    p.add_argument("--profile-out", help="directory for the raw py-spy stacks")
    p.add_argument("--no-inprocess-engine-process", dest="inprocess_engine_process",
                   action="store_false",
                   help="skip the in-process reference whose engine runs in a process of "
                        "its own")
    p.add_argument("--paired-ttft", type=int, default=40, metavar="N",
                   help="prompts of the paired TTFT measurement at c=1 per mode (0: none)")
    p.add_argument("--out", help="write the result JSON to this file")
    args = p.parse_args(argv)
    args.concurrency = sorted(set(args.concurrency))
    data = load_app_config(args.config).model_dump(mode="json", exclude_unset=True)
    data.setdefault("engine", {}).setdefault("model", {})["model"] = args.model
    data["engine"]["model"]["num_threads"] = args.num_threads
    config = load_app_config(data)
    log_dir = Path(tempfile.mkdtemp(prefix="serve-overhead-"))
    print(f"server logs in {log_dir}", flush=True)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    paired: dict[str, dict[str, Any]] = {}
    # The in-process engine runs first and last: this machine's speed drifts over minutes, and
    # each served mode is compared with the faster of the two (the stricter comparison).
    results["in-process"] = asyncio.run(measure_inprocess(config, args))
    if args.inprocess_engine_process:
        results["in-process, engine process"] = asyncio.run(
            measure_inprocess(config, args, "process"))
    for label in args.modes:
        results[label] = asyncio.run(measure_served(MODES[label], data, args, log_dir,
                                                    paired))
    results["in-process (again)"] = asyncio.run(measure_inprocess(config, args))
    print()
    print(report(results, args.concurrency, paired))
    record = {"config": vars(args), "results": {k: {str(c): v for c, v in per_c.items()}
                                                for k, per_c in results.items()},
              "paired_ttft": paired}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
