"""Pipeline parallelism on the offline throughput trace: PP=1 and PP=N side by side, in one run,
with the same total threads (PP=1: N torch threads in one process; PP=N: one thread per stage),
PP=N once for each way the engine sends steps to the stages (plain actor calls, a Ray Compiled
Graph).

Reports throughput, per stage the time per step spent waiting for the previous stage (recv),
running its layers (compute) and handing them on (send), the pipeline bubble (the share of
wall time a stage does not compute), the driver's scheduling time per step, the control round
trip of an empty step, and the CPU seconds the driver process spent (a compiled graph's reads
spin, so its driver burns a core while it waits). Called by `bench/throughput.py --pp N`.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import CachedRequestData, SamplingParams, SchedulerOutput

NUM_PROBES = 200


def _empty_step() -> SchedulerOutput:
    return SchedulerOutput([], CachedRequestData(), {}, 0, {}, set(), set())


class _SchedulerTimer:
    """Times the scheduler's two calls per step on the driver (patched in, not in the code)."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        self.steps = 0
        scheduler = llm.engine.scheduler
        scheduler.schedule = self._timed(scheduler.schedule, count=True)
        scheduler.update_from_output = self._timed(scheduler.update_from_output)

    def _timed(self, fn: Any, count: bool = False) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            self.steps += count
            return out
        return wrapper


def _stage_report(timings: list[dict[str, float]], wall_s: float) -> list[dict[str, float]]:
    report = []
    for k, t in enumerate(timings):
        steps = max(1, t["steps"])
        report.append({"stage": k, "steps": t["steps"],
                       "compute_ms_per_step": 1000 * t["compute_s"] / steps,
                       "recv_ms_per_step": 1000 * t["recv_s"] / steps,
                       "send_ms_per_step": 1000 * t["send_s"] / steps,
                       "bubble": 1 - t["compute_s"] / wall_s})
    return report


def _run(model_dir: Path, trace: list, args: Any, pp: int, threads: int,
         control: str = "auto") -> dict[str, Any]:
    llm = LLM(str(model_dir), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              kv_cache_memory_bytes=args.kv_bytes, pipeline_parallel_size=pp,
              num_threads=threads, stage_num_cpus=1, pipeline_control=control)
    executor = llm.engine.executor
    timings = executor.take_timings if pp > 1 else executor.worker.take_timings
    try:
        timer = _SchedulerTimer(llm)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for _, n in trace]
        timings()
        t0, cpu0 = time.perf_counter(), time.process_time()
        outputs = llm.generate([p for p, _ in trace], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        driver_cpu_s = time.process_time() - cpu0
        stages = timings()
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        result = {"pp": pp, "threads_per_stage": threads, "control": control,
                  "seconds": elapsed, "driver_cpu_s": driver_cpu_s,
                  "tok_per_s": num_out / elapsed,
                  "stages": _stage_report(stages if pp > 1 else [stages], elapsed),
                  "scheduling_ms_per_step": 1000 * timer.seconds / max(1, timer.steps),
                  "engine_steps": timer.steps,
                  "tokens": [o.outputs[0].token_ids for o in outputs]}
        if pp > 1:
            probes = []
            for _ in range(NUM_PROBES):
                t = time.perf_counter()
                executor.execute_model(_empty_step()).result()
                probes.append(time.perf_counter() - t)
            result["control_ms_per_step"] = 1000 * statistics.median(probes)
        return result
    finally:
        llm.shutdown()


def _actor_call_probe(num_stages: int) -> float:
    """Median round trip (ms) of an empty step sent to `num_stages` actors by plain calls."""
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        def step(self, sched_out: SchedulerOutput) -> int:
            return len(sched_out.num_scheduled_tokens)

    actors = [Echo.remote() for _ in range(num_stages)]
    ray.get([a.step.remote(_empty_step()) for a in actors])
    probes = []
    for _ in range(NUM_PROBES):
        t = time.perf_counter()
        ref = ray.put(_empty_step())
        ray.get([a.step.remote(ref) for a in actors])
        probes.append(time.perf_counter() - t)
    for actor in actors:
        ray.kill(actor)
    return 1000 * statistics.median(probes)


def compare(model_dir: Path, trace: list, args: Any) -> dict[str, Any]:
    """PP=1 with `args.pp` threads against PP=`args.pp` with one thread per stage, the stages
    driven by plain actor calls and by a compiled graph."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    ray.init(address="local", num_cpus=args.pp + 1, include_dashboard=False,
             log_to_driver=False)
    runs = [("pp1", 1, args.pp, "auto"), ("actor_calls", args.pp, 1, "actor_calls"),
            ("compiled_graph", args.pp, 1, "compiled_graph")]
    result: dict[str, Any] = {}
    try:
        for label, pp, threads, control in tqdm(runs, desc="runs", unit="run"):
            result[label] = _run(model_dir, trace, args, pp, threads, control)
        result["actor_calls_probe_ms"] = _actor_call_probe(args.pp)
    finally:
        ray.shutdown()
    tokens = [result[label].pop("tokens") for label, *_ in runs]
    result["token_identical"] = all(t == tokens[0] for t in tokens)
    for label in ("actor_calls", "compiled_graph"):
        result[label]["ratio_vs_pp1"] = result[label]["tok_per_s"] / result["pp1"]["tok_per_s"]
    return result


def _line(name: str, run: dict[str, Any]) -> str:
    stages = "; ".join(
        f"stage {s['stage']}: compute {s['compute_ms_per_step']:.1f} ms, recv "
        f"{s['recv_ms_per_step']:.1f} ms, send {s['send_ms_per_step']:.2f} ms, bubble "
        f"{100 * s['bubble']:.0f}%" for s in run["stages"])
    line = (f"{name}: {run['tok_per_s']:.0f} tok/s ({run['seconds']:.1f} s, "
            f"{run['engine_steps']} steps, driver CPU {run['driver_cpu_s']:.1f} s)")
    if "ratio_vs_pp1" in run:
        line += (f" -> {run['ratio_vs_pp1']:.2f}x PP=1; scheduling "
                 f"{run['scheduling_ms_per_step']:.2f} ms/step; control "
                 f"{run['control_ms_per_step']:.2f} ms/step; {stages}")
    return line


def summary(result: dict[str, Any], pp: int) -> str:
    return "\n".join([
        _line(f"PP=1 x{pp} threads", result["pp1"]),
        _line(f"PP={pp} x1 thread, actor calls", result["actor_calls"]),
        _line(f"PP={pp} x1 thread, compiled graph", result["compiled_graph"]),
        f"token-identical: {result['token_identical']}; plain actor-call probe "
        f"{result['actor_calls_probe_ms']:.2f} ms/step"])
