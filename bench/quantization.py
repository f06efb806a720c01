"""Weight-only quantization on the default model: quality and speed of none / int8 / int4,
side by side in one run.

Quality, against the float32 path (`none`: the GGUF file dequantized, token-exact against
transformers): over the first `--corpus-tokens` tokens of bench/data/quality_corpus.txt
(teacher-forced, in chunks of `--chunk` tokens), how often the top token agrees, and how far
the log-probability of the float path's top token moves (mean, max); each path's perplexity;
and each path's greedy answers to the README's questions. Speed: one request decoding
(ms per token, after a 256-word prompt) and 16 at once (output tokens per second), through
the whole engine (`LLM.generate`).

    python bench/quantization.py
    python bench/quantization.py --methods none int4 --out bench/results/quantization.json
    python bench/quantization.py --kernels    # also: one matmul of each kind, 1-512 rows
    python bench/quantization.py --kernels-only
    python bench/quantization.py --methods none int4 int4:bfloat16   # and a bfloat16 KV cache

A method may name a KV cache dtype after a colon (`int4:bfloat16`: int4 weights over a
bfloat16 cache, `cache.kv_cache_dtype`; the corpus's K/V are rounded as that cache stores
them); without one the cache is the model's float32.

`--kernels` times one linear layer of the default model's shapes for each kind of weight
(bfloat16 dense, int8, int4; float32 activations in and out, as the model calls them) at
1 to 512 rows: where the packed kernels win, the thresholds `QuantizedLinear` uses without
batch invariance, and what multiplying every batch through them costs with it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from tokenflow.config import EngineConfig
from tokenflow.replica.attention.backends import AttentionMetadata
from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.loading.loader import load_model
from tokenflow.replica.loading.resolve import load_tokenizer, resolve_model
from tokenflow.replica.models.quantized import QuantizedLinear
from tokenflow.scheduler import SamplingParams

MODEL = "smollm2-135m-instruct"
CORPUS = Path(__file__).parent / "data" / "quality_corpus.txt"
# The README's questions (tests/questions.py; tests/cluster/test_quality.py asks them through
# the API).
QUESTIONS = [("What is the capital of France?", "Paris"),
             ("What is the capital of Japan?", "Tokyo"),
             ("What is the capital of Germany?", "Berlin"),
             ("What is 2 + 3?", "5"),
             ("Is Tokyo in Japan? Reply with only the word yes.", "yes")]


def split_method(method: str) -> tuple[str, str]:
    """`int4:bfloat16` -> ("int4", "bfloat16"): the weights' quantization, the KV cache's
    dtype (`auto` where none is named)."""
    weights, _, cache_dtype = method.partition(":")
    return weights, cache_dtype or "auto"


@torch.inference_mode()
def corpus_logprobs(method: str, tokens: list[int], chunk: int) -> torch.Tensor:
    """Log-probabilities [len(tokens) - chunks, vocab] of each next token, chunk by chunk
    (each chunk attends to itself only: the same contexts for every method)."""
    weights, cache_dtype = split_method(method)
    dtype = torch.float32 if cache_dtype == "auto" else getattr(torch, cache_dtype)
    model = load_model(resolve_model(MODEL), dtype=torch.float32, device=torch.device("cpu"),
                       quantization=weights)  # type: ignore[arg-type]
    out = []
    for start in range(0, len(tokens) - 1, chunk):
        ids = tokens[start:start + chunk]
        n = len(ids)
        meta = AttentionMetadata.build(slot_mapping=list(range(n)), block_table=[[0]],
                                       query_start_loc=[0, n], seq_lens=[n], block_size=n)
        cache = [torch.zeros(2, 1, n, model.arch.num_kv_heads, model.arch.head_dim,
                             dtype=dtype) for _ in model.layers]
        hidden, _ = model(torch.tensor(ids), torch.arange(n), cache, meta)
        out.append(torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1))
    return torch.cat(out)


def targets(tokens: list[int], chunk: int) -> torch.Tensor:
    return torch.tensor([t for s in range(0, len(tokens) - 1, chunk)
                         for t in tokens[s + 1:s + chunk]])


def quality(methods: list[str], corpus_tokens: int, chunk: int) -> dict[str, dict]:
    tokens = load_tokenizer(MODEL).encode(CORPUS.read_text(), add_special_tokens=False)
    if len(tokens) < corpus_tokens:
        sys.exit(f"{CORPUS} has {len(tokens)} tokens, fewer than --corpus-tokens")
    tokens = tokens[:corpus_tokens]
    nxt = targets(tokens, chunk)
    reference = corpus_logprobs("none", tokens, chunk)
    top = reference.argmax(dim=-1)
    result = {}
    for method in methods:
        lps = reference if method == "none" else corpus_logprobs(method, tokens, chunk)
        moved = (lps.gather(1, top[:, None]) - reference.gather(1, top[:, None])).abs()
        result[method] = {
            "positions": len(top),
            "top1_agreement": float((lps.argmax(dim=-1) == top).float().mean()),
            "top_logprob_diff_mean": float(moved.mean()),
            "top_logprob_diff_max": float(moved.max()),
            "perplexity": math.exp(-float(lps.gather(1, nxt[:, None]).mean())),
        }
    return result


def engine(method: str) -> LLM:
    weights, cache_dtype = split_method(method)
    config = EngineConfig.model_validate({
        "model": {"model": MODEL, "quantization": weights},
        "cache": {"block_size": 16, "num_blocks": 512, "kv_cache_dtype": cache_dtype},
        "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 64,
                      "max_model_len": 2048}})
    return LLM(config=config)


def speed_and_answers(method: str) -> dict:
    llm = engine(method)
    tok = llm.tokenizer
    # A prompt of its own for each run: no prefix-cache hits.
    words = " ".join(["word"] * 255)
    decode = SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(["warm " + words], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(["first " + words], first, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(["second " + words], decode, use_tqdm=False)
    t2 = time.perf_counter()
    llm.generate([f"batch {i} " + words for i in range(16)], decode, use_tqdm=False)
    t3 = time.perf_counter()
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                        add_special_tokens=False) for q, _ in QUESTIONS]
    outs = llm.generate(chats, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    answers = [o.outputs[0].text for o in outs]
    right = sum(word.lower() in a.lower() for (_, word), a in zip(QUESTIONS, answers,
                                                                 strict=True))
    llm.shutdown()
    return {"prefill_256_words_ms": (t1 - t0) * 1e3,
            "decode_ms_per_token_c1": ((t2 - t1) - (t1 - t0)) / 64 * 1e3,
            "output_tok_s_c16": 16 * 65 / (t3 - t2),
            "answers": answers, "answers_right": right}


def kernels() -> dict[str, dict[int, dict[str, float]]]:
    """µs per call of one linear layer, by shape, rows and kind of weight."""
    shapes = {"gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536),
              "head 49152x576": (49152, 576)}
    gen = torch.Generator().manual_seed(0)
    result: dict[str, dict[int, dict[str, float]]] = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen) * 0.02
        layers = {"float32": lambda x, w=w: torch.nn.functional.linear(x, w),
                  "bf16": lambda x, d=w.bfloat16(): torch.nn.functional.linear(
                      x.bfloat16(), d).float(),
                  "int8": QuantizedLinear.int8(w), "int4": QuantizedLinear.int4(w)}
        result[name] = {}
        for rows in (1, 2, 4, 8, 16, 32, 256, 512):
            x = torch.randn(rows, k, generator=gen)
            result[name][rows] = {kind: _time_us(lambda f=f, x=x: f(x))
                                  for kind, f in layers.items()}
            print(f"{name:<18}{rows:>5} rows  " + "  ".join(
                f"{kind} {us:8.1f}" for kind, us in result[name][rows].items()) + "  µs",
                flush=True)
    return result


def _time_us(call, min_s: float = 0.2) -> float:
    for _ in range(3):
        call()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        call()
        n += 1
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--corpus-tokens", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=500)
    parser.add_argument("--kernels", action="store_true", help="also time single matmuls")
    parser.add_argument("--kernels-only", action="store_true", help="only time them")
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    args = parser.parse_args()

    kernel_times = kernels() if args.kernels or args.kernels_only else None
    if args.kernels_only:
        if args.out:
            args.out.write_text(json.dumps({"kernels_us": kernel_times}, indent=2))
        return

    print(f"quality over {args.corpus_tokens} corpus tokens ...", flush=True)
    result = quality(args.methods, args.corpus_tokens, args.chunk)
    for method in args.methods:
        print(f"speed and answers: {method} ...", flush=True)
        result[method].update(speed_and_answers(method))
    base = result.get("none", {}).get("decode_ms_per_token_c1")
    print(f"\n{'method':<14}{'top-1 agree':>12}{'Δlogprob mean':>15}{'max':>8}{'ppl':>8}"
          f"{'prefill ms':>12}{'decode ms/tok':>15}{'vs none':>9}{'c16 tok/s':>11}"
          f"{'answers':>9}")
    for method in args.methods:
        r = result[method]
        ratio = f"{base / r['decode_ms_per_token_c1']:.2f}x" if base else "-"
        print(f"{method:<14}{r['top1_agreement']:>12.1%}{r['top_logprob_diff_mean']:>15.4f}"
              f"{r['top_logprob_diff_max']:>8.3f}{r['perplexity']:>8.2f}"
              f"{r['prefill_256_words_ms']:>12.1f}{r['decode_ms_per_token_c1']:>15.1f}"
              f"{ratio:>9}{r['output_tok_s_c16']:>11.1f}"
              f"{r['answers_right']:>6}/{len(QUESTIONS)}")
    for method in args.methods:
        print(f"{method}: {result[method]['answers']}")
    if args.out:
        args.out.write_text(json.dumps({"model": MODEL, "threads": torch.get_num_threads(),
                                        "args": {k: str(v) for k, v in vars(args).items()},
                                        "result": result, "kernels_us": kernel_times},
                                       indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
