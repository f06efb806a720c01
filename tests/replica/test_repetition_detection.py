"""Repetition detection end to end on the embedded model, which loops quickly under greedy
decoding: a request that asks for it ends with finish reason "stop" and stop reason
"repetition", its tokens exactly those of the unstopped run up to where the repetition ends,
with and without speculative decoding (whose accepted drafts bring several tokens a step);
requests in the same batch that did not ask run on untouched."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from tests.replica.engine_state import kv_blocks
from tokenflow.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import RepetitionDetectionParams, SamplingParams, Scheduler

PROMPTS: list[str | list[int]] = ["hello hello hello", [5, 6, 7, 8] * 6, "abc",
                                  "the cat sat on the mat. the cat sat on the mat."]
MAX_TOKENS = 64
PLAIN = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
DETECTORS = {
    "patterns": RepetitionDetectionParams(max_pattern_size=4, min_pattern_size=2, min_count=3),
    # With drafts, this one ends every prompt one token before its step's last (checked).
    "one_token": RepetitionDetectionParams(max_pattern_size=1, min_count=5),
}


def _engine(speculative: bool) -> LLM:
    return LLM(config=EngineConfig(
        model=ModelConfig(model="tokenflow-tiny"),
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_model_len=512),
        speculative=SpeculativeConfig(method="ngram" if speculative else None,
                                      num_speculative_tokens=4, prompt_lookup_min=1)))


def first_repetition(tokens: list[int], params: RepetitionDetectionParams) -> int | None:
    """The fewest tokens that end in `min_count` copies of one pattern (the definition)."""
    for end in range(1, len(tokens) + 1):
        for size in range(params.min_pattern_size, params.max_pattern_size + 1):
            tail = tokens[max(end - size * params.min_count, 0):end]
            if len(tail) == size * params.min_count and tail == tail[:size] * params.min_count:
                return end
    return None


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "speculative"])
def llm(request) -> Iterator[LLM]:
    engine = _engine(speculative=request.param)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("detector", list(DETECTORS))
def test_repetition_cuts_the_output_where_the_repetition_ends(llm, detector,
                                                              monkeypatch) -> None:
    trimmed = []
    finish = Scheduler._finish_stopped

    def spy(self, request, out, num_trim):
        trimmed.append(num_trim)
        return finish(self, request, out, num_trim)

    monkeypatch.setattr(Scheduler, "_finish_stopped", spy)
    unstopped = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PLAIN, use_tqdm=False)]
    detect = DETECTORS[detector]
    watched_params = dataclasses.replace(PLAIN, repetition_detection=detect)
    # Each prompt twice in one batch: once watched, once not.
    outputs = llm.generate(PROMPTS * 2,
                           [watched_params] * len(PROMPTS) + [PLAIN] * len(PROMPTS),
                           use_tqdm=False)
    watched, plain = outputs[:len(PROMPTS)], outputs[len(PROMPTS):]
    for full, out in zip(unstopped, watched, strict=True):
        end = first_repetition(full, detect)
        assert end is not None and end < MAX_TOKENS, full  # the model does loop
        seq = out.outputs[0]
        assert seq.token_ids == full[:end]
        assert (seq.finish_reason, seq.stop_reason) == ("stop", "repetition")
    for full, out in zip(unstopped, plain, strict=True):
        seq = out.outputs[0]
        assert seq.token_ids == full
        assert (seq.finish_reason, seq.stop_reason) == ("length", None)
    speculative = llm.config.speculative.method is not None
    if speculative:
        assert llm.totals.num_accepted_tokens > 0  # steps of several tokens happened
    if speculative and detector == "one_token":
        assert any(trimmed), trimmed  # tokens sampled after the repetition were dropped
    free, total = kv_blocks(llm.engine)
    assert free == total
