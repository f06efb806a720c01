"""The offload tier: a shared-prefix workload whose working set is 4x the primary KV pool, run
without the tier, with the CPU-memory tier and with the disk tier, side by side in one run.

Workload: `--docs` documents of `--doc-tokens` tokens each (the shared prefixes), asked
`--rounds` questions each, round-robin over the documents (doc 0 q0, doc 1 q0, ..., doc 0 q1,
...), one request at a time, `max_tokens=1`: so TTFT is the time until the first token comes
back, with no queueing. The pool (`--pool-blocks`) holds a quarter of the documents, so LRU
evicts every document before it comes back: without the tier nothing hits; with it, every
document after the first round loads back from the tier.

Reported per mode: the prefix hit rate (pool hits + tier hits over prompt tokens, rounds after
the first), TTFT p50/p99 over the same requests, and the ratio to no tier. And, on this CPU,
what one block costs: loading it from each tier (read, checksum, copy into the cache) against
recomputing it (a cold prefill's time per block).

    python bench/kv_offload.py                       # SmolLM2-135M, 8 docs x 512 tokens
    python bench/kv_offload.py --model tokenflow-tiny --out /tmp/offload.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from typing import Any

from tokenflow.replica.loading.model_source import SMOLLM2_MODEL_NAME

BLOCK = 16


def _workload(args: argparse.Namespace) -> list[tuple[int, list[int]]]:
    """(round, prompt) in arrival order."""
    rng = random.Random(0)
    docs = [[rng.randrange(100, 2000) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    return [(r, doc + [rng.randrange(100, 2000) for _ in range(args.question_tokens)])
            for r in range(args.rounds) for doc in docs]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_mode(args: argparse.Namespace, backend: str, workdir: str) -> dict[str, Any]:
    from tokenflow.replica.engine.llm import LLM
    from tokenflow.scheduler import SamplingParams

    tier = None if backend == "none" else {"backend": backend, "size_gb": args.tier_gb,
                                           "path": workdir}
    llm = LLM(args.model, num_blocks=args.pool_blocks, block_size=BLOCK,
              max_num_batched_tokens=args.doc_tokens + args.question_tokens,
              max_model_len=args.doc_tokens + args.question_tokens + 16, kv_offload=tier)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([[5] * 32], params, use_tqdm=False)  # warm-up (first-call costs)
    ttfts, cold, tokens = [], [], []
    queries = hits = tier_hits = 0
    workload = _workload(args)
    def counters() -> tuple[int, int, int]:  # `totals` is updated in place: copy the ints
        t = llm.totals
        return t.prefix_cache_queries, t.prefix_cache_hits, t.kv_offload_hit_tokens

    for i, (round_, prompt) in enumerate(workload):
        before = counters()
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        after = counters()
        tokens.append(out.outputs[0].token_ids)
        if round_ == 0:
            cold.append(seconds)
            continue
        ttfts.append(seconds)
        queries += after[0] - before[0]
        hits += after[1] - before[1]
        tier_hits += after[2] - before[2]
        print(f"\r  {backend}: request {i + 1}/{len(workload)}", end="", file=sys.stderr)
    print(file=sys.stderr)
    result = {
        "backend": backend,
        "hit_rate": (hits + tier_hits) / queries if queries else 0.0,
        "pool_hit_rate": hits / queries if queries else 0.0,
        "tier_hit_rate": tier_hits / queries if queries else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * _pct(ttfts, 0.99),
        "cold_ttft_p50_ms": 1000 * statistics.median(cold),
        "tier_failures": llm.totals.kv_offload_failures,
        "tokens": tokens,
    }
    if backend != "none":
        result["load_ms_per_block"] = _time_load(llm, args)
    llm.shutdown()
    return result


def _time_load(llm: Any, args: argparse.Namespace) -> float:
    """One block's load from this tier, as the worker does it: read, verify, copy in."""
    worker = llm.engine.executor.worker.connector
    worker._io.submit(lambda: None).result()  # stores queued so far are written
    checksums = worker.store.checksums
    stored = [s for s in (range(len(checksums)) if isinstance(checksums, list) else checksums)
              if checksums[s] is not None]
    slots = stored[:min(args.doc_tokens // BLOCK, 32)]
    hashes, block_ids = [checksums[s][0] for s in slots], list(range(len(slots)))
    n = len(slots)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        worker._copy_in(worker.store.read(slots, hashes), block_ids)
        best = min(best, time.perf_counter() - t0)
    return 1000 * best / n


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2_MODEL_NAME)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tier-gb", type=float, default=1.0)
    p.add_argument("--pool-blocks", type=int, default=None,
                   help="primary pool size (default: a quarter of the working set)")
    p.add_argument("--modes", default="none,cpu,disk")
    p.add_argument("--out", help="write the result JSON to this file")
    args = p.parse_args(argv)
    working_set = args.docs * -(-(args.doc_tokens + args.question_tokens) // BLOCK)
    if args.pool_blocks is None:
        args.pool_blocks = working_set // 4
    print(f"{args.docs} docs x {args.doc_tokens} tokens, {args.rounds} rounds, working set "
          f"{working_set} blocks, pool {args.pool_blocks} blocks "
          f"({working_set / args.pool_blocks:.1f}x)", file=sys.stderr)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kv-offload-bench-") as workdir:
        for backend in args.modes.split(","):
            results[backend] = run_mode(args, backend, workdir)
    base = results.get("none")
    recompute_ms = (base["cold_ttft_p50_ms"] / (args.doc_tokens / BLOCK)) if base else None
    print(f"{'tier':6} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'p50 vs none':>12} "
          f"{'load/block':>11}")
    for backend, r in results.items():
        ratio = base["ttft_p50_ms"] / r["ttft_p50_ms"] if base else float("nan")
        load = f"{r['load_ms_per_block']:.2f} ms" if "load_ms_per_block" in r else "-"
        print(f"{backend:6} {r['hit_rate']:9.1%} {r['ttft_p50_ms']:8.0f} ms "
              f"{r['ttft_p99_ms']:8.0f} ms {ratio:11.2f}x {load:>11}")
    if recompute_ms is not None:
        print(f"recomputing a block (cold prefill p50 / blocks): {recompute_ms:.2f} ms")
    exact = base is None or all(r["tokens"] == base["tokens"] for r in results.values())
    print(f"first tokens identical across modes: {exact}")
    summary = {"args": {k: v for k, v in vars(args).items() if k != "out"},
               "recompute_ms_per_block": recompute_ms, "token_exact": exact,
               "modes": {k: {f: v for f, v in r.items() if f != "tokens"}
                         for k, r in results.items()}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
