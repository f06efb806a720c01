"""The CPU's prefill attention: torch's SDPA (the torch backend) against tokenflow's prefill
kernel and its batch invariant kernel (attention/paged_attention.c), side by side in one run.

The default model's shapes (9 query heads, 3 KV heads of 64, blocks of 16 tokens, a bfloat16
cache), one layer's call: the step's K/V written into the cache, then every prompt or chunk
attended causally over its context. A shape is `query_len/seq_len` for each prompt or chunk of
one step, joined by `+` (`222/512` is a chunk of 222 tokens after 290 cached ones). Prints
milliseconds per call (best of `--rounds`) and the ratio; writes JSON only with `--out`.

    python bench/prefill_attention.py
    python bench/prefill_attention.py --shapes 290/290 222/512+290/290 --out /tmp/prefill.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from tokenflow.replica.attention import cpu_kernel
from tokenflow.replica.attention.backends import (
    AttentionMetadata,
    CpuAttentionBackend,
    TorchAttentionBackend,
)

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 16, 3, 9, 64


def step_inputs(spans: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """A bfloat16 cache with each context's blocks scattered, and one step's q/k/v/metadata."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-seq // BLOCK_SIZE) for _, seq in spans) + 1
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    table, slots, qsl = [], [], [0]
    width = max(-(-seq // BLOCK_SIZE) for _, seq in spans)
    for qlen, seq in spans:
        own = [order.pop() for _ in range(-(-seq // BLOCK_SIZE))]
        table.append(own + [0] * (width - len(own)))
        slots += [own[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq - qlen, seq)]
        qsl.append(qsl[-1] + qlen)
    meta = AttentionMetadata.build(slot_mapping=slots, block_table=table, query_start_loc=qsl,
                                   seq_lens=[seq for _, seq in spans], block_size=BLOCK_SIZE)
    q = torch.randn(qsl[-1], HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(qsl[-1], KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    return cache.to(torch.bfloat16), q, k, v, meta


def time_ms(backend, inputs, rounds: int, calls: int = 20) -> float:
    cache, q, k, v, meta = inputs
    for _ in range(3):
        backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def parse_shape(shape: str) -> list[tuple[int, int]]:
    spans = [tuple(int(x) for x in part.split("/")) for part in shape.split("+")]
    if any(len(s) != 2 or not 1 < s[0] <= s[1] for s in spans):
        raise SystemExit(f"bad shape {shape!r}: query_len/seq_len with 1 < query_len <= seq_len")
    return spans  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+",
                        default=["290/290", "512/512", "222/512+290/290", "200/600", "64/1500"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    args = parser.parse_args()
    kernel = cpu_kernel.load()
    if kernel is None:
        raise SystemExit("the CPU kernels did not build (is a C compiler there?)")
    sdpa, ours = TorchAttentionBackend(), CpuAttentionBackend(kernel)
    invariant = CpuAttentionBackend(kernel, batch_invariant=True)
    print(f"{torch.get_num_threads()} threads, bfloat16 cache, {HEADS}/{KV_HEADS} heads of "
          f"{HEAD_DIM}")
    print(f"{'shape':<22}{'SDPA ms':>10}{'kernel ms':>11}{'ratio':>8}{'invariant ms':>14}")
    rows = []
    for shape in args.shapes:
        inputs = step_inputs(parse_shape(shape))
        a, b = time_ms(sdpa, inputs, args.rounds), time_ms(ours, inputs, args.rounds)
        c = time_ms(invariant, inputs, args.rounds)
        print(f"{shape:<22}{a:>10.2f}{b:>11.2f}{a / b:>7.2f}x{c:>14.2f}", flush=True)
        rows.append({"shape": shape, "sdpa_ms": a, "kernel_ms": b, "invariant_ms": c})
    if args.out:
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows},
                                       indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
