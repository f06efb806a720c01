"""Incremental detokenization: split UTF-8 characters, bounded windows, stop strings."""

from __future__ import annotations

import random

import pytest

from tokenflow.replica.engine.detokenizer import IncrementalDetokenizer
from tokenflow.replica.loading.model_source import tiny_model_dir
from tokenflow.replica.loading.tokenizer import Tokenizer


class CountingTokenizer(Tokenizer):
    """Records the longest id list decoded, to check the window stays small."""

    max_decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.max_decoded = max(self.max_decoded, len(ids))
        return super().decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def tok() -> CountingTokenizer:
    return CountingTokenizer.from_dir(tiny_model_dir())


def _byte_token_ids(tok: Tokenizer) -> list[int]:
    """Token id of each single byte 0..255 (GPT-2 byte-to-unicode alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char_of = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(256 + extra)
            extra += 1
    ids = [tok.token_to_id(char_of[b]) for b in range(256)]
    assert all(i is not None for i in ids)
    return ids  # type: ignore[return-value]


def _random_stream(tok: Tokenizer, rng: random.Random) -> list[int]:
    """Tokens mixing multi-byte pieces of text, single bytes of split characters, and bytes
    that are not UTF-8 at all."""
    byte_ids = _byte_token_ids(tok)
    pieces = ["héllo ", "東京", "😀🚀", " world", "Ж", "ab", "€", "\n"]
    ids: list[int] = []
    for _ in range(rng.randrange(20, 80)):
        kind = rng.random()
        if kind < 0.4:
            ids += [byte_ids[b] for b in rng.choice(pieces).encode("utf-8")]
        elif kind < 0.7:
            ids += tok.encode(rng.choice(pieces), add_special_tokens=False)
        elif kind < 0.85:
            ids.append(byte_ids[rng.randrange(256)])
        else:
            ids.append(rng.randrange(tok.vocab_size))
    return ids


def _push_in_chunks(det: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        deltas.append(det.push(ids[i : i + n]))
        i += n
    deltas.append(det.flush())
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_full_decode(tok: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(1)
    for _ in range(60):
        ids = _random_stream(tok, rng)
        det = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        text = "".join(_push_in_chunks(det, ids, rng))
        assert text == tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert det.output_text == text
        assert det.output_token_ids == ids


def test_split_character_is_held_until_complete(tok: Tokenizer) -> None:
    byte_ids = _byte_token_ids(tok)
    det = IncrementalDetokenizer(tok)
    assert det.push(tok.encode("ok ", add_special_tokens=False)) == "ok "
    first, second, third, fourth = "😀".encode()
    assert det.push([byte_ids[first]]) == ""
    assert det.push([byte_ids[second], byte_ids[third]]) == ""
    assert det.push([byte_ids[fourth]]) == "😀"
    # Text before a split character is not held back with it.
    assert det.push([tok.encode("a", add_special_tokens=False)[0], byte_ids[0xE6]]) == "a"
    assert det.flush() == "\ufffd"


def test_window_does_not_grow_with_the_sequence(tok: CountingTokenizer) -> None:
    text = "The river ran quietly past the old mill. 東京😀 " * 200
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    tok.max_decoded = 0
    for token in ids:
        det.push([token])
    assert len(ids) > 1500
    assert tok.max_decoded <= 12
    assert det.output_text == tok.decode(ids)


def test_prompt_context_and_special_tokens(tok: Tokenizer) -> None:
    prompt = tok.encode("Hello there")
    eot = tok.token_to_id("<|eot_id|>")
    out = tok.encode(" general", add_special_tokens=False) + [eot]
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert "".join(det.push([t]) for t in out) == " general"
    assert det.output_token_ids == out
    det = IncrementalDetokenizer(tok, skip_special_tokens=False, prompt_token_ids=prompt)
    assert det.push(out) + det.flush() == " general<|eot_id|>"


def _run(
    tok: Tokenizer, text: str, stop: list[str], include: bool = False
) -> tuple[list[str], IncrementalDetokenizer]:
    """Push `text` one character-sized token at a time."""
    det = IncrementalDetokenizer(tok, stop=stop, include_stop_str_in_output=include)
    deltas = []
    for ch in text:
        deltas.append(det.push(tok.encode(ch, add_special_tokens=False)))
        if det.finished:
            break
    return deltas, det


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok: Tokenizer, include: bool) -> None:
    deltas, det = _run(tok, "one two STOP three", ["STOP"], include)
    expected = "one two STOP" if include else "one two "
    assert "".join(deltas) == expected == det.output_text
    assert det.finished and det.stop_reason == "STOP"
    assert det.push(tok.encode(" more", add_special_tokens=False)) == ""
    assert det.flush() == ""


def test_stop_string_inside_one_token_and_text_after_it_dropped(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop=["mill"], include_stop_str_in_output=True)
    out = det.push(tok.encode("past the old mill. The river", add_special_tokens=False))
    assert out == "past the old mill"
    assert det.stop_reason == "mill"


def test_first_completed_stop_string_wins(tok: Tokenizer) -> None:
    deltas, det = _run(tok, "abc xyz def", ["def", "xyz", "c x"])
    assert "".join(deltas) == "ab"
    assert det.stop_reason == "c x"
    # A stop nested in a longer one completes first, however the text is split.
    for text in (["xabcd"], ["x", "a", "b", "c", "d"]):
        det = IncrementalDetokenizer(tok, stop=["zzz", "abcd", "bc"])
        out = "".join(det.push(tok.encode(t, add_special_tokens=False)) for t in text)
        assert (out, det.stop_reason) == ("xa", "bc")


def test_possible_stop_prefix_is_held_then_released(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop=["</end>"])
    assert det.push(tok.encode("value </", add_special_tokens=False)) == "value "
    assert det.push(tok.encode("en", add_special_tokens=False)) == ""
    assert det.push(tok.encode("try", add_special_tokens=False)) == "</entry"
    assert det.push(tok.encode(" </e", add_special_tokens=False)) == " "
    assert det.flush() == "</e"  # ended for another reason: held-back text is released
    assert det.output_text == "value </entry </e"
    assert det.stop_reason is None


def test_random_streams_with_stop_strings(tok: Tokenizer) -> None:
    rng = random.Random(7)
    stops = ["lo w", "京😀", "\n\n", "ab€"]
    for _ in range(60):
        ids = _random_stream(tok, rng)
        stop = rng.sample(stops, 2)
        include = rng.random() < 0.5
        full = tok.decode(ids)
        hits = [(full.find(s) + len(s), full.find(s), s) for s in stop if s in full]
        det = IncrementalDetokenizer(tok, stop=stop, include_stop_str_in_output=include)
        text = "".join(_push_in_chunks(det, ids, rng))
        if hits:
            _, index, s = min(hits)
            assert text == full[: index + (len(s) if include else 0)]
            assert det.stop_reason == s
        else:
            assert text == full
            assert det.stop_reason is None


def test_bytes_that_never_complete_are_released(tok: CountingTokenizer) -> None:
    # Lead bytes with no continuation: each makes the text end in U+FFFD again. The window is
    # cut at a bounded length instead of holding (and re-decoding) them forever.
    lead = _byte_token_ids(tok)[0xE6]
    det = IncrementalDetokenizer(tok)
    tok.max_decoded = 0
    text = "".join(det.push([lead]) for _ in range(100))
    assert text and set(text) == {"\ufffd"}
    assert tok.max_decoded <= 40
    assert text + det.flush() == tok.decode([lead] * 100)


def test_text_depends_on_the_tokens_not_on_how_they_were_pushed(tok: Tokenizer) -> None:
    """A resumed request replays the tokens it arrives with in one push and must then stand
    where the original, fed a token a step, stood: the same text emitted and the same held
    back, also across a run of bytes long enough to be cut (each cut decodes to U+FFFD)."""
    rng = random.Random(11)
    byte_ids = _byte_token_ids(tok)
    lead = byte_ids[0xE6]
    for _ in range(40):
        ids = _random_stream(tok, rng)
        at = rng.randrange(len(ids))
        ids[at:at] = [lead if rng.random() < 0.5 else byte_ids[rng.randrange(0x80, 0x100)]
                      for _ in range(rng.randrange(20, 80))]
        one = IncrementalDetokenizer(tok, stop=["\n\n"])
        emitted = [""]
        for t in ids:
            emitted.append(emitted[-1] + one.push([t]))
        whole = emitted[-1] + one.flush()
        for k in (rng.randrange(len(ids)) for _ in range(5)):
            det = IncrementalDetokenizer(tok, stop=["\n\n"])
            assert det.push(ids[:k]) == emitted[k], k
            assert emitted[k] + "".join(_push_in_chunks(det, ids[k:], rng)) == whole, k
