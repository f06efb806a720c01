"""Autoscaling on a step load: tokenflow's LLM-aware policy against Serve's default policy
(ongoing requests per replica against `target_ongoing_requests`), side by side in one run.

Each policy gets a fresh `tokenflow serve` (its own Ray cluster) with `--config` (default
configs/autoscale.yaml, the model replaced by `--model`), then the same seeded trace: Poisson
arrivals at a low rate, a step up to a high rate, and back down (`--phases`). Reported per
policy: how long after the step a second replica was started and after the step down the
count fell back, the replica-seconds used, and per phase the share of requests whose TTFT met
`--slo-s`, with TTFT p50/p90; then the ratios of the two. Writes JSON only where `--out`
says, and a plot of replicas and TTFT over time where `--plot` says.

    python bench/autoscale.py                                  # both policies, default trace
    python bench/autoscale.py --phases 20:0.5 60:4 40:0.5 --plot /tmp/autoscale.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from bench.datasets import random_requests  # noqa: E402
from bench.serve import RequestResult, http_send_fn, measure_request  # noqa: E402
from bench.serve_overhead import Server, role_of  # noqa: E402
from tokenflow.config import load_app_config  # noqa: E402

POLICIES = ("llm", "ongoing_requests")


@dataclass(frozen=True)
class Phase:
    """A stretch of the trace: `duration_s` seconds of Poisson arrivals at `rate` per second."""

    duration_s: float
    rate: float

    @classmethod
    def parse(cls, text: str) -> Phase:
        duration, rate = text.split(":")
        return cls(float(duration), float(rate))


def arrivals(phases: list[Phase], seed: int) -> list[tuple[float, int]]:
    """(offset in seconds, phase index) of every request of the trace."""
    rng = np.random.default_rng(seed)
    out, start = [], 0.0
    for i, phase in enumerate(phases):
        t = start + rng.exponential(1 / phase.rate)
        while t < start + phase.duration_s:
            out.append((t, i))
            t += rng.exponential(1 / phase.rate)
        start += phase.duration_s
    return out


def count_replicas(server: Server) -> int:
    """LLMServer replica processes of this server's cluster now (one per replica Serve
    started: the decision to scale, before the new replica has loaded its model)."""
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.Error:
        return 0
    return sum(role_of(p) == "LLMServer replica" for p in children)


async def sample_replicas(server: Server, t0: float, timeline: list[tuple[float, int]],
                          stop: asyncio.Event) -> None:
    while not stop.is_set():
        timeline.append((time.perf_counter() - t0, count_replicas(server)))
        await asyncio.sleep(0.5)


async def run_trace(server: Server, args: argparse.Namespace
                    ) -> tuple[list[tuple[int, RequestResult]], list[tuple[float, int]]]:
    trace = arrivals(args.phases, args.seed)
    requests = random_requests(len(trace), args.input_len, args.output_len, args.seed)
    timeline: list[tuple[float, int]] = []
    async with http_send_fn(server.url, "completions", args.model) as send:
        # Two requests first, one at a time (not enough to scale on): connections, tokenizer
        # and allocator warm, not measured.
        for r in random_requests(2, args.input_len, 8, args.seed + 1):
            await measure_request(send, r, 300, time.perf_counter())
        stop = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.create_task(sample_replicas(server, t0, timeline, stop))
        tasks = []
        for (offset, phase), request in zip(trace, requests, strict=True):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append((phase, asyncio.create_task(measure_request(send, request, 600, t0))))
        results = [(phase, await task) for phase, task in tasks]
        # Watch the count come back down after the trace (the downscale delay and the drain):
        # until it has read 1 three times running, or --settle-s.
        deadline, ones = time.perf_counter() + args.settle_s, 0
        while time.perf_counter() < deadline and ones < 3:
            ones = ones + 1 if count_replicas(server) <= 1 else 0
            await asyncio.sleep(0.5)
        stop.set()
        await sampler
    return results, timeline


def summarize(policy: str, results: list[tuple[int, RequestResult]],
              timeline: list[tuple[float, int]], args: argparse.Namespace) -> dict[str, Any]:
    step_up = args.phases[0].duration_s
    step_down = step_up + args.phases[1].duration_s if len(args.phases) > 1 else None
    # Seconds from the step to a second replica (negative: it came before the step).
    up = next((t - step_up for t, n in timeline if n >= 2), None)
    down = (next((t - step_down for t, n in timeline if t >= step_down and n <= 1), None)
            if step_down is not None else None)
    replica_s = sum(n * (t_next - t)
                    for (t, n), (t_next, _) in zip(timeline, timeline[1:], strict=False))
    phases = []
    for i, phase in enumerate(args.phases):
        mine = [r for p, r in results if p == i]
        ttfts = [r.ttft for r in mine if r.error is None and r.ttft is not None]
        met = sum(t <= args.slo_s for t in ttfts)
        phases.append({"phase": f"{phase.duration_s:g}s@{phase.rate:g}/s",
                       "requests": len(mine), "errors": sum(r.error is not None for r in mine),
                       "slo_met": met / len(mine) if mine else None,
                       "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
                       "ttft_p90_s": float(np.percentile(ttfts, 90)) if ttfts else None})
    everything = [r for _, r in results]
    met = sum(r.error is None and r.ttft is not None and r.ttft <= args.slo_s
              for r in everything)
    return {"policy": policy, "scale_up_after_s": up, "scale_down_after_s": down,
            "max_replicas": max((n for _, n in timeline), default=0),
            "replica_seconds": replica_s, "slo_met": met / len(everything),
            "errors": sum(r.error is not None for r in everything), "phases": phases,
            "timeline": timeline,
            "ttfts": [(r.start, r.ttft) for r in everything if r.ttft is not None]}


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def report(summaries: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"TTFT SLO {args.slo_s:g} s; a second replica counts from its process start "
             "(negative: before the step)",
             "", "| policy | scale up after s | back to 1 after s | replica-s | "
             "SLO met (all) | per phase: SLO met, TTFT p50 / p90 s | errors |",
             "|---|---|---|---|---|---|---|"]
    for s in summaries:
        per_phase = "; ".join(
            f"{p['phase']}: {_fmt(p['slo_met'] and 100 * p['slo_met'], '.0f')}%, "
            f"{_fmt(p['ttft_p50_s'], '.2f')} / {_fmt(p['ttft_p90_s'], '.2f')}"
            for p in s["phases"])
        lines.append(f"| {s['policy']} | {_fmt(s['scale_up_after_s'])} | "
                     f"{_fmt(s['scale_down_after_s'])} | {s['replica_seconds']:.0f} | "
                     f"{100 * s['slo_met']:.0f}% | {per_phase} | {s['errors']} |")
    by = {s["policy"]: s for s in summaries}
    if set(POLICIES) <= set(by):
        ours, theirs = by["llm"], by["ongoing_requests"]
        lines.append("")
        lines.append(f"llm / ongoing_requests: SLO met {ours['slo_met']:.2f} / "
                     f"{theirs['slo_met']:.2f}, replica-seconds "
                     f"{ours['replica_seconds'] / max(theirs['replica_seconds'], 1e-9):.2f}x")
    return "\n".join(lines)


def plot(summaries: list[dict[str, Any]], args: argparse.Namespace, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    for s in summaries:
        t, n = zip(*s["timeline"], strict=True)
        top.step(t, n, where="post", label=s["policy"])
        starts, ttfts = zip(*s["ttfts"], strict=True) if s["ttfts"] else ((), ())
        bottom.scatter(starts, ttfts, s=6, label=s["policy"])
    edge = 0.0
    for phase in args.phases[:-1]:
        edge += phase.duration_s
        for ax in (top, bottom):
            ax.axvline(edge, color="grey", linestyle=":")
    bottom.axhline(args.slo_s, color="red", linestyle="--", label="TTFT SLO")
    top.set_ylabel("LLMServer replicas")
    bottom.set_ylabel("TTFT s")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds into the trace (request start)")
    top.legend()
    bottom.legend()
    top.set_title("Step load: " + ", ".join(f"{p.duration_s:g} s at {p.rate:g}/s"
                                             for p in args.phases))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/autoscale.yaml")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--phases", nargs="+", type=Phase.parse,
                   default=[Phase(30, 0.5), Phase(90, 3.0), Phase(60, 0.5)],
                   help="DURATION_S:RATE per phase (the step is phase 1 -> 2)")
    p.add_argument("--max-replicas", type=int, default=2,
                   help="autoscaling max_replicas (default 2: this machine has 2 cores)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slo-s", type=float, default=1.0, help="the TTFT SLO (also the policy's)")
    p.add_argument("--settle-s", type=float, default=90,
                   help="after the trace, how long to wait for the count to fall back to 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the result JSON to this file")
    p.add_argument("--plot", help="write a plot of replicas and TTFT over time (PNG)")
    args = p.parse_args(argv)
    base = load_app_config(args.config).model_dump(mode="json", exclude_unset=True)
    base["engine"]["model"] = {"model": args.model, "num_threads": 1}
    base["engine"].setdefault("scheduler", {})["max_num_seqs"] = args.max_num_seqs
    log_dir = Path(tempfile.mkdtemp(prefix="autoscale-"))
    print(f"server logs in {log_dir}", flush=True)
    summaries = []
    for policy in args.policies:
        config = json.loads(json.dumps(base))
        scaling = config["deployment"]["autoscaling_config"]
        scaling.update({"policy": policy, "max_replicas": args.max_replicas,
                        "ttft_slo_s": args.slo_s})
        server = Server(config, log_dir / f"{policy}.log")
        try:
            server.wait_ready()
            results, timeline = asyncio.run(run_trace(server, args))
        finally:
            server.stop()
        summary = summarize(policy, results, timeline, args)
        summaries.append(summary)
        print(f"  {policy}: scale up after {_fmt(summary['scale_up_after_s'])} s, "
              f"SLO met {100 * summary['slo_met']:.0f}%", flush=True)
    print()
    print(report(summaries, args))
    record = {"config": {k: v for k, v in vars(args).items() if k != "phases"}
              | {"phases": [vars(ph) for ph in args.phases]}, "results": summaries}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    if args.plot:
        plot(summaries, args, args.plot)
        print(f"plot in {args.plot}")
    return record


if __name__ == "__main__":
    main()
