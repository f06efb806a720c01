"""What each part of the CPU engine contributes, on the default model (SmolLM2-135M-Instruct,
its Q4_1 GGUF file), side by side in one run through the whole engine (`LLM.generate`):

    float32       quantization none, eager, the torch backend's gather attention (the start)
    int4          + int4 weights (replica/models/quantized.py)
    +kernel       + the paged decode kernel (attention/paged_attention.c, in place)
    +compile      + the compiled step (replica/worker/compile.py)

For each: one request's decode (ms per token, after a 256-word prompt), 16 requests at once
(output tokens per second, their prefills included) and the prefill of a fresh 256-word
prompt; for `+compile`, how long compiling took at startup with inductor's cache empty and
again with it warm (a restart). Prints a table; writes JSON only with `--out`.

    python bench/engine_parts.py
    python bench/engine_parts.py --out bench/results/engine_parts.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenflow.config import EngineConfig
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

MODEL = "smollm2-135m-instruct"
# (name, quantization, attention backend, compile)
PARTS = [("float32", "none", "torch", False), ("int4", "int4", "torch", False),
         ("+kernel", "int4", "auto", False), ("+compile", "int4", "auto", True)]


def engine(quantization: str, compile: bool) -> LLM:
    return LLM(config=EngineConfig.model_validate({
        "model": {"model": MODEL, "quantization": quantization, "compile": compile},
        "cache": {"block_size": 16, "num_blocks": 512},
        "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 64,
                      "max_model_len": 2048}}))


def measure(quantization: str, backend: str, compile: bool, rounds: int) -> dict:
    os.environ["TOKENFLOW_ATTENTION_BACKEND"] = backend
    t0 = time.perf_counter()
    llm = engine(quantization, compile)
    startup = time.perf_counter() - t0
    words = " ".join(["word"] * 255)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True)
    llm.generate(["warm " + words], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    best: dict[str, float] = {}
    for r in range(rounds):  # fresh prompts each round: no prefix-cache hits
        t0 = time.perf_counter()
        llm.generate([f"first {r} " + words], one, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate([f"second {r} " + words], decode, use_tqdm=False)
        t2 = time.perf_counter()
        llm.generate([f"batch {r} {i} " + words for i in range(16)], decode, use_tqdm=False)
        t3 = time.perf_counter()
        result = {"prefill_256_words_ms": (t1 - t0) * 1e3,
                  "decode_ms_per_token_c1": ((t2 - t1) - (t1 - t0)) / 64 * 1e3,
                  "output_tok_s_c16": 16 * 65 / (t3 - t2)}
        for key, value in result.items():
            better = max if key.startswith("output") else min
            best[key] = better(best.get(key, value), value)
        print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{k} {v:.1f}"
                                                      for k, v in result.items()),
              file=sys.stderr, flush=True)
    llm.shutdown()
    return {**best, "startup_s": startup}


def restart_startup() -> float:
    """A new process's engine startup with `+compile`, inductor's cache now warm: a restart."""
    code = ("import time; t = time.perf_counter(); from bench.engine_parts import engine; "
            "engine('int4', True).shutdown(); print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).parents[1])
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="best of this many rounds")
    p.add_argument("--out", help="write the result JSON to this file")
    args = p.parse_args(argv)
    results: dict[str, dict] = {}
    # Compile with inductor's cache empty first, so `+compile`'s startup is a cold compile and
    # a second engine's is the restart.
    os.environ["TOKENFLOW_CACHE_DIR"] = tempfile.mkdtemp(prefix="tokenflow-bench-cache-")
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    for name, quantization, backend, compile in PARTS:
        print(f"{name}:", file=sys.stderr, flush=True)
        results[name] = measure(quantization, backend, compile, args.rounds)
    results["+compile"]["restart_startup_s"] = restart_startup()
    print("| parts | decode, 1 request | 16 requests | prefill, 256 words | startup |")
    print("|---|---|---|---|---|")
    base = results["float32"]["decode_ms_per_token_c1"]
    for name, r in results.items():
        restart = (f" (restart: {r['restart_startup_s']:.1f} s)"
                   if "restart_startup_s" in r else "")
        print(f"| {name} | {r['decode_ms_per_token_c1']:.1f} ms/token "
              f"({base / r['decode_ms_per_token_c1']:.1f}x) | {r['output_tok_s_c16']:.0f} tok/s"
              f" | {r['prefill_256_words_ms']:.0f} ms | {r['startup_s']:.1f} s{restart} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
