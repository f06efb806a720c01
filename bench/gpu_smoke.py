"""The GPU path's first run, cheap and decisive: one line per check, the whole run bounded.

Checks, each in a subprocess with its own time limit (`--budget-s` in all, 600 by default):
- `env`: torch, CUDA, the GPUs.
- `equivalence-bf16`, `equivalence-fp16`: the throughput benchmark's Llama checkpoint
  (random weights written by transformers), 8 prompts of 64 tokens, 32 greedy tokens each,
  through tokenflow and through transformers, both on the GPU in that dtype: the prefill
  logits' largest difference, and how many of the 256 greedy tokens agree before the first
  divergence (half precision may tip a near-tie; float32 would be token-exact).
- `pp2-nccl` (two GPUs or more): the same prompts with the layers split over two pipeline
  stages talking NCCL, against one stage.
- `throughput`: bench/throughput.py's standard trace on the GPU, and vLLM's offline engine on
  the same checkpoint and trace when `import vllm` works there.
- `compiled-bf16`: the first equivalence check with the step compiled (`engine.model.compile`).
Without a CUDA GPU it prints one SKIP line and exits 0; `--device cpu` runs every check on the
CPU in float32 instead (a dry run of this script, where token-exactness is expected).

    bash bench/gpu_smoke.sh                 # on the GPU machine
    python bench/gpu_smoke.py --device cpu  # the dry run, anywhere
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 64, 32


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(5, 2000) for _ in range(PROMPT_LEN)] for _ in range(NUM_PROMPTS)]


def check_env(args: argparse.Namespace) -> str:
    import torch

    if args.device == "cpu":
        return f"torch {torch.__version__}, CPU dry run, {torch.get_num_threads()} threads"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs: {', '.join(names)}"


def check_equivalence(args: argparse.Namespace) -> str:
    """tokenflow against transformers on the same device and dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenflow.replica.engine.llm import LLM
    from tokenflow.scheduler import SamplingParams

    dtype = getattr(torch, args.dtype)
    prompts = _prompts()
    hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(args.device)
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        ids = torch.tensor(prompts, device=args.device)
        reference = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                min_new_tokens=NEW_TOKENS)[:, PROMPT_LEN:].tolist()
        hf_logits = hf(ids).logits[:, -1].float()
    llm = LLM(args.model_dir, device=args.device, dtype=args.dtype, max_model_len=256,
              pipeline_parallel_size=args.pp, compile=args.compile,
              **({"distributed_backend": "nccl"} if args.pp > 1 else {}))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outputs]
    agreed = sum(_common_prefix(a, b) for a, b in zip(ours, reference, strict=True))
    first = torch.tensor([o.outputs[0].logprobs[0].logprobs[0] for o in outputs])
    expected = torch.log_softmax(hf_logits, -1).gather(
        1, torch.tensor([r[0] for r in reference], device=args.device)[:, None])[:, 0].cpu()
    llm.shutdown()
    exact = agreed == NUM_PROMPTS * NEW_TOKENS
    line = (f"{agreed}/{NUM_PROMPTS * NEW_TOKENS} greedy tokens agree before the first "
            f"divergence; first token's log-prob differs by at most "
            f"{(first - expected).abs().max():.2e}")
    if not exact and args.dtype == "float32":
        raise AssertionError(line)
    return line


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_throughput(args: argparse.Namespace) -> str:
    cmd = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--trace", "standard",
           "--num-requests", str(args.num_requests), "--model-dir", args.model_dir,
           "--device", args.device, "--dtype", args.dtype, "--skip-hf"]
    if args.with_vllm:
        cmd.append("--vllm")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode:
        raise RuntimeError(done.stderr[-800:])
    return " | ".join(line for line in done.stdout.splitlines() if "tok/s" in line)[-400:]


CHECKS = {"env": check_env, "equivalence": check_equivalence, "throughput": check_throughput}


def run_one(args: argparse.Namespace) -> None:
    """In the child: one check, its line on stdout."""
    print(CHECKS[args.one](args), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--budget-s", type=float, default=600)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--one", choices=list(CHECKS), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=300, help=argparse.SUPPRESS)
    parser.add_argument("--with-vllm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args)
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP  gpu-smoke: no CUDA GPU here (torch "
              f"{torch.__version__}); `--device cpu` runs the checks on the CPU", flush=True)
        return 0
    from bench.throughput import write_bench_model

    deadline = time.monotonic() + args.budget_s
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as tmp:
        model_dir = str(write_bench_model(Path(tmp) / "model"))
        dtypes = ["float32"] if args.device == "cpu" else ["bfloat16", "float16"]
        plan: list[tuple[str, list[str]]] = [("env", ["--one", "env"])]
        plan += [(f"equivalence-{d}", ["--one", "equivalence", "--dtype", d]) for d in dtypes]
        gpus = torch.cuda.device_count() if args.device == "cuda" else 0
        if gpus >= 2:
            plan.append(("pp2-nccl", ["--one", "equivalence", "--dtype", dtypes[0],
                                      "--pp", "2"]))
        vllm = args.device == "cuda" and _importable("vllm")
        plan.append(("throughput" + ("+vllm" if vllm else ""),
                     ["--one", "throughput", "--dtype", dtypes[0]]
                     + (["--with-vllm"] if vllm else [])))
        # The compiled step (engine.model.compile) on the same prompts: inductor's GPU code.
        plan.append((f"compiled-{dtypes[0]}", ["--one", "equivalence", "--dtype", dtypes[0],
                                                "--compile"]))
        for name, extra in plan:
            left = deadline - time.monotonic()
            if left < 10:
                print(f"SKIP  {name}: the {args.budget_s:.0f} s budget is spent", flush=True)
                continue
            t0 = time.monotonic()
            cmd = [sys.executable, __file__, "--device", args.device, "--model-dir", model_dir,
                   "--num-requests", str(args.num_requests), "--timeout-s", str(left), *extra]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=left,
                                      cwd=ROOT)
                ok, detail = done.returncode == 0, (done.stdout.strip() if done.returncode == 0
                                                    else _last_error(done.stderr))
            except subprocess.TimeoutExpired:
                ok, detail = False, f"over the time left ({left:.0f} s)"
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'}  {name} ({time.monotonic() - t0:.0f} s): "
                  f"{detail}", flush=True)
    print(json.dumps({"failed": failed, "device": args.device}))
    return 1 if failed else 0


def _importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"],
                          capture_output=True).returncode == 0


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return " / ".join(lines[-3:])[-500:] if lines else "failed without a message"


if __name__ == "__main__":
    sys.exit(main())
