"""Structured output with xgrammar: a request's constraint (JSON schema, regex, choice, EBNF
grammar, any JSON object) becomes a grammar, compiled against the tokenizer off the engine
thread; a matcher per request follows what it generates, and each step the scheduler sends
the sampler a packed bitmask of the tokens each sampled position may take.

The matchers live with the scheduler, which knows every accepted token (drafts included), so
the workers stay stateless about grammars: they only apply the rows they are sent.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from tokenflow.config import StructuredOutputsConfig
from tokenflow.scheduler.sampling_params import StructuredOutputsParams
from tokenflow.scheduler.sched_output import GrammarBitmask

if TYPE_CHECKING:
    from tokenflow.replica.loading.tokenizer import Tokenizer
    from tokenflow.scheduler.request import Request

logger = logging.getLogger(__name__)

_VOCAB_TYPES = {"byte_level": xgr.VocabType.BYTE_LEVEL,
                "byte_fallback": xgr.VocabType.BYTE_FALLBACK, "raw": xgr.VocabType.RAW}
# xgrammar's C++ errors start with a timestamp and a source location: "[08:12:35] x.cc:5082: ".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
# xgrammar 0.2.9 writes the characters of a length-bounded JSON string (minLength/maxLength)
# as this class, which lets raw control characters (U+0000-U+001F but CR and LF) through:
# invalid JSON. Such strings take no escapes there, so the class JSON allows is the second.
_LENGTH_BOUNDED_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


def _no_raw_control_characters(grammar: xgr.Grammar) -> xgr.Grammar:
    ebnf = str(grammar)
    if _LENGTH_BOUNDED_CHARS not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LENGTH_BOUNDED_CHARS, _JSON_STRING_CHARS))


def grammar_of(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> xgr.Grammar:
    """The grammar a constraint stands for. Raises ValueError, with a message a client can act
    on, when the schema, regex or grammar does not parse or uses what xgrammar lacks."""
    kind = params.kind
    try:
        if kind == "json" or kind == "json_object":
            # json_object: any object (OpenAI's JSON mode), not any JSON value.
            schema = params.json if kind == "json" else '{"type": "object"}'
            return _no_raw_control_characters(xgr.Grammar.from_json_schema(
                schema, any_whitespace=not config.disable_any_whitespace,
                max_whitespace_cnt=None if config.disable_any_whitespace else config.max_whitespace,
                strict_mode=kind == "json"))
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            # EBNF string literals take JSON's escapes; ensure_ascii=False keeps text as is.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        detail = _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        raise ValueError(f"invalid structured output {kind}: {detail or type(exc).__name__}") from exc


@dataclass(eq=False)
class RequestGrammar:
    """One request's grammar: its compilation under way, then the matcher that follows the
    tokens it has accepted."""

    compiling: Future[xgr.CompiledGrammar]
    matcher: xgr.GrammarMatcher | None = field(default=None)


class StructuredOutputManager:
    """Owns the grammar compiler (built from the tokenizer on first use, in a compile thread),
    the pool that compiles requests' grammars off the engine thread, and each step's bitmask.

    Every method but the compilation itself runs on the engine thread.
    """

    def __init__(self, config: StructuredOutputsConfig, load_tokenizer: Callable[[], Tokenizer],
                 vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._load_tokenizer = load_tokenizer
        self._pool = ThreadPoolExecutor(config.compile_threads, thread_name_prefix="grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()

    # ------------------------------------------------------------------- compilation
    def submit(self, request: Request) -> None:
        """Start compiling the request's grammar; `ready()` tells when it can run."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        request.grammar = RequestGrammar(self._pool.submit(self._compile, params))

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return self._get_compiler().compile_grammar(grammar_of(params, self.config))

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                tokenizer = self._load_tokenizer()
                vocab = tokenizer.vocab()
                encoded = [""] * self.vocab_size  # ids past the tokenizer's: never allowed
                for token, token_id in vocab.items():
                    if token_id < self.vocab_size:
                        encoded[token_id] = token
                info = xgr.TokenizerInfo(
                    encoded, vocab_type=_VOCAB_TYPES[tokenizer.token_encoding],
                    vocab_size=self.vocab_size, stop_token_ids=sorted(tokenizer.eos_token_ids),
                    add_prefix_space=tokenizer.adds_prefix_space)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.config.compile_threads)
            return self._compiler

    def ready(self, request: Request) -> bool:
        """Whether the request's grammar is compiled (its matcher then exists, having accepted
        any outputs the request arrived with). Raises ValueError if compilation failed."""
        grammar = request.grammar
        if grammar.matcher is not None:
            return True
        if not grammar.compiling.done():
            return False
        grammar.matcher = xgr.GrammarMatcher(grammar.compiling.result())
        self.accept(request, request.output_token_ids)
        return True

    # ---------------------------------------------------------------------- each step
    def bitmask(self, rows: list[tuple[Request, list[int]]]) -> GrammarBitmask:
        """The allowed tokens of each request that samples this step, given with the drafts
        it verifies: one row for its next token and one after each draft (the matcher steps
        over the drafts and back). A row after a draft the grammar refuses stays open: the
        sampler rejects that draft, so the row's token is never kept."""
        num_rows = sum(1 + len(drafts) for _, drafts in rows)
        bitmask = torch.full(xgr.get_bitmask_shape(num_rows, self.vocab_size), -1,
                             dtype=torch.int32)
        first_row: dict[str, int] = {}
        row = 0
        for request, drafts in rows:
            matcher = request.grammar.matcher
            first_row[request.request_id] = row
            stepped = 0
            for j in range(len(drafts) + 1):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, row + j)
                if j == len(drafts) or not matcher.accept_token(drafts[j]):
                    break
                stepped += 1
            if stepped:
                matcher.rollback(stepped)
            row += 1 + len(drafts)
        return GrammarBitmask(first_row, bitmask.numpy())

    def accept(self, request: Request, token_ids: list[int]) -> bool:
        """Advance the request's matcher over its new tokens; True once the grammar is done
        (it accepted a stop token, or nothing may follow)."""
        matcher = request.grammar.matcher
        for token_id in token_ids:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token_id):
                # Only a token the sampler was not masked for gets here (a P/D consumer's
                # first token from a producer without the grammar): the output can no
                # longer be held to it, so it ends.
                logger.warning("request %s: token %d breaks its grammar; ending it",
                               request.request_id, token_id)
                return True
        return matcher.is_terminated()

    def valid_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts from where the request is."""
        matcher = request.grammar.matcher
        if matcher is None:
            return []
        num_valid = 0
        for token_id in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            matcher.rollback(num_valid)
        return drafts[:num_valid]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
