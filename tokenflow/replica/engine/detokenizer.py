"""Incremental detokenization of one request's output tokens, with stop strings.

Decoding: vLLM-style prefix/read offsets. Only the window `ids[prefix_offset:]` is decoded each
push; `ids[prefix_offset:read_offset]` is text already emitted, which keeps decoders that look at
neighbouring tokens (SentencePiece's leading space) right. The window ends at clean character
boundaries, so its cost does not grow with the sequence. A byte-level token can end inside a
UTF-8 character, which decodes to a trailing U+FFFD: that tail is held back until later bytes
complete it, while the text before it is emitted.

Stop strings: the emitted text never ends in a prefix of a stop string until the next tokens
settle it; a stop string found (also across pushes) truncates the output and finishes the request.
"""

from __future__ import annotations

from tokenflow.replica.loading.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Tokens the prompt lends the first window: decoders that strip a leading space on the first
# token (SentencePiece) then decode the first output token as they do mid-sequence.
_PROMPT_CONTEXT_TOKENS = 5
# A window that never reaches a clean boundary (a chain of tokens each ending inside a
# character) is cut after this many tokens, so a pathological stream cannot grow the per-token
# cost; real text reaches a boundary within a few tokens.
_MAX_PENDING_TOKENS = 32


class IncrementalDetokenizer:
    """Owns one request's decoding state: the token window, held-back text, and stop-string
    detection. `push` returns each new piece of text; `flush` returns what is still held back."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._window_emitted = 0  # chars of the window past prefix_text already decoded
        self._held = ""  # decoded, not emitted: it may be the start of a stop string
        self._emitted: list[str] = []  # pieces, joined on demand: no per-push copy of all text
        self.stop_reason: str | None = None
        self.finished = False
        if prompt_token_ids:
            self._seed_with_prompt(prompt_token_ids)
        self._num_prompt_ids = len(self._ids)

    @property
    def output_text(self) -> str:
        """All text emitted so far (held-back text excluded)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_prompt_ids :]

    def push(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text that became final. Nothing after a stop string.

        Tokens are taken one at a time, so the text emitted depends only on the token sequence,
        never on how it was split into pushes (speculative steps, a resumed request replaying
        the tokens it arrives with): where a window is cut, and so how many U+FFFD a run of
        bytes that are not UTF-8 decodes to, is the same either way."""
        if self.finished or not new_token_ids:
            return ""
        if len(new_token_ids) == 1:
            return self._push_one(new_token_ids[0])
        pieces = []
        for i, token_id in enumerate(new_token_ids):
            pieces.append(self._push_one(token_id))
            if self.finished:  # a stop string: the rest only joins the ids
                self._ids.extend(new_token_ids[i + 1:])
                break
        return "".join(pieces)

    def _push_one(self, token_id: int) -> str:
        self._ids.append(token_id)
        self._held += self._decode_step(final=False)
        return self._emit(final=False)

    def flush(self) -> str:
        """The request ended for another reason: return everything still held back."""
        if self.finished:
            return ""
        self._held += self._decode_step(final=True)
        out = self._emit(final=True)
        self.finished = True
        return out

    # -- decoding -------------------------------------------------------------------------
    def _decode_step(self, final: bool) -> str:
        """Decode the window and return its text not yet added to `_text`."""
        window = self._decode(self._ids[self._prefix_offset :])
        start = len(self._prefix_text) + self._window_emitted
        if not window.endswith(_REPLACEMENT):
            # A clean boundary: slide the window so that it starts at the last one.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            self._window_emitted = 0
            return window[start:]
        if final or len(self._ids) - self._read_offset >= _MAX_PENDING_TOKENS:
            # No boundary is coming: give the tail as U+FFFD and restart with an empty window.
            self._prefix_offset = self._read_offset = len(self._ids)
            self._prefix_text, self._window_emitted = "", 0
            return window[start:]
        # The tail may be a character cut in half: add only the text before it.
        new = window.rstrip(_REPLACEMENT)[start:]
        self._window_emitted += len(new)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _seed_with_prompt(self, prompt_token_ids: list[int]) -> None:
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        text = self._decode(context)
        if text.endswith(_REPLACEMENT):
            return  # the prompt ends inside a character: no clean boundary to start from
        self._ids = context
        self._read_offset = len(context)
        self._prefix_text = text

    # -- stop strings ---------------------------------------------------------------------
    def _emit(self, final: bool) -> str:
        """Emit the held text up to a stop string, or up to a tail that could still become one.

        Held text never contains a whole stop string, and emitted text never ends in a stop's
        prefix, so a stop string always lies in the held text: only that is searched.
        """
        hit = self._find_stop()
        if hit is not None:
            index, stop = hit
            end = index + len(stop) if self.include_stop_str_in_output else index
            self.stop_reason, self.finished = stop, True
        else:
            end = len(self._held) - (0 if final else self._stop_prefix_len())
        out, self._held = self._held[:end], ("" if hit else self._held[end:])
        if out:
            self._emitted.append(out)
        return out

    def _find_stop(self) -> tuple[int, str] | None:
        """The stop string that completes first in the held text, as (index, stop).

        "First" is by end position, then by start: the answer does not depend on how the text
        was split into pushes (a stop nested inside a longer one completes, and wins, first).
        """
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            index = self._held.find(stop)
            if index >= 0 and (best is None or (index + len(stop), index) < best[:2]):
                best = (index + len(stop), index, stop)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the held text that is a proper prefix of a stop."""
        tail = self._held[-(self._max_stop_len - 1) :] if self._max_stop_len > 1 else ""
        for length in range(len(tail), 0, -1):
            piece = tail[-length:]
            if any(s.startswith(piece) for s in self.stop):
                return length
        return 0
