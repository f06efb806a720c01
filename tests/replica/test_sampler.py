"""Sampler: greedy and filtered sampling, seeded determinism, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tokenflow.replica.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    draw_from_cdf,
    mix_seed,
)
from tokenflow.scheduler.sampling_params import SamplingParams

VOCAB = 1000


def _meta(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
) -> SamplingMetadata:
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[1, 2, 3] for _ in params]
    return SamplingMetadata.build(params, outputs, prompts, "cpu")


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0, **kw) -> list[int]:
    return Sampler(seed=seed)(logits, _meta(params, **kw)).sampled_token_ids.tolist()


def test_greedy_is_argmax_and_skips_work() -> None:
    logits = _logits(6)
    meta = _meta([SamplingParams(temperature=0.0) for _ in range(6)])
    assert meta.all_greedy and meta.no_penalties
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.max_num_logprobs is None
    out = Sampler(seed=0)(logits, meta)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_k=1, top_p=0.9),
     SamplingParams(min_p=1.0), SamplingParams(temperature=1e-3, top_k=50)],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(8, seed=3)
    assert _sample(logits, [params] * 8) == logits.argmax(-1).tolist()


def test_greedy_rows_mixed_with_sampled_rows() -> None:
    logits = _logits(8, seed=4)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(8)]
    meta = _meta(params)
    assert not meta.all_greedy and not meta.all_random
    tokens = Sampler(seed=1)(logits, meta).sampled_token_ids.tolist()
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in range(0, 8, 2)] == [argmax[i] for i in range(0, 8, 2)]
    assert [tokens[i] for i in range(1, 8, 2)] != [argmax[i] for i in range(1, 8, 2)]


def test_min_p_filters_low_probability_tokens() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    filtered = apply_min_p(probs.log(), torch.tensor([0.35]))
    assert torch.isinf(filtered[0, 2:]).all() and torch.isfinite(filtered[0, :2]).all()
    logits = probs.log().repeat(400, 1)
    tokens = _sample(logits, [SamplingParams(min_p=0.35)] * 400)
    assert set(tokens) == {0, 1}


def test_top_k_top_p_masks() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]).log()
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.5, 0.5]))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False], [False, False, True, True]]
    # Row 0 uses top-k=3, row 1 has it off (k beyond the vocabulary).
    kept = apply_top_k_top_p(logits, torch.tensor([3, 1 << 30]), None, max_top_k=3)
    assert torch.isfinite(kept).tolist() == [[True, True, True, False], [True] * 4]
    kept = apply_top_k_top_p(logits, torch.tensor([3, 2]), torch.tensor([0.75, 1.0]), max_top_k=3)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False], [False, False, True, True]]


def _frequencies(tokens: list[int], n: int) -> list[float]:
    return [tokens.count(i) / len(tokens) for i in range(n)]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), [0.1, 0.2, 0.3, 0.4]),
        (SamplingParams(temperature=0.5), [1 / 30, 4 / 30, 9 / 30, 16 / 30]),
        (SamplingParams(top_k=2), [0.0, 0.0, 3 / 7, 4 / 7]),
        (SamplingParams(top_p=0.65), [0.0, 0.0, 3 / 7, 4 / 7]),
    ],
)
def test_empirical_distribution(params: SamplingParams, expected: list[float]) -> None:
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().repeat(2000, 1)
    freqs = _frequencies(_sample(logits, [params] * 2000, seed=123), 4)
    assert freqs == pytest.approx(expected, abs=0.04)


def test_the_cdf_maps_each_uniform_to_its_token() -> None:
    """Uniform over 1,000 tokens (four blocks of the two-level CDF, the last one partial):
    u in [k / 1000, (k + 1) / 1000) is token k, across block edges too."""
    probs = torch.full((1, 1000), 1e-3)
    for k in (0, 1, 255, 256, 511, 767, 768, 998, 999):
        for u in (k / 1000 + 1e-7, (k + 1) / 1000 - 1e-7):
            assert draw_from_cdf(probs, torch.tensor([u], dtype=torch.float64)).item() == k


def test_the_cdf_never_draws_a_token_of_probability_zero() -> None:
    """Zeros inside, before and after the mass (top-k / top-p leave such rows), at the edges
    of u's range."""
    probs = torch.zeros(3, 49152)
    probs[0, 300] = 1.0
    probs[1, [0, 49151]] = 0.5
    probs[2, 256:512] = 1 / 256
    us = torch.tensor([0.0, 0.5, 1 - 2**-53], dtype=torch.float64)
    for u in us:
        tokens = draw_from_cdf(probs, u.repeat(3)).tolist()
        assert tokens[0] == 300 and tokens[1] in (0, 49151) and 256 <= tokens[2] < 512
    assert draw_from_cdf(probs[1:2], us[:1]).item() == 0
    assert draw_from_cdf(probs[1:2], us[2:]).item() == 49151


def test_the_cdf_is_exact_to_a_millionth_over_a_large_vocabulary() -> None:
    """After 49,151 tokens holding 98%, the last one's 2% starts at u = 0.98: the two levels
    put the boundary there within a millionth."""
    probs = torch.full((1, 49152), 0.98 / 49151)
    probs[0, -1] = 0.02
    below, above = (torch.tensor([x], dtype=torch.float64) for x in (0.98 - 1e-6, 0.98 + 1e-6))
    assert draw_from_cdf(probs, below).item() == 49150
    assert draw_from_cdf(probs, above).item() == 49151


