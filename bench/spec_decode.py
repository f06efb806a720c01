"""Speculative decoding (n-gram drafts) on and off, side by side in one run, on the default
model (SmolLM2-135M-Instruct, greedy): a repetitive workload (the model is asked to repeat or
lightly edit a given text, so its output copies the prompt) and a random one (open questions).

Reports per workload and setting: throughput (output tokens / s), inter-token latency p50/p99
(time between successive tokens of a request, as a client sees them: a step that accepts
drafts delivers several tokens at once), the draft acceptance rate and mean accepted length,
and whether the greedy outputs are identical.

    python bench/spec_decode.py --requests 4 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from tokenflow.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenflow.replica.engine.engine import Engine
from tokenflow.scheduler import SamplingParams

TEXT = (
    "The river ran quietly past the old mill, where children once watched the wheel turn "
    "from morning until evening. In the summer the water was low and warm; in the winter it "
    "froze at the edges, and the village gathered on the bridge to watch the ice break."
)
REPETITIVE = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Copy this paragraph, changing 'river' to 'stream':\n\n{TEXT}",
    f"Rewrite the text below without changing anything:\n\n{TEXT}",
    f"Quote this back to me:\n\n{TEXT}",
]
RANDOM = [
    "Write a short poem about the sea.",
    "Give three tips for learning to cook.",
    "Describe a busy market in the morning.",
    "Explain why the sky looks blue.",
]


def _run(engine: Engine, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    tokenizer = engine.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    stamps: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        engine.add_request(str(i), tokenizer.encode(chat, add_special_tokens=False), params)
    before = dataclass_copy(engine.totals)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            for c in out.outputs:
                stamps.setdefault(out.request_id, []).extend([now] * len(c.token_ids))
                tokens.setdefault(out.request_id, []).extend(c.token_ids)
    elapsed = time.perf_counter() - t0
    gaps = sorted(b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False))
    totals = engine.totals
    drafted = totals.num_draft_tokens - before["num_draft_tokens"]
    accepted = totals.num_accepted_tokens - before["num_accepted_tokens"]
    steps = totals.num_drafts - before["num_drafts"]
    return {
        "tok_per_s": sum(map(len, tokens.values())) / elapsed,
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_per_step": accepted / steps if steps else 0.0,
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
    }


def dataclass_copy(stats: Any) -> dict[str, Any]:
    return {k: getattr(stats, k) for k in ("num_draft_tokens", "num_accepted_tokens", "num_drafts")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step at most")
    p.add_argument("--out", help="write the result JSON to this file")
    args = p.parse_args(argv)
    engines = {
        name: Engine(
            EngineConfig(
                model=ModelConfig(model=args.model),
                scheduler=SchedulerConfig(max_model_len=1024),
                speculative=SpeculativeConfig(method=method, num_speculative_tokens=args.k),
            )
        )
        for name, method in (("off", None), ("ngram", "ngram"))
    }
    result: dict[str, Any] = {}
    for workload, prompts in (("repetitive", REPETITIVE), ("random", RANDOM)):
        prompts = (prompts * args.requests)[: args.requests]
        runs = {name: _run(engine, prompts, args.max_tokens) for name, engine in engines.items()}
        identical = runs["off"].pop("tokens") == runs["ngram"].pop("tokens")
        result[workload] = {
            **runs,
            "identical": identical,
            "speedup": runs["ngram"]["tok_per_s"] / runs["off"]["tok_per_s"],
        }
        off, on = runs["off"], runs["ngram"]
        print(
            f"{workload}: {off['tok_per_s']:.1f} -> {on['tok_per_s']:.1f} tok/s "
            f"({result[workload]['speedup']:.2f}x); ITL p50 {off['itl_p50_ms']:.0f} -> "
            f"{on['itl_p50_ms']:.0f} ms, p99 {off['itl_p99_ms']:.0f} -> "
            f"{on['itl_p99_ms']:.0f} ms; acceptance {100 * on['acceptance_rate']:.0f}% "
            f"({on['mean_accepted_per_step']:.2f} tokens a step); identical: {identical}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
