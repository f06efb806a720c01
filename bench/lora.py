"""Multi-LoRA throughput: one request stream served by the base model alone, and with its
requests spread round-robin over 1, 4 and 16 distinct adapters (plus one base request in
every five), all in one engine and mixed in every batch.

Workload: `--requests` prompts of `--prompt-tokens` random tokens, `--max-tokens` greedy
tokens each, all submitted at once (`LLM.generate`), so the engine runs full batches: prefill
chunks, then decode steps of up to `--max-num-seqs` requests. Adapters are written here in
PEFT's format (random weights, rank `--rank`, on all seven projections: the most expensive
case), so the bench needs no peft. Rows:

- `base`: no LoRA at all (`lora.max_loras: 0`);
- `lora-off`: LoRA enabled, every request on the base model (what enabling costs);
- `1`, `4`, `16` adapters with `--max-loras` slots (16 adapters in 4 slots: the scheduler holds
  back requests whose adapter has no slot, and slots are evicted and reloaded);
- `16@16`: 16 adapters in 16 slots.

Each row: generated tokens per second (best of `--repeat`), its ratio to `base`, slot loads
and evictions. `--breakdown` times the LoRA delta inside every projection of the `4` row (a
synchronous timer around it) and prints its share of the run.

    python bench/lora.py                                # SmolLM2-135M (int4 GGUF)
    python bench/lora.py --model tokenflow-tiny --out /tmp/lora.json
    python bench/lora.py --rows 4 --rounds 2 --compile  # as `make serve` runs it
    python bench/lora.py --rows 4 --torch-delta         # the delta without the C++ kernel
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenflow.replica.loading.model_source import SMOLLM2_MODEL_NAME

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, arch: Any, rank: int, seed: int) -> Path:
    """A PEFT-format adapter with random weights on every target of every layer."""
    import torch
    from safetensors.torch import save_file

    from tokenflow.replica.loading.lora import target_shape

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for target in TARGETS:
            d_in, d_out = target_shape(arch, target)
            part = "self_attn" if target in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": list(TARGETS)}))
    return out


ROWS = ("base", "lora-off", "1", "4", "16", "16@16")


def run_row(args: argparse.Namespace, adapters: list[str], max_loras: int, workdir: Path,
            base_requests: bool = True) -> dict[str, Any]:
    from tokenflow.replica.engine.llm import LLM
    from tokenflow.scheduler import SamplingParams

    lora = ({"max_loras": max_loras, "max_lora_rank": args.rank,
             "lora_modules": {n: str(workdir / n) for n in adapters}} if max_loras else None)
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks,
              max_num_batched_tokens=args.batched_tokens, lora=lora, compile=args.compile)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 2000) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]
    names = [None if not adapters or (base_requests and i % 5 == 4) else
             adapters[i % len(adapters)] for i in range(args.requests)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                             lora=n) for n in names]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(args.repeat):
        llm.engine.scheduler.reset_prefix_cache()  # every repeat computes its prompts
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    totals = llm.totals
    llm.shutdown()
    return {"tokens_per_s": tokens / best, "seconds": best, "tokens": tokens,
            "lora_loads": totals.lora_loads, "lora_evictions": totals.lora_evictions}


def breakdown(args: argparse.Namespace, adapters: list[str], workdir: Path) -> dict[str, float]:
    """Seconds inside the LoRA delta (shrink and expand, masked or per slot) over a run of the
    `4` row."""

    from tokenflow.replica.models import lora as lora_module

    spent = [0.0]

    add_delta = lora_module.LoRALinear.add_delta

    def timed(self, x, y):
        start = time.perf_counter()
        y = add_delta(self, x, y)
        spent[0] += time.perf_counter() - start
        return y

    lora_module.LoRALinear.add_delta = timed
    try:
        row = run_row(argparse.Namespace(**{**vars(args), "repeat": 1}), adapters, 4, workdir)
    finally:
        lora_module.LoRALinear.add_delta = add_delta
    return {"run_s": row["seconds"], "lora_delta_s": spent[0],
            "share": spent[0] / row["seconds"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=SMOLLM2_MODEL_NAME)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--batched-tokens", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rows", nargs="+", default=list(ROWS),
                        help=f"rows to run, of {', '.join(ROWS)} (the base always runs)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the rows this many times, interleaved; each keeps its best")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--torch-delta", action="store_true",
                        help="the delta through torch's ops, not the C++ kernel (to compare)")
    parser.add_argument("--compile", action="store_true",
                        help="every row with the compiled step (configs/local.yaml's setting)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.torch_delta:
        from tokenflow.replica.models import lora_kernel

        lora_kernel.available = lambda: False

    from tokenflow.replica.loading.resolve import resolve_model

    arch = resolve_model(args.model).arch_config()
    result: dict[str, Any] = {"model": args.model, "rank": args.rank, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        names = [f"a{i}" for i in range(16)]
        for i, name in enumerate(names):
            write_adapter(workdir / name, arch, args.rank, seed=i)
        rows = {"base": ([], 0, True), "lora-off": ([], args.max_loras, True),
                "1": (names[:1], args.max_loras, True), "4": (names[:4], args.max_loras, True),
                "16": (names, args.max_loras, True), "16@16": (names, 16, True)}
        # Each round runs every row once, one after another; a row keeps its best round, and
        # the base runs once more at the end (on a shared machine the first run is often the
        # slowest, and the machine's speed drifts: rounds interleave the rows against it).
        for _ in range(args.rounds):
            for label, (adapters, slots, base_requests) in rows.items():
                if label == "base" or label in args.rows:
                    row = run_row(args, adapters, slots, workdir, base_requests)
                    best = result["rows"].get(label)
                    if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
                        result["rows"][label] = row
        again = run_row(args, [], 0, workdir)
        if again["tokens_per_s"] > result["rows"]["base"]["tokens_per_s"]:
            result["rows"]["base"] = again
        base = result["rows"]["base"]["tokens_per_s"]
        for label, row in result["rows"].items():
            row["vs_base"] = row["tokens_per_s"] / base
            print(f"{label:>8}: {row['tokens_per_s']:7.1f} tok/s  {row['vs_base']:.2f}x base  "
                  f"loads {row['lora_loads']}  evictions {row['lora_evictions']}", flush=True)
        if args.breakdown:
            result["breakdown"] = breakdown(args, names[:4], workdir)
            b = result["breakdown"]
            print(f"breakdown (4 adapters): LoRA delta {b['lora_delta_s']:.2f} s of "
                  f"{b['run_s']:.2f} s ({100 * b['share']:.0f}%)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
