"""Offline throughput: tokenflow's `LLM.generate` against transformers' `generate`.

Both engines load the same checkpoint (random weights written once with `save_pretrained`)
and get the same prompts; transformers runs static batches. Prints output tokens per second
for both and their ratio, the share of engine step time spent outside the model forward, a
batch-64 decode probe, and the time against this machine's measured matmul limit. Writes the
result JSON only where `--out` says.

    python bench/throughput.py --trace standard
    python bench/throughput.py --trace mixed --skip-hf
    python bench/throughput.py --trace standard --pp 2     # PP=1 vs PP=2 (bench/pipeline.py)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.loading.model_source import tiny_model_dir
from tokenflow.scheduler import SamplingParams

BENCH_MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                   num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)


def write_bench_model(path: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**BENCH_MODEL)).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir() / name, path / name)
    return path


def make_trace(kind: str, num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    trace = []
    for _ in range(num_requests):
        if kind == "standard":
            prompt_len, output_len = 256, 128
        else:
            prompt_len, output_len = rng.randint(32, 512), rng.randint(32, 256)
        trace.append(([rng.randrange(5, 2000) for _ in range(prompt_len)], output_len))
    return trace


def flops_per_token(context: int) -> float:
    """Matmul FLOPs of one token: 2 x weights (no embedding) + attention over the context."""
    m = BENCH_MODEL
    h, kv = m["hidden_size"], m["num_key_value_heads"] * m["hidden_size"] // m["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * m["intermediate_size"]
    weights = m["num_hidden_layers"] * per_layer + h * m["vocab_size"]
    attention = m["num_hidden_layers"] * 2 * 2 * h * context
    return 2.0 * weights + attention


def measure_matmul_gflops(rounds: int = 5) -> float:
    """This machine's float32 matmul speed at 2048 x 2048 x 2048: the best round of both CPU
    kernels tokenflow runs (the BLAS's `@`, and oneDNN's multiply by a prepacked weight, which
    the compiled layers and the LM head use: models/prepacked.py), so the limit is what the
    fastest kernel here reaches, not one library's figure."""
    from tokenflow.replica.models.prepacked import can_prepack, prepack, prepacked_mm

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    kernels = [lambda: a @ b]
    if can_prepack(b):
        packed = prepack(b)
        kernels.append(lambda: prepacked_mm(a, packed))
    best = 0.0
    for kernel in kernels:
        for _ in range(2):
            kernel()
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(3):
                kernel()
            best = max(best, 3 * 2 * 2048**3 / (time.perf_counter() - t0) / 1e9)
    return best


class ForwardTimer:
    """Times the model (forward and LM head) inside each engine step; patched in by the
    benchmark, so the hot path carries no timing code."""

    def __init__(self, llm: LLM) -> None:
        self.forward_s = 0.0
        self.step_s = 0.0
        engine = llm.engine
        executor = engine.executor
        model = executor.model
        model.forward = self._timed(model.forward, "forward_s")
        model.compute_logits = self._timed(model.compute_logits, "forward_s")
        engine.step = self._timed(engine.step, "step_s")

    def _timed(self, fn, counter: str):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - t0)
            return out
        return wrapper


def run_tokenflow(model_dir: Path, trace, args) -> dict:
    llm = LLM(str(model_dir), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              kv_cache_memory_bytes=args.kv_bytes, device=args.device, dtype=args.dtype,
              compile=args.compile)
    timer = ForwardTimer(llm)
    prompts = [p for p, _ in trace]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in trace]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    decode = decode_probe(llm, args.probe_batch)
    return {"seconds": elapsed, "output_tokens": num_out, "tok_per_s": num_out / elapsed,
            "outside_forward_share": 1 - timer.forward_s / timer.step_s,
            "decode_probe": decode}


