"""The compiled step (replica/worker/compile.py): the same greedy tokens as eager PyTorch, and
every graph compiled at startup, none while serving."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys

import torch
from torch._dynamo.utils import counters

from tokenflow.replica.attention.backends import AttentionMetadata
from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.loading.loader import load_model
from tokenflow.replica.worker.compile import compile_step
from tokenflow.scheduler import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Single requests and batches of 2-8 and more decodes, prompts of 3-70 tokens, two of
    them sharing a prefix (a prefix hit, then a chunk over cached blocks)."""
    rng = random.Random(0)
    shared = rng.choices(range(3, 500), k=40)
    out = [rng.choices(range(3, 500), k=rng.randint(3, 70)) for _ in range(10)]
    return out + [shared + [7, 8, 9], shared + [10, 11]]


def run(quantization: str, compile: bool) -> tuple[list[list[int]], int]:
    """Each prompt alone, then all at once; and the graphs compiled after startup."""
    llm = LLM("tokenflow-tiny", quantization=quantization, compile=compile,
              max_num_batched_tokens=64, num_blocks=256)
    compiled_at_start = counters["stats"]["unique_graphs"]
    try:
        alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts()[:2]]
        together = llm.generate(prompts(), GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in [*alone, *together]]
    return tokens, counters["stats"]["unique_graphs"] - compiled_at_start


def test_compiled_float32_step_gives_the_eager_tokens_and_compiles_only_at_start() -> None:
    eager, _ = run("none", compile=False)
    compiled, compiled_later = run("none", compile=True)
    assert compiled == eager
    assert compiled_later == 0


def test_compiled_int4_step_stays_within_bfloat16_rounding_of_eager() -> None:
    """The quantized layers take bfloat16 inputs: where inductor's fused norm rounds a value
    to the other side of a bfloat16 step, a near-tie can flip, so the int4 path is compared by
    its logits (a prompt, then 1, 4 and 12 decodes at once), not its tokens."""
    model = load_model("tokenflow-tiny", dtype=torch.float32, device=torch.device("cpu"),
                       quantization="int4")
    arch = model.arch
    caches = [torch.zeros(2, 120, 4, arch.num_kv_heads, arch.head_dim) for _ in model.layers]
    rng = random.Random(1)
    # (query lengths, context lengths) of each step; request r owns blocks 10r .. 10r + 9.
    steps = [([30], [30]), ([1], [31]), ([1] * 4, [32] * 4), ([1] * 12, [33] * 12)]

    def logits() -> list[torch.Tensor]:
        out = []
        for cache in caches:
            cache.zero_()
        for query_lens, seq_lens in steps:
            table = [[r * 10 + i for i in range(10)] for r in range(len(query_lens))]
            spans = [(r, p) for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
                     for p in range(s - q, s)]
            meta = AttentionMetadata.build(
                slot_mapping=[table[r][p // 4] * 4 + p % 4 for r, p in spans],
                block_table=table, seq_lens=seq_lens, block_size=4,
                query_start_loc=[0, *itertools.accumulate(query_lens)])
            ids = torch.tensor([rng.randrange(3, 500) for _ in spans])
            positions = torch.tensor([p for _, p in spans])
            with torch.inference_mode():
                hidden, _ = model(ids, positions, caches, meta)
                out.append(model.compute_logits(hidden))
        return out

    rng.seed(1)
    eager = logits()
    compile_step(model, caches, 64)
    rng.seed(1)
    for got, want in zip(logits(), eager, strict=True):
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def test_inductor_s_cache_is_tokenflow_s(tmp_path) -> None:
    """A new process compiles into `$TOKENFLOW_CACHE_DIR/inductor` (importing dynamo sets
    TORCHINDUCTOR_CACHE_DIR to torch's /tmp default first), so a restart finds its graphs
    there."""
    code = ("from tokenflow.replica.engine.llm import LLM; "
            "LLM('tokenflow-tiny', compile=True, num_blocks=64).shutdown()")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TOKENFLOW_CACHE_DIR"] = str(tmp_path)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True,
                   timeout=600)
    assert any((tmp_path / "inductor").rglob("*.py"))
