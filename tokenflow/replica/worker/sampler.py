"""Token sampling for one step: penalties, logprobs, greedy and random rows, seeded rows.

Order, per row: penalties (repetition, then frequency and presence) -> logprobs -> stop tokens
masked until `min_tokens` -> greedy argmax or temperature -> min_p -> top_k -> top_p -> sample.

Logprobs are "raw" in vLLM's sense, taken after the penalties: log_softmax of the penalized
logits, BEFORE temperature and the top-k/top-p/min-p filters. They therefore describe the
model's distribution, not the one the token was drawn from, and a greedy row's logprobs are the
same as a sampled row's.

Sampling inverts the distribution's CDF: one uniform u per row, and the token i whose
cumulative probability first exceeds u times the row's total, which draws i with probability
p_i. One random number a row, not one per vocabulary entry: torch's exponential noise for an
exponential race (vLLM's way) cost 1.4 ms a row over a 49k vocabulary on the CPU, 20 ms for a
step of 16; this costs 0.06 and 0.2 ms. The CDF is found in two levels (sums of blocks of
`_CDF_BLOCK` tokens, then the cumulative sum inside the one block that holds u), summed in
float64. A seeded row draws its u
from a generator seeded by (seed, output position) alone, so its tokens do not depend on the
rest of the batch, nor on whether it was preempted and recomputed. (CPU and CUDA generators
differ: the same seed gives the same tokens on the same kind of device.) Unseeded rows share
the sampler's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenflow.scheduler import TokenLogprobs
from tokenflow.scheduler.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Tokens per block of the two-level CDF: its block sums and one block's running sum are short.
_CDF_BLOCK = 256


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, as tensors built once from the batch's params.

    An optional tensor is None when no row needs that step, so the sampler skips it.
    """

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows (they take the argmax)
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [B] float32, 1.0 where off
    top_k: torch.Tensor | None  # [B] int64, vocab-wide where off (clamped at use)
    max_top_k: int  # largest k of a row that uses top_k, for a partial sort without a sync
    min_p: torch.Tensor | None  # [B] float32, 0.0 where off
    no_penalties: bool
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    repetition_penalty: torch.Tensor | None  # [B] float32
    output_token_ids: torch.Tensor | None  # [B, max_out] int64, padded with -1
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt] int64, padded with -1
    max_num_logprobs: int | None  # largest `logprobs` asked for; None: no row wants any
    num_logprobs: list[int | None]  # per row
    seeds: list[int | None]  # per row
    output_positions: list[int]  # per row: index of the output token being sampled
    # (rows, token ids) that may not be sampled yet: EOS and stop ids before `min_tokens`.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        device: torch.device | str = "cpu",
        eos_token_ids: list[int | None] | None = None,
    ) -> SamplingMetadata:
        """Build from the batch's rows, in row order: their params, outputs so far, prompts and
        (for `min_tokens`) their EOS ids."""
        if not (len(params) == len(output_token_ids) == len(prompt_token_ids)):
            raise ValueError("params, output_token_ids and prompt_token_ids differ in length")
        greedy = [p.greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def if_any(values: list[float], off: float) -> torch.Tensor | None:
            return floats(values) if any(v != off for v in values) else None

        ks = [p.top_k for p in params if p.top_k > 0]
        top_k = [p.top_k if p.top_k > 0 else 1 << 30 for p in params]
        no_penalties = all(
            p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1
            for p in params
        )

        def per_row(name: str) -> torch.Tensor | None:
            return None if no_penalties else floats([getattr(p, name) for p in params])

        wants_prompt = any(p.repetition_penalty != 1 for p in params)
        num_logprobs = [p.logprobs for p in params]
        asked = [n for n in num_logprobs if n is not None]
        return cls(
            temperature=floats(temperature),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=if_any([p.top_p for p in params], 1.0),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device) if ks else None,
            max_top_k=max(ks, default=0),
            min_p=if_any([p.min_p for p in params], 0.0),
            no_penalties=no_penalties,
            presence_penalty=per_row("presence_penalty"),
            frequency_penalty=per_row("frequency_penalty"),
            repetition_penalty=per_row("repetition_penalty"),
            output_token_ids=None if no_penalties else _pad(output_token_ids, device),
            prompt_token_ids=_pad(prompt_token_ids, device) if wants_prompt else None,
            max_num_logprobs=max(asked) if asked else None,
            num_logprobs=num_logprobs,
            seeds=[p.seed for p in params],
            output_positions=[len(out) for out in output_token_ids],
            banned=_min_tokens_bans(params, output_token_ids, eos_token_ids, device),
        )