def decode_probe(llm: LLM, batch: int) -> dict:
    """Steady decode at `batch` running requests of ~300 tokens context."""
    engine = llm.engine
    timer = ForwardTimer(llm)
    rng = random.Random(1)
    for i in range(batch):
        engine.add_request(f"probe-{i}", [rng.randrange(5, 2000) for _ in range(256)],
                           SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    scheduler = engine.scheduler
    while len(scheduler.running) < batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    timer.forward_s = timer.step_s = 0.0
    steps = []
    for _ in range(20):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    for i in range(batch):
        engine.abort_request(f"probe-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "median_step_ms": 1000 * statistics.median(steps),
            "outside_forward_share": 1 - timer.forward_s / timer.step_s}


def run_transformers(model_dir: Path, trace, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_out, t0 = 0, time.perf_counter()
    batches = [trace[i:i + batch_size] for i in range(0, len(trace), batch_size)]
    for batch in tqdm(batches, desc="transformers", unit="batch"):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)  # a static batch runs to its longest request
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
        num_out += sum(n for _, n in batch)  # only the tokens a request asked for count
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "output_tokens": num_out, "tok_per_s": num_out / elapsed}


def run_vllm(model_dir: Path, trace, args) -> dict:
    """vLLM's offline engine on the same checkpoint and trace (where vLLM is installed)."""
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmParams

    llm = VllmLLM(model=str(model_dir), dtype=args.dtype, enable_prefix_caching=False,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    prompts = [{"prompt_token_ids": p} for p, _ in trace]
    params = [VllmParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in trace]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": elapsed, "output_tokens": num_out, "tok_per_s": num_out / elapsed}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", choices=["standard", "mixed"], default="standard")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-bytes", type=int, default=2 << 30)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--probe-batch", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--model-dir", default=None, help="reuse a written benchmark model")
    p.add_argument("--pp", type=int, default=1,
                   help="N > 1: compare PP=1 and PP=N at the same total threads instead")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="the engine's dtype (auto: float32 here)")
    p.add_argument("--vllm", action="store_true", help="also run vLLM's offline engine")
    p.add_argument("--compile", action="store_true",
                   help="compile the model's step (engine.model.compile)")
    p.add_argument("--out", help="write the result JSON to this file")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="tokenflow-bench-"))
    if not (model_dir / "config.json").exists():
        write_bench_model(model_dir, args.seed)
    trace = make_trace(args.trace, args.num_requests, args.seed)
    if args.pp > 1:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` as a package
        from bench import pipeline

        result = pipeline.compare(model_dir, trace, args)
        print(pipeline.summary(result, args.pp))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return result
    peak = measure_matmul_gflops() if args.device == "cpu" else float("nan")
    ours = run_tokenflow(model_dir, trace, args)
    total_flops = sum(flops_per_token(len(pr) + i) * (1 if i else len(pr))
                      for pr, n in trace for i in range(n))
    result = {"trace": args.trace, "num_requests": len(trace), "hf_batch_size": args.hf_batch_size,
              "tokenflow": ours,
              "matmul_peak_gflops": peak, "model_gflop": total_flops / 1e9,
              "limit_seconds": total_flops / (peak * 1e9)}
    if not args.skip_hf:
        hf = run_transformers(model_dir, trace, args.hf_batch_size)
        result["transformers"] = hf
        result["ratio_vs_transformers"] = ours["tok_per_s"] / hf["tok_per_s"]
    line = (f"{args.trace}: tokenflow {ours['tok_per_s']:.0f} tok/s in {ours['seconds']:.1f} s "
            f"(limit {result['limit_seconds']:.1f} s at {peak:.0f} GFLOP/s); "
            f"outside forward {100 * ours['outside_forward_share']:.1f}%; "
            f"batch-{args.probe_batch} decode step {ours['decode_probe']['median_step_ms']:.1f} ms, "
            f"outside forward {100 * ours['decode_probe']['outside_forward_share']:.1f}%")
    if "transformers" in result:
        line += (f"; transformers {result['transformers']['tok_per_s']:.0f} tok/s "
                 f"-> {result['ratio_vs_transformers']:.2f}x")
    if args.vllm:
        result["vllm"] = run_vllm(model_dir, trace, args)
        line += (f"; vLLM {result['vllm']['tok_per_s']:.0f} tok/s "
                 f"-> {ours['tok_per_s'] / result['vllm']['tok_per_s']:.2f}x")
    print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
