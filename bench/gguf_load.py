"""GGUF load time: tokenflow against transformers on the same file, in one run.

Each load runs in a fresh Python process (nothing cached from an earlier load; the file itself
is in the OS page cache for both after the first read), the two sides alternating, `--repeats`
times. Timed from after the imports to a model ready to run plus its tokenizer:

- tokenflow: `LLM(model)`: config, weights dequantized to float32, KV cache, tokenizer.
- transformers: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)` and
  `AutoTokenizer.from_pretrained(dir, gguf_file=...)`.

Prints one line with the medians and their ratio; writes the result JSON only where `--out`
says.

    python bench/gguf_load.py                      # smollm2-135m-instruct, 3 repeats
    python bench/gguf_load.py --model path/to/model.gguf --repeats 5 --out /tmp/load.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_tokenflow(model: str) -> dict[str, float]:
    from tokenflow.replica.engine.llm import LLM

    started = time.perf_counter()
    llm = LLM(model, num_blocks=256, max_model_len=2048)
    total = time.perf_counter() - started
    return {"total_s": total, "engine_reported_s": llm.engine.load_time_s}


def load_transformers(model: str) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenflow.replica.loading.resolve import resolve_model

    path = resolve_model(model).path  # resolving is not timed: it only finds the file
    started = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                         dtype=torch.float32)
    weights = time.perf_counter() - started
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return {"total_s": time.perf_counter() - started, "model_s": weights}


def measure(side: str, model: str) -> dict[str, float]:
    """One load in a fresh process."""
    done = subprocess.run([sys.executable, __file__, "--side", side, "--model", model],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{side} load failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the result JSON to this file")
    p.add_argument("--side", choices=["tokenflow", "transformers"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.side is not None:  # the child process: one load, one JSON line
        load = load_tokenflow if args.side == "tokenflow" else load_transformers
        print(json.dumps(load(args.model)))
        return {}
    runs: dict[str, list[dict[str, float]]] = {"tokenflow": [], "transformers": []}
    measure("tokenflow", args.model)  # warm the page cache; not counted
    for _ in range(args.repeats):
        for side in runs:
            runs[side].append(measure(side, args.model))
    medians = {side: statistics.median(r["total_s"] for r in rs) for side, rs in runs.items()}
    ratio = medians["tokenflow"] / medians["transformers"]
    print(f"gguf load of {args.model} (median of {args.repeats}, fresh processes): tokenflow "
          f"{medians['tokenflow']:.2f} s, transformers {medians['transformers']:.2f} s, "
          f"ratio {ratio:.2f} (tokenflow / transformers; < 1 is faster)")
    for side, rs in runs.items():
        print(f"  {side:12s} " + "  ".join(f"{r['total_s']:.2f}" for r in rs) + " s")
    record = {"config": vars(args), "runs": runs, "median_s": medians, "ratio": ratio}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
