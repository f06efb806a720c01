"""Async scheduling off and on, side by side in one run, on the offline throughput trace.

The same checkpoint and prompts as `bench/throughput.py` (greedy, `ignore_eos`). For each mode:
output tokens per second, and the share of wall time the model sat idle: 1 - (time inside the
model's forward and LM head) / wall time of `generate`. Off, the model waits while the engine
schedules, prepares inputs, samples and processes outputs; on, the next step is scheduled and
the last one's outputs processed while the forward runs (on its own thread). Also checks the
two runs give identical tokens. Prints to stdout; writes the result JSON only with `--out`.

    python bench/async_sched.py --trace standard
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` as a package
from bench.throughput import make_trace, write_bench_model  # noqa: E402
from tokenflow.replica.engine.llm import LLM  # noqa: E402
from tokenflow.scheduler import SamplingParams  # noqa: E402


class ModelClock:
    """Sums the time inside the model (forward and LM head), whichever thread runs it;
    patched in by the benchmark, so the hot path carries no timing code."""

    def __init__(self, llm: LLM) -> None:
        self.busy_s = 0.0
        executor = llm.engine.executor
        model = executor.model
        model.forward = self._timed(model.forward)
        model.compute_logits = self._timed(model.compute_logits)

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.busy_s += time.perf_counter() - t0
            return out
        return wrapper


def run(model_dir: Path, trace, args, async_scheduling: bool) -> tuple[dict, list]:
    llm = LLM(str(model_dir), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              kv_cache_memory_bytes=args.kv_bytes, async_scheduling=async_scheduling,
              num_threads=args.num_threads)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in trace]
    llm.generate([trace[0][0]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    clock = ModelClock(llm)
    t0 = time.perf_counter()
    outputs = llm.generate([p for p, _ in trace], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outputs]
    num_out = sum(map(len, tokens))
    return {"seconds": wall, "output_tokens": num_out, "tok_per_s": num_out / wall,
            "model_busy_s": clock.busy_s, "model_idle_share": 1 - clock.busy_s / wall}, tokens


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", choices=["standard", "mixed"], default="standard")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-bytes", type=int, default=2 << 30)
    p.add_argument("--model-dir", default=None, help="reuse a written benchmark model")
    p.add_argument("--repeats", type=int, default=1, help="alternating runs of each mode")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of the model (default: every core)")
    p.add_argument("--out", help="write the result JSON to this file")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="tokenflow-bench-"))
    if not (model_dir / "config.json").exists():
        write_bench_model(model_dir, args.seed)
    trace = make_trace(args.trace, args.num_requests, args.seed)
    # Alternating off / on `--repeats` times, keeping each mode's fastest run: on a shared
    # machine the load changes between runs.
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(args.repeats):
        for flag in (False, True):
            runs[flag].append(run(model_dir, trace, args, async_scheduling=flag))
    (off, off_tokens), (on, on_tokens) = (min(runs[f], key=lambda r: r[0]["seconds"])
                                          for f in (False, True))
    result = {"trace": args.trace, "num_requests": len(trace), "repeats": args.repeats,
              "off": off, "on": on,
              "seconds_all_runs": {("on" if f else "off"): [r[0]["seconds"] for r in runs[f]]
                                   for f in (False, True)},
              "speedup": on["tok_per_s"] / off["tok_per_s"],
              "identical_tokens": off_tokens == on_tokens}
    for name, r in (("off", off), ("on", on)):
        print(f"{args.trace}, async {name}: {r['tok_per_s']:.0f} tok/s in {r['seconds']:.1f} s; "
              f"model idle {100 * r['model_idle_share']:.1f}% of wall time")
    print(f"async on / off: {result['speedup']:.3f}x; tokens identical: "
          f"{'yes' if result['identical_tokens'] else 'NO'}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
