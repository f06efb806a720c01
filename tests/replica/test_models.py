"""Models through the paged attention backend against Hugging Face transformers (float32).

`Paging` stands in for the model runner: it hands out shuffled blocks per request, builds the
flat varlen batch and its `AttentionMetadata`, and keeps one KV cache per stage.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.checkpoints import FAMILIES, write_checkpoint
from tokenflow.replica.attention import backends as attention
from tokenflow.replica.attention.backends import (
    AttentionMetadata,
    TorchAttentionBackend,
    select_backend,
)
from tokenflow.replica.loading.loader import load_model
from tokenflow.replica.models import CausalLM

BLOCK_SIZE = 4
COMBOS = [(family, tied) for family in FAMILIES for tied in (False, True)]
IDS = [f"{family}-{'tied' if tied else 'untied'}" for family, tied in COMBOS]
CPU = torch.device("cpu")
Combo = tuple[Path, CausalLM, torch.nn.Module]  # checkpoint dir, our model, the HF model


@dataclass
class Paging:
    """Block allocation and per-step batch building for a few requests, like a tiny runner."""

    models: list[CausalLM]
    num_blocks: int = 64
    seed: int = 0
    blocks: dict[str, list[int]] = field(default_factory=dict)
    num_cached: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)  # scattered blocks, as after churn
        arch = self.models[0].arch
        shape = (2, self.num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
        self.caches = [[torch.zeros(shape) for _ in m.layers] for m in self.models]

    def share_prefix(self, req: str, donor: str, num_blocks: int) -> None:
        """A prefix-cache hit: `req` starts with `donor`'s first full blocks."""
        self.blocks[req] = list(self.blocks[donor][:num_blocks])
        self.num_cached[req] = num_blocks * BLOCK_SIZE

    def step(self, chunks: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Run each request's new tokens through all stages; returns all their logits [T, V]."""
        ids, pos, slots, qsl, seq_lens, table = [], [], [], [0], [], []
        for req, tokens in chunks:
            start = self.num_cached.get(req, 0)
            end = start + len(tokens)
            own = self.blocks.setdefault(req, [])
            while len(own) * BLOCK_SIZE < end:
                own.append(self.free.pop())
            ids += tokens
            pos += range(start, end)
            slots += [own[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            table.append(own)
            self.num_cached[req] = end
        width = max(len(row) for row in table)
        table = [row + [-1] * (width - len(row)) for row in table]  # -1: padding, never read
        meta = AttentionMetadata.build(
            slot_mapping=slots,
            block_table=table,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_size=BLOCK_SIZE,
        )
        hidden = residual = None
        input_ids, positions = torch.tensor(ids), torch.tensor(pos)
        with torch.inference_mode():
            for model, caches in zip(self.models, self.caches, strict=True):
                hidden, residual = model(input_ids, positions, caches, meta, hidden, residual)
            return self.models[-1].compute_logits(hidden)


@pytest.fixture(scope="module", params=COMBOS, ids=IDS)
def combo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Combo:
    """(checkpoint dir, our model, the HF model) for one family and tying."""
    import transformers

    family, tied = request.param
    path = write_checkpoint(tmp_path_factory.mktemp("ckpt"), family, tie_word_embeddings=tied)
    ours = load_model(path, dtype=torch.float32, device=CPU)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, ours, hf


def prompt(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 512), k=n)


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


def test_prefill_logits_match_hf(combo: Combo) -> None:
    _, ours, hf = combo
    tokens = prompt(13, seed=1)
    logits = Paging([ours]).step([("a", tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_greedy_decode_matches_hf_generate(combo: Combo) -> None:
    _, ours, hf = combo
    tokens, steps = prompt(9, seed=2), 6
    paging, generated = Paging([ours]), []
    logits = paging.step([("a", tokens)])
    for _ in range(steps):
        generated.append(int(logits[-1].argmax()))
        logits = paging.step([("a", generated[-1:])])
    with torch.inference_mode():
        expected = hf.generate(
            torch.tensor([tokens]),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,  # never stop early: compare all steps
            pad_token_id=0,
        )[0, len(tokens) :]
    assert generated == expected.tolist()


def test_mixed_batch_equals_each_request_alone(combo: Combo) -> None:
    """Decodes, a fresh prompt, a chunk and a prefix hit in one step, decodes not leading."""
    _, ours, _ = combo
    a, b, c, e = (prompt(n, seed=10 + i) for i, n in enumerate((10, 7, 11, 5)))
    d = a[:8] + prompt(4, seed=20)  # shares a's first two blocks
    paging = Paging([ours])
    paging.step([("a", a[:-1]), ("c", c[:6]), ("e", e[:-1])])
    paging.share_prefix("d", donor="a", num_blocks=2)
    mixed = paging.step([("b", b), ("a", a[-1:]), ("c", c[6:]), ("d", d[8:]), ("e", e[-1:])])
    alone = torch.cat(
        [
            Paging([ours], seed=7).step([(r, t)])[-n:]
            for r, t, n in (("b", b, len(b)), ("a", a, 1), ("c", c, 5), ("d", d, 4), ("e", e, 1))
        ]
    )
    torch.testing.assert_close(mixed, alone, atol=1e-4, rtol=0)


def test_two_stage_split_equals_one_stage(combo: Combo) -> None:
    path, ours, _ = combo
    stages = [
        load_model(path, dtype=torch.float32, device=CPU, layer_range=r) for r in ((0, 1), (1, 2))
    ]
    assert stages[0].is_first_stage and not stages[0].is_last_stage and stages[1].is_last_stage
    tokens = prompt(9, seed=3)
    whole, split = Paging([ours]), Paging(stages)
    torch.testing.assert_close(
        split.step([("a", tokens)]), whole.step([("a", tokens)]), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        split.step([("a", [5])]), whole.step([("a", [5])]), atol=1e-5, rtol=0
    )


def _reference_attention(
    q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float
) -> torch.Tensor:
    """Naive causal attention of the last len(q) positions; K/V heads repeated (oracle only)."""
    group = q.shape[1] // k_ctx.shape[1]
    k, v = k_ctx.repeat_interleave(group, 1), v_ctx.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    offset = k.shape[0] - q.shape[0]
    causal = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + offset
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("gather_bytes", [None, 1], ids=["one-group", "group-per-decode"])
def test_torch_backend_matches_naive_attention(
    gather_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random q/k/v, GQA 4:2, decodes first, a chunk over several blocks; twice (buffer reuse)."""
    if gather_bytes is not None:
        monkeypatch.setattr(attention, "_GATHER_BYTES", gather_bytes)
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, num_blocks = 4, 2, 8, 16
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, kv_heads, dim)
    contexts = {
        r: torch.randn(2, n, kv_heads, dim, generator=gen)
        for r, n in (("x", 6), ("y", 9), ("z", 13))
    }
    qlens = {"x": 1, "y": 1, "z": 5}
    blocks = {"x": [3, 9], "y": [0, 12, 5], "z": [15, 2, 7, 1]}
    backend = TorchAttentionBackend()
    for _ in range(2):
        slots, table, qsl, seq_lens, qs, ks, vs = [], [], [0], [], [], [], []
        for r, ctx in contexts.items():
            n, new = ctx.shape[1], qlens[r]
            for p in range(n - new):  # earlier context already cached
                cache[:, blocks[r][p // BLOCK_SIZE], p % BLOCK_SIZE] = ctx[:, p]
            slots += [
                blocks[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n - new, n)
            ]
            table.append(blocks[r] + [0] * (4 - len(blocks[r])))
            qsl.append(qsl[-1] + new)
            seq_lens.append(n)
            qs.append(torch.randn(new, heads, dim, generator=gen))
            ks.append(ctx[0, n - new :])
            vs.append(ctx[1, n - new :])
        meta = AttentionMetadata.build(
            slot_mapping=slots,
            block_table=table,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_size=BLOCK_SIZE,
        )
        assert meta.decodes_lead and meta.num_decodes == 2 and len(meta.prefills) == 1
        out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, 0.3)
        expected = torch.cat(
            [
                _reference_attention(q, ctx[0], ctx[1], 0.3)
                for q, ctx in zip(qs, contexts.values(), strict=True)
            ]
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_select_backend_is_torch_without_flash_attn() -> None:
    assert isinstance(select_backend(CPU), TorchAttentionBackend)
    if importlib.util.find_spec("flash_attn") is None:
        assert isinstance(select_backend("cuda"), TorchAttentionBackend)
