"""The CPU's paged decode kernel alone: a float32 against a bfloat16 cache, on huge pages or
not, and the batch invariant kernel on the bfloat16 cache, side by side in one run.

The default model's shapes (9 query heads, 3 KV heads of 64, blocks of 16 tokens), one call per
layer over 30 layers' caches (so each layer's blocks are read cold, as in a step), each
request's blocks in random order over a 1,024-block cache. Prints microseconds per layer call
(best of `--rounds`) and the bytes of K/V read per second; writes JSON only with `--out`.

    python bench/decode_attention.py
    python bench/decode_attention.py --shapes 1x300 16x300 64x300 --out /tmp/attn.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tokenflow.replica.attention import cpu_kernel
from tokenflow.replica.attention.backends import AttentionMetadata
from tokenflow.replica.worker import huge_pages

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 30, 1024, 16, 3, 9, 64


def caches(dtype: torch.dtype, huge: bool) -> list[torch.Tensor]:
    shape = (2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        cache = (huge_pages.zeros(shape, dtype, torch.device("cpu")) if huge
                 else torch.zeros(shape, dtype=dtype))
        cache.copy_(torch.randn(shape, generator=gen))
        out.append(cache)
    return out


def step_inputs(requests: int, context: int) -> tuple[AttentionMetadata, torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    per = -(-context // BLOCK_SIZE)
    if requests * per <= BLOCKS:
        table = torch.randperm(BLOCKS, generator=gen)[:requests * per].view(requests, per)
    else:  # more context than the cache: blocks shared, still in random order
        table = torch.randint(0, BLOCKS, (requests, per), generator=gen)
    slots = [int(row[-1]) * BLOCK_SIZE + (context - 1) % BLOCK_SIZE for row in table]
    meta = AttentionMetadata.build(slot_mapping=slots, block_table=table.tolist(),
                                   query_start_loc=list(range(requests + 1)),
                                   seq_lens=[context] * requests, block_size=BLOCK_SIZE)
    q = torch.randn(requests, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(requests, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    return meta, q, k, v


def time_layer_us(kernel: cpu_kernel.PagedAttentionKernel, layer_caches: list[torch.Tensor],
                  requests: int, context: int, rounds: int, invariant: bool = False) -> float:
    meta, q, k, v = step_inputs(requests, context)
    out = torch.empty_like(q)
    attend = kernel.invariant if invariant else kernel
    best = float("inf")
    for r in range(rounds + 2):  # two warm-up rounds
        start = time.perf_counter()
        for cache in layer_caches:
            if not attend(q, k, v, cache, meta, HEAD_DIM**-0.5, out):
                raise SystemExit("the kernel declined these shapes")
        if r >= 2:
            best = min(best, time.perf_counter() - start)
    return best / len(layer_caches) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1x300", "1x1000", "4x300", "16x300",
                                                         "64x300"],
                        help="requests x context tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    args = parser.parse_args()
    kernel = cpu_kernel.load()
    if kernel is None:
        raise SystemExit("the paged decode kernel did not build (is a C compiler there?)")
    variants = {"float32": (torch.float32, False, False),
                "float32, huge pages": (torch.float32, True, False),
                "bfloat16, huge pages": (torch.bfloat16, True, False),
                "bfloat16, huge pages, batch invariant": (torch.bfloat16, True, True)}
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes]
    result: dict[str, dict[str, float]] = {}
    for name, (dtype, huge, invariant) in variants.items():
        layer_caches = caches(dtype, huge)
        for requests, context in shapes:
            us = time_layer_us(kernel, layer_caches, requests, context, args.rounds, invariant)
            result.setdefault(f"{requests}x{context}", {})[name] = us
            print(f"  {name}, {requests} x {context}: {us:.0f} us", flush=True)
        del layer_caches
    print(f"\n| requests x context | {' | '.join(variants)} |")
    print("|---|" + "---|" * len(variants))
    for shape, row in result.items():
        requests, context = (int(n) for n in shape.split("x"))
        base = row["float32"]
        cells = []
        for name, (dtype, _, _) in variants.items():
            nbytes = requests * context * KV_HEADS * HEAD_DIM * 2 * (2 if dtype == torch.bfloat16
                                                                      else 4)
            cells.append(f"{row[name]:.0f} us ({base / row[name]:.2f}x, "
                         f"{nbytes / row[name] / 1e3:.1f} GB/s)")
        print(f"| {shape} | {' | '.join(cells)} |")
    if args.out:
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(),
                                        "us_per_layer": result}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
