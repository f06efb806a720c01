"""Structured output (xgrammar): on the embedded model, whose weights are random and so have
no idea of JSON, every completion still follows its schema, regex, choice or grammar; greedy
structured output is the same on every scheduling path and with speculation; a request waits
for its grammar without holding up others; bad constraints are errors before anything runs."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from tokenflow.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenflow.replica.engine.engine import Engine
from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.engine.structured_output import StructuredOutputManager
from tokenflow.scheduler import RequestStatus, SamplingParams
from tokenflow.scheduler.sampling_params import StructuredOutputsParams

# Every part bounded (string lengths, integer ranges, array sizes), so any path through the
# grammar ends well inside max_tokens, however the model picks.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                           "y": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "member", "colour", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-\d{1,3}(\.[A-Z])?"
CHOICES = ["yes", "no", "it depends, \"maybe\""]
SUM_GRAMMAR = 'root ::= "(" num ("+" num)? ("+" num)? ")"\nnum ::= [1-9] [0-9]?'
SUM_REGEX = r"\([1-9][0-9]?(\+[1-9][0-9]?){0,2}\)"

CONSTRAINTS = {
    "json": (StructuredOutputsParams(json=PERSON),
             lambda text: jsonschema.validate(json.loads(text), PERSON)),
    "regex": (StructuredOutputsParams(regex=REGEX),
              lambda text: _assert(re.fullmatch(REGEX, text), text)),
    "choice": (StructuredOutputsParams(choice=CHOICES),
               lambda text: _assert(text in CHOICES, text)),
    "grammar": (StructuredOutputsParams(grammar=SUM_GRAMMAR),
                lambda text: _assert(re.fullmatch(SUM_REGEX, text), text)),
}
# Outputs run to ~150 tokens: the preemption scenario has room for one request at a time.
SCENARIOS = {
    "chunked_prefill": dict(max_num_batched_tokens=32),
    "preemption": dict(max_num_batched_tokens=64, num_blocks=80, block_size=4),
}
PROMPTS = ["Tell me about yourself.", "The weather today", "1 2 3 4", "Once upon a time"]


def _assert(ok: object, text: str) -> None:
    assert ok, f"output {text!r} breaks its constraint"


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tokenflow-tiny", max_model_len=512)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_completion_follows_its_constraint(tiny, kind) -> None:
    constraint, check = CONSTRAINTS[kind]
    params = [SamplingParams(max_tokens=250, temperature=t, seed=s, structured_outputs=constraint)
              for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (1.5, 3))]
    outputs = tiny.generate([p for p in PROMPTS for _ in params], params * len(PROMPTS),
                            use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # ended by its grammar
        check(completion.text)
    scheduler = tiny.engine.scheduler
    assert not scheduler.requests and not scheduler._grammar_req_ids


def test_n_choices_each_follow_the_schema(tiny) -> None:
    constraint, check = CONSTRAINTS["json"]
    out = tiny.generate("Describe a person", SamplingParams(
        n=3, max_tokens=250, temperature=1.0, seed=7, structured_outputs=constraint),
        use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        check(completion.text)


def test_ignore_eos_ends_when_the_grammar_is_complete(tiny) -> None:
    """With ignore_eos the stop token does not end the request; a complete grammar does."""
    constraint, check = CONSTRAINTS["choice"]
    out = tiny.generate("Answer:", SamplingParams(max_tokens=50, temperature=0.0,
                                                  ignore_eos=True, structured_outputs=constraint),
                        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    check(out.text)  # the stop token it ended with is special: not in the text


def _engine(speculative: bool = False, **scenario) -> LLM:
    return LLM(config=EngineConfig(
        model=ModelConfig(model="tokenflow-tiny"),
        cache=CacheConfig(block_size=scenario.get("block_size", 16),
                          num_blocks=scenario.get("num_blocks", 512),
                          enable_prefix_caching=scenario.get("enable_prefix_caching", True)),
        scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=scenario.get(
            "max_num_batched_tokens", 4096)),
        speculative=SpeculativeConfig(method="ngram" if speculative else None,
                                      num_speculative_tokens=3, prompt_lookup_min=1)))


@pytest.fixture(scope="module")
def greedy_reference(tiny) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in tiny.generate(
        PROMPTS, _greedy_json(), use_tqdm=False)]


def _greedy_json() -> SamplingParams:
    return SamplingParams(max_tokens=250, temperature=0.0,
                          structured_outputs=CONSTRAINTS["json"][0])


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption", "speculation"])
def test_greedy_structured_output_is_the_same_on_every_path(greedy_reference, scenario) -> None:
    llm = (_engine(speculative=True) if scenario == "speculation"
           else _engine(**SCENARIOS[scenario]))
    outputs = llm.generate(PROMPTS, _greedy_json(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference
    totals = llm.totals
    if scenario == "preemption":
        assert totals.num_preemptions > 0
    if scenario == "speculation":
        # Whitespace runs repeat, so drafts come, and those the grammar allows get accepted.
        assert totals.num_draft_tokens > 0 and totals.num_accepted_tokens > 0
    llm.engine.check_kv_integrity()


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(tiny) -> None:
    """The scheduler keeps only the drafts the request's grammar accepts from where it is."""
    engine = tiny.engine
    tokenizer = tiny.tokenizer
    processed = tiny.engine.process_inputs("g", "x", SamplingParams(
        max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputsParams(
            choice=["abcabc"])))
    request = processed.sequences[0]
    engine.scheduler.add_request(request)
    grammars = engine.structured_outputs
    while request.grammar.matcher is None:
        grammars.ready(request)
    ab, c, z = (tokenizer.encode(t, add_special_tokens=False) for t in ("ab", "c", "z"))
    assert grammars.valid_drafts(request, ab + c + z + ab) == ab + c
    assert grammars.valid_drafts(request, z + ab) == []
    engine.scheduler.finish_requests(["g"], RequestStatus.FINISHED_ABORTED)