def _min_tokens_bans(params: list[SamplingParams], output_token_ids: list[list[int]],
                     eos_token_ids: list[int | None] | None, device: torch.device | str
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs of the stop tokens of rows still short of their `min_tokens`, as HF's
    `min_new_tokens` and vLLM mask them: such a token is never sampled, not sampled and then
    ignored."""
    rows: list[int] = []
    cols: list[int] = []
    for row, p in enumerate(params):
        if p.min_tokens and len(output_token_ids[row]) < p.min_tokens:
            stops = set(p.stop_token_ids)
            eos = eos_token_ids[row] if eos_token_ids else None
            if eos is not None and not p.ignore_eos:
                stops.add(eos)
            rows.extend([row] * len(stops))
            cols.extend(stops)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(cols, dtype=torch.int64, device=device))


@dataclass
class SamplerOutput:
    """One step's sampled token per row and, when any row asked, its logprobs (None elsewhere)."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: list[TokenLogprobs | None] | None


class Sampler:
    """Owns the generator of unseeded rows and turns a step's logits into tokens."""

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        """`device` is where the logits live: generators are per device type."""
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # Re-seeded for every seeded row: one object, no allocation per row.
        self._row_generator = torch.Generator(device=self.device)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V] (float32)."""
        if logits.device.type != self.device.type:
            raise ValueError(f"logits on {logits.device}, but this sampler is for {self.device}")
        logits = logits.float()
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        raw_logprobs = None if meta.max_num_logprobs is None else logits.log_softmax(dim=-1)
        if meta.banned is not None:
            logits = logits.index_put(meta.banned, torch.tensor(float("-inf"),
                                                                device=logits.device))
        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        elif meta.all_random:
            sampled = self._sample(logits, meta)
        else:
            sampled = torch.where(meta.greedy, logits.argmax(dim=-1), self._sample(logits, meta))
        logprobs = None if raw_logprobs is None else gather_logprobs(raw_logprobs, sampled, meta)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits / meta.temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k)
        return draw_from_cdf(logits.softmax(dim=-1), self._uniforms(logits, meta))

    def _uniforms(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One float64 uniform in [0, 1) per row: a seeded row's from its (seed, position)."""
        u = torch.rand(logits.shape[0], generator=self.generator, dtype=torch.float64,
                       device=logits.device)
        for row, seed in enumerate(meta.seeds):
            if seed is not None:
                self._row_generator.manual_seed(mix_seed(seed, meta.output_positions[row]))
                u[row] = torch.rand(1, generator=self._row_generator, dtype=torch.float64,
                                    device=logits.device)[0]
        return u


