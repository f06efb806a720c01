"""Text across a prefill/decode handover: a prefill that stops at max_tokens=1 for another
engine to decode on leaves the bytes of a cut character to the decode side, so prefill text +
decode text is exactly the text of one engine doing both (it was a U+FFFD too many)."""

from __future__ import annotations

from tokenflow.replica.engine.output_processor import OutputProcessor
from tokenflow.replica.loading.model_source import tiny_model_dir
from tokenflow.replica.loading.tokenizer import Tokenizer
from tokenflow.scheduler import EngineCoreOutput, SamplingParams


def _byte_token(tok: Tokenizer, byte: int) -> int:
    """The id of a byte-level vocabulary's token for one raw byte (GPT-2's printable map)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char = chr(byte) if byte in printable else chr(256 + sorted(
        set(range(256)) - set(printable)).index(byte))
    return tok.vocab()[char]


def _split_character(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """Prompt ids, and output ids whose first token ends inside a UTF-8 character: "П" as its
    two bytes, one token each, then whole tokens."""
    first, second = "П".encode()
    output = [_byte_token(tok, first), _byte_token(tok, second),
              *tok.encode("ривет мир", add_special_tokens=False)]
    prompt = tok.encode("Hello", add_special_tokens=False)
    assert tok.decode(prompt + output[:1]).endswith("\ufffd")
    assert tok.decode(prompt + output) == "HelloПривет мир"
    return prompt, output


def _text(proc: OutputProcessor, req_id: str, outs: list[EngineCoreOutput]) -> str:
    return "".join(d.outputs[0].text for d in proc.process(outs)[0])


def test_prefill_for_remote_decode_leaves_a_cut_character_to_the_decode_side() -> None:
    tok = Tokenizer.from_dir(tiny_model_dir())
    prompt, output = _split_character(tok)
    params = SamplingParams(max_tokens=len(output))
    colocated = OutputProcessor(tok)
    colocated.add_request("c", ["c"], None, prompt, params)
    want = _text(colocated, "c", [EngineCoreOutput("c", [t]) for t in output[:-1]]
                 + [EngineCoreOutput("c", [output[-1]], finish_reason="length")])

    prefill = OutputProcessor(tok)
    prefill.add_request("p", ["p"], None, prompt, SamplingParams(max_tokens=1),
                        continues_elsewhere=True)
    first = _text(prefill, "p", [EngineCoreOutput("p", output[:1], finish_reason="length")])
    decode = OutputProcessor(tok)
    decode.add_request("d", ["d"], None, prompt, params, initial_output_ids=output[:1],
                       emit_initial=False)
    rest = _text(decode, "d", [EngineCoreOutput("d", [t]) for t in output[1:-1]]
                 + [EngineCoreOutput("d", [output[-1]], finish_reason="length")])
    assert first + rest == want
    # A plain request that ends there still shows the cut character as U+FFFD.
    alone = OutputProcessor(tok)
    alone.add_request("a", ["a"], None, prompt, SamplingParams(max_tokens=1))
    assert _text(alone, "a", [EngineCoreOutput("a", output[:1], finish_reason="length")]
                 ).endswith("\ufffd")