def test_a_compiling_grammar_does_not_hold_up_other_requests(monkeypatch) -> None:
    gate = threading.Event()
    compile_grammar = StructuredOutputManager._compile

    def gated(self, params):
        gate.wait(60)
        return compile_grammar(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile", gated)
    engine = Engine(EngineConfig(model=ModelConfig(model="tokenflow-tiny")))
    engine.add_request("structured", "Hello", SamplingParams(
        max_tokens=250, temperature=0.0, structured_outputs=CONSTRAINTS["regex"][0]))
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=8, temperature=0.0,
                                                        ignore_eos=True))
    scheduler = engine.scheduler
    text = {"structured": "", "plain": ""}
    finished: set[str] = set()

    def step() -> None:
        for out in engine.step():  # deltas
            text[out.request_id] += out.outputs[0].text
            if out.finished:
                finished.add(out.request_id)

    while "plain" not in finished:
        step()
        assert (scheduler.requests["structured"].status
                == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
    gate.set()
    while engine.has_unfinished_requests():
        step()
    CONSTRAINTS["regex"][1](text["structured"])
    engine.shutdown()


def test_a_grammar_that_fails_to_compile_fails_only_its_request(monkeypatch, tiny) -> None:
    def broken(self, params):
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(StructuredOutputManager, "_compile", broken)
    outputs = tiny.generate(["a", "b"], [
        SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="x+")),
        SamplingParams(max_tokens=5, ignore_eos=True)], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[1].outputs[0].finish_reason == "length"
    assert len(outputs[1].outputs[0].token_ids) == 5


@pytest.mark.parametrize(("constraint", "message"), [
    (dict(json='{"type": "strin"}'), 'Unsupported type "strin"'),
    (dict(json='{"type": "object", "properties": 5}'), "properties must be an object"),
    (dict(json="not json"), "Failed to parse JSON"),
    (dict(regex="(ab"), "invalid structured output regex"),
    (dict(grammar="root ::= missing"), 'Rule "missing" is not defined'),
])
def test_a_bad_constraint_is_rejected_before_it_runs(tiny, constraint, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny.engine.process_inputs("bad", "Hello", SamplingParams(
            structured_outputs=StructuredOutputsParams(**constraint)))
    assert not tiny.engine.has_unfinished_requests()


@pytest.mark.parametrize(("fields", "message"), [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", ""]), "non-empty strings"),
])
def test_structured_outputs_params_take_exactly_one_constraint(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)