def draw_from_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of probs [B, V], the token i with cdf(i - 1) <= u * total < cdf(i), u [B] in
    [0, 1): token i with probability p_i / total, never a token of probability 0."""
    batch, vocab = probs.shape
    pad = -vocab % _CDF_BLOCK
    blocks = F.pad(probs, (0, pad)).view(batch, -1, _CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [B, blocks]
    target = u.unsqueeze(1) * block_cdf[:, -1:]  # [B, 1]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, block.unsqueeze(-1).expand(batch, 1, _CDF_BLOCK)).squeeze(1)
    offset = torch.searchsorted(inside.double().cumsum(dim=-1), target - before, right=True)
    token = (block * _CDF_BLOCK + offset.clamp_(max=_CDF_BLOCK - 1)).clamp_(max=vocab - 1)
    # The two levels' sums may round apart by an ulp and land on a token of probability 0
    # (odds ~1e-16): the row's most likely token instead.
    return torch.where(probs.gather(1, token) > 0, token, probs.argmax(dim=-1, keepdim=True)
                       ).squeeze(1)


def mix_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed from (request seed, output position): splitmix64 finalizer, so
    nearby seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty (HF: over prompt and output tokens, divide positive logits and
    multiply negative ones), then frequency and presence (OpenAI: over output tokens only)."""
    batch, vocab = logits.shape
    logits = logits.clone()
    output_counts = _bincount(meta.output_token_ids, batch, vocab, logits.device)
    if meta.repetition_penalty is not None and meta.prompt_token_ids is not None:
        prompt_counts = _bincount(meta.prompt_token_ids, batch, vocab, logits.device)
        seen = (output_counts > 0) | (prompt_counts > 0)
        penalty = meta.repetition_penalty.unsqueeze(1).expand_as(logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if meta.frequency_penalty is not None and meta.presence_penalty is not None:
        logits -= meta.frequency_penalty.unsqueeze(1) * output_counts
        logits -= meta.presence_penalty.unsqueeze(1) * (output_counts > 0).float()
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int = 0,
) -> torch.Tensor:
    """Keep each row's k best tokens, then its smallest set whose probability reaches top_p
    (the best token always stays). Ties at the k-th logit are kept. Rows without top-k carry a
    k beyond the vocabulary; `max_top_k` is the largest k among the others."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    if top_p is None:
        assert top_k is not None
        # Only top-k: a partial top-k of the largest k avoids sorting the whole vocabulary.
        width = min(max(max_top_k, 1), vocab)
        best = logits.topk(width, dim=-1).values  # [B, width], descending
        kth = best.gather(1, (top_k.clamp(1, width) - 1).unsqueeze(1))  # [B, 1]
        kth = kth.masked_fill((top_k >= vocab).unsqueeze(1), float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Ascending order: drop the low tail whose total mass stays within 1 - top_p.
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, meta: SamplingMetadata
) -> list[TokenLogprobs | None]:
    """Per row that asked: the sampled token, then its top-N in rank order; rank is 1-based."""
    assert meta.max_num_logprobs is not None
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1  # [B]
    top_n = min(meta.max_num_logprobs, raw_logprobs.shape[-1])
    top_lp, top_ids = raw_logprobs.topk(top_n, dim=-1)  # [B, N]
    ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1).tolist()  # one transfer each
    lps = torch.cat([sampled_lp, top_lp], dim=1).tolist()
    rank_list = ranks.tolist()
    out: list[TokenLogprobs | None] = []
    for row, n in enumerate(meta.num_logprobs):
        if n is None:
            out.append(None)
            continue
        out.append(
            TokenLogprobs(token_ids=ids[row][: n + 1], logprobs=lps[row][: n + 1],
                          sampled_rank=rank_list[row])
        )
    return out


def _pad(rows: list[list[int]], device: torch.device | str) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [r + [-1] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(rows), width)


def _bincount(
    token_ids: torch.Tensor | None, batch: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """Per-row token counts [B, V]; the -1 padding lands in an extra column that is dropped."""
    counts = torch.zeros(batch, vocab + 1, dtype=torch.float32, device=device)
    if token_ids is None or token_ids.numel() == 0:
        return counts[:, :vocab]
    index = torch.where(token_ids < 0, vocab, token_ids)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """Set to -inf, in place, the logits of `rows` whose tokens their packed bitmask rows
    (xgrammar's layout: bit t % 32 of int32 word t // 32 set = token t allowed) forbid."""
    if not rows:
        return
    packed = torch.from_numpy(np.ascontiguousarray(bitmask)).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
