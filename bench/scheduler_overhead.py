"""Scheduler overhead: time `schedule()` + `update_from_output()` per step on a seeded trace.

The model is a fake runner (one token per scheduled request whose prefill is complete), so
what is measured is the scheduler and the KV cache manager alone. Prints one JSON line; writes
it only where `--out` says. `--write-trace` dumps the synthetic trace as JSONL (one request a
line: id, arrival_s, prompt_token_ids, output_len) so another scheduler can replay it with
`--trace`; `--dump-decisions` writes each step's decisions (new, resumed, preempted and
finished request ids, tokens per request) as JSONL, so two schedulers can be diffed step by
step. `--against DIR` runs the same trace through the benchmark of another checkout (an older
commit, say) in alternating rounds and prints the ratio.

    python bench/scheduler_overhead.py --requests 512 --max-num-seqs 256
    python bench/scheduler_overhead.py --against /tmp/old-checkout --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from tqdm import tqdm

from tokenflow.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_max_model_len
from tokenflow.scheduler import ModelRunnerOutput, Request, SamplingParams, Scheduler
from tokenflow.scheduler.engine_output import EngineCoreOutputs
from tokenflow.scheduler.sched_output import SchedulerOutput


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def synthetic_trace(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    trace = []
    for i in range(args.requests):
        prompt_len = rng.randint(*args.prompt_len)
        trace.append({
            "id": f"req-{i}",
            "arrival_s": 0.0,
            "prompt_token_ids": [rng.randrange(32000) for _ in range(prompt_len)],
            "output_len": rng.randint(*args.output_len),
        })
    return trace


def load_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def fake_execute(scheduler: Scheduler, out) -> ModelRunnerOutput:
    """One token for every scheduled request whose prefill is now complete."""
    requests = scheduler.requests
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        r = requests[req_id]
        sampled.append([7] if r.num_computed_tokens >= r.num_tokens else [])
    return ModelRunnerOutput(req_ids, sampled)


def decisions(step: int, out: SchedulerOutput, outputs: EngineCoreOutputs) -> dict:
    """One step's scheduling decisions, in a form any scheduler's can be compared with."""
    cached = out.scheduled_cached_reqs
    return {
        "step": step,
        "new": sorted(r.req_id for r in out.scheduled_new_reqs),
        "resumed": sorted(r for r, resumed in zip(cached.req_ids, cached.resumed_from_preemption,
                                                   strict=True) if resumed),
        "preempted": sorted(out.preempted_req_ids),
        "finished": sorted(o.request_id for o in outputs.outputs if o.finished),
        "tokens": dict(sorted(out.num_scheduled_tokens.items())),
    }


def run(args: argparse.Namespace, trace: list[dict], dump: IO[str] | None = None) -> dict:
    sched_cfg = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len)
    cache_cfg = CacheConfig(block_size=args.block_size,
                            enable_prefix_caching=args.prefix_caching)
    max_model_len = resolve_max_model_len(EngineConfig(scheduler=sched_cfg, cache=cache_cfg),
                                          args.max_model_len, args.num_blocks)
    scheduler = Scheduler(sched_cfg, cache_cfg, args.num_blocks, max_model_len)
    if args.gc_freeze:
        # As vLLM's EngineCore does after start-up: long-lived objects (every KV block) leave the
        # collector's generations, so collections do not walk them.
        gc.freeze()
    pending = sorted(trace, key=lambda t: t["arrival_s"])
    step_us: list[float] = []
    full_us: list[float] = []
    clock = 0.0
    totals = {"preemptions": 0, "scheduled_tokens": 0, "prefix_hit_tokens": 0}
    progress = tqdm(total=len(trace), desc="requests", unit="req", disable=args.quiet)
    next_index = 0
    while next_index < len(pending) or scheduler.has_unfinished_requests():
        while next_index < len(pending) and pending[next_index]["arrival_s"] <= clock:
            t = pending[next_index]
            params = SamplingParams(max_tokens=t["output_len"], ignore_eos=True, temperature=0)
            scheduler.add_request(Request(t["id"], t["prompt_token_ids"], params,
                                          arrival_time=t["arrival_s"]))
            next_index += 1
        num_running = len(scheduler.running)
        t0 = time.perf_counter_ns()
        out = scheduler.schedule()
        t1 = time.perf_counter_ns()
        runner_out = fake_execute(scheduler, out)
        t2 = time.perf_counter_ns()
        outputs = scheduler.update_from_output(out, runner_out)
        t3 = time.perf_counter_ns()
        us = ((t1 - t0) + (t3 - t2)) / 1000
        step_us.append(us)
        if num_running >= args.max_num_seqs:
            full_us.append(us)
        stats = outputs.scheduler_stats
        totals["preemptions"] += stats.num_preemptions
        totals["prefix_hit_tokens"] += stats.prefix_cache_hits
        totals["scheduled_tokens"] += out.total_num_scheduled_tokens
        if dump is not None:
            dump.write(json.dumps(decisions(len(step_us) - 1, out, outputs)) + "\n")
        progress.update(sum(o.finished for o in outputs.outputs))
        clock += args.step_ms / 1000
    progress.close()
    step_us.sort()
    full = sorted(full_us) or step_us
    result = {
        "steps": len(step_us),
        "median_us": round(statistics.median(step_us), 1),
        "p99_us": round(step_us[int(0.99 * (len(step_us) - 1))], 1),
        "median_us_at_max_num_seqs": round(statistics.median(full), 1),
        "num_steps_at_max_num_seqs": len(full_us),
        "total_s": round(sum(step_us) / 1e6, 3),
        **totals,
        "config": {k: v for k, v in vars(args).items() if k in TRACE_ARGS + RUN_ARGS},
    }
    return result


# Arguments that define the workload, passed on unchanged to the benchmark of `--against`.
TRACE_ARGS = ("requests", "prompt_len", "output_len", "seed")
RUN_ARGS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks",
            "block_size", "prefix_caching", "step_ms", "gc_freeze")


def _cli_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in RUN_ARGS:
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def compare(args: argparse.Namespace, trace: list[dict]) -> dict:
    """This checkout's scheduler and the one in `args.against`, on the same trace, in
    alternating rounds (so drift of a noisy machine hits both alike). Both sides run as fresh
    subprocesses the same way: a side run in this process would carry its heap (the trace,
    the imports) into the timing."""
    here = Path(__file__).resolve().parent.parent
    other = Path(args.against).resolve()
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for t in trace:
            f.write(json.dumps(t) + "\n")

    def median_us(checkout: Path) -> float:
        cmd = [sys.executable, str(checkout / "bench" / "scheduler_overhead.py"), "--trace",
               f.name, "--quiet", *_cli_flags(args)]
        done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(checkout)},
                              capture_output=True, text=True, check=True, cwd=checkout)
        return json.loads(done.stdout.strip().splitlines()[-1])["median_us_at_max_num_seqs"]

    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(median_us(here))
        theirs.append(median_us(other))
    os.unlink(f.name)
    return {"against": str(other), "rounds": args.rounds,
            "median_us_at_max_num_seqs": statistics.median(ours),
            "against_median_us_at_max_num_seqs": statistics.median(theirs),
            "speedup": round(statistics.median(theirs) / statistics.median(ours), 3),
            "ours_us": ours, "against_us": theirs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prompt-len", type=span, default=(128, 1024), metavar="MIN:MAX")
    p.add_argument("--output-len", type=span, default=(64, 256), metavar="MIN:MAX")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-blocks", type=int, default=65536)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-ms", type=float, default=10.0,
                   help="virtual time a step takes, for replaying arrival times")
    p.add_argument("--trace", help="replay a JSONL trace instead of the synthetic one")
    p.add_argument("--write-trace", help="write the synthetic trace as JSONL and go on")
    p.add_argument("--out", help="write the result JSON to this file")
    p.add_argument("--dump-decisions", metavar="FILE",
                   help="write each step's scheduling decisions as JSONL")
    p.add_argument("--against", metavar="DIR",
                   help="also run the benchmark of the checkout in DIR, side by side")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds for --against")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    trace = load_trace(args.trace) if args.trace else synthetic_trace(args)
    if args.write_trace:
        with open(args.write_trace, "w") as f:
            for t in trace:
                f.write(json.dumps(t) + "\n")
    if args.against:
        result = compare(args, trace)
    elif args.dump_decisions:
        with open(args.dump_decisions, "w") as dump:
            result = run(args, trace, dump)
    else:
        result = run(args, trace)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