def test_seeded_rows_follow_the_distribution() -> None:
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().repeat(2000, 1)
    params = [SamplingParams(seed=s) for s in range(2000)]
    freqs = _frequencies(_sample(logits, params), 4)
    assert freqs == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=0.04)


def test_seeded_row_independent_of_batch_and_sampler() -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone, batched = [], []
    for step in range(20):
        row = _logits(1, seed=100 + step)
        outputs = [list(range(step))]
        alone += _sample(row, [seeded], seed=0, outputs=outputs)
        others = _logits(8, seed=200 + step)
        others[5] = row[0]
        params = [SamplingParams(temperature=0.7, top_k=20) for _ in range(8)]
        params[5] = seeded
        outs = [[7] * (step + i) for i in range(8)]
        outs[5] = outputs[0]
        batched.append(_sample(others, params, seed=step, outputs=outs)[5])
    assert alone == batched
    assert len(set(alone)) > 5  # really sampled, not greedy


def test_seeded_draw_depends_on_seed_and_position_only() -> None:
    logits = _logits(1, seed=9).repeat(64, 1)
    # A recomputed request samples position p again: same (seed, p), same token.
    first = _sample(logits[:1], [SamplingParams(seed=5)], outputs=[[1, 2, 3]])
    again = _sample(logits[:1], [SamplingParams(seed=5)], seed=99, outputs=[[4, 5, 6]])
    assert first == again
    outputs = [[0] * p for p in range(64)]
    by_position = _sample(logits, [SamplingParams(seed=5)] * 64, outputs=outputs)
    assert len(set(by_position)) > 10
    assert mix_seed(5, 3) != mix_seed(3, 5) and 0 <= mix_seed(2**63, 2**40) < 2**64


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
        logprobs=4,
    )
    meta = _meta([params], outputs=[[1, 1, 3]], prompts=[[0, 0]])
    # Repetition (prompt and output): 2 -> 1, -1 -> -2, 3 -> 1.5. Then on output tokens only:
    # token 1 (twice): -2 - 2 * 0.5 - 0.25; token 3 (once): 1.5 - 0.5 - 0.25.
    expected = torch.tensor([1.0, -3.25, 0.5, 0.75, 0.0])
    out = Sampler(seed=0)(logits, meta)
    assert out.sampled_token_ids.tolist() == [0]
    lp = out.logprobs[0]
    assert lp is not None
    want = expected.log_softmax(-1)
    assert lp.token_ids == [0, 0, 3, 2, 4]
    assert lp.logprobs == pytest.approx([want[i].item() for i in lp.token_ids], abs=1e-6)
    assert lp.sampled_rank == 1
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, 0.0]]  # the caller's logits untouched


def test_penalties_apply_per_row() -> None:
    logits = torch.zeros(2, 4)
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=0), SamplingParams(
        temperature=0.0, logprobs=0)]
    meta = _meta(params, outputs=[[0, 1, 2], [0, 1, 2]])
    assert meta.prompt_token_ids is None  # no row uses the repetition penalty
    assert Sampler(seed=0)(logits, meta).sampled_token_ids.tolist() == [3, 0]


def test_logprobs_are_raw_sorted_and_ranked() -> None:
    logits = _logits(6, seed=11)
    params = [SamplingParams(temperature=2.0, top_k=50, logprobs=5), SamplingParams(logprobs=0),
              SamplingParams(), SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(seed=3, logprobs=20), SamplingParams(top_p=0.5, logprobs=1)]
    meta = _meta(params)
    assert meta.max_num_logprobs == 20
    out = Sampler(seed=2)(logits, meta)
    assert out.logprobs is not None
    full = logits.log_softmax(-1)
    assert math.isclose(full.exp().sum(-1)[0].item(), 1.0, rel_tol=1e-5)
    sampled = out.sampled_token_ids.tolist()
    for row, (p, lp) in enumerate(zip(params, out.logprobs, strict=True)):
        if p.logprobs is None:
            assert lp is None
            continue
        assert lp is not None
        assert len(lp.token_ids) == len(lp.logprobs) == p.logprobs + 1
        assert lp.token_ids[0] == sampled[row]
        # Raw: the log_softmax of the logits before temperature and filters.
        assert lp.logprobs[0] == pytest.approx(full[row, sampled[row]].item(), abs=1e-5)
        top = full[row].topk(p.logprobs)
        assert lp.token_ids[1:] == top.indices.tolist()
        assert lp.logprobs[1:] == sorted(lp.logprobs[1:], reverse=True)
        assert lp.sampled_rank == int((full[row] > full[row, sampled[row]]).sum()) + 1
    assert out.logprobs[3] is not None and out.logprobs[3].sampled_rank == 1


def test_sampled_rank_of_an_unlikely_token() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    meta = _meta([SamplingParams(logprobs=2)])
    meta.temperature = torch.tensor([1000.0])  # nearly uniform, to draw a low-ranked token
    ranks = {}
    sampler = Sampler(seed=0)
    for _ in range(50):
        out = sampler(logits, meta)
        token = out.sampled_token_ids.item()
        ranks[token] = out.logprobs[0].sampled_rank
    assert ranks == {t: t + 1 for t in ranks} and len(ranks) >= 4


def test_build_validates_lengths() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        SamplingMetadata.build([SamplingParams()], [], [[1]], "cpu")
