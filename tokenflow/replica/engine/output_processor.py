"""Turns engine-core token deltas into text deltas: detokenization, stop strings, n > 1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenflow.replica.engine.detokenizer import IncrementalDetokenizer
from tokenflow.replica.loading.tokenizer import Tokenizer
from tokenflow.scheduler import EngineCoreOutput, SamplingParams, TokenLogprobs


@dataclass
class CompletionOutput:
    """One sequence's delta (or, from `LLM.generate`, its whole output)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """A delta of one client request: the sequences that advanced in one step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    # Where a producer published the prompt's KV (prefill/decode disaggregation).
    kv_transfer_params: dict | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_unfinished: int
    metrics: RequestMetrics
    num_cached_tokens: int = 0


@dataclass
class _Child:
    parent: _Parent
    index: int
    detokenizer: IncrementalDetokenizer | None
    finished: bool = False
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    # Outputs the request arrived with, not yet sent: they lead its first delta.
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    # A prefill for another engine (do_remote_decode) ends at max_tokens only to hand over:
    # the text of a character cut there is the decode side's to finish, not a U+FFFD here.
    continues_elsewhere: bool = False


class OutputProcessor:
    """Owns the per-sequence detokenizers, groups the n sequences of one request, and spells
    out the tokens of logprobs (with a cache: the same few thousand tokens recur)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}
        self._token_text: dict[int, str] = {}

    def add_request(self, request_id: str, child_ids: list[str], prompt: str | None,
                    prompt_token_ids: list[int], params: SamplingParams,
                    initial_output_ids: list[int] | None = None,
                    emit_initial: bool = True, continues_elsewhere: bool = False) -> None:
        """`initial_output_ids`: outputs the request arrives with (generated elsewhere); they
        lead the first delta, or, with `emit_initial=False`, only give the text context.
        `continues_elsewhere`: another engine decodes on from where this one stops at
        max_tokens, so bytes of a character left incomplete there are not flushed."""
        parent = _Parent(request_id, prompt, prompt_token_ids, len(child_ids),
                         RequestMetrics(time.time()))
        self._parents[request_id] = parent
        for index, child_id in enumerate(child_ids):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    skip_special_tokens=params.skip_special_tokens,
                    prompt_token_ids=prompt_token_ids)
            child = self._children[child_id] = _Child(parent, index, detok,
                                                      continues_elsewhere=continues_elsewhere)
            if initial_output_ids:
                text = detok.push(initial_output_ids) if detok is not None else ""
                if emit_initial:
                    child.pending_ids, child.pending_text = list(initial_output_ids), text

    def child_ids(self, request_id: str) -> list[str]:
        return [cid for cid, c in self._children.items() if c.parent.request_id == request_id]

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its unfinished sequences' ids for the scheduler."""
        ids = [cid for cid in self.child_ids(request_id) if not self._children[cid].finished]
        for cid in self.child_ids(request_id):
            del self._children[cid]
        self._parents.pop(request_id, None)
        return ids

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the client deltas and the ids of sequences a stop string (or an error in
        detokenizing) finished, which the scheduler must free now."""
        deltas: list[RequestOutput] = []
        to_finish: list[str] = []
        now = time.time()
        for out in outputs:
            child = self._children.get(out.request_id)
            if child is None:
                continue  # aborted meanwhile
            completion, error = self._advance(child, out)
            if completion.finish_reason is not None and out.finish_reason is None:
                to_finish.append(out.request_id)
            deltas.append(self._delta(child, completion, out, error, now))
        return deltas, to_finish

    def _decode_logprobs(self, entries: list[TokenLogprobs] | None) -> None:
        if not entries or self.tokenizer is None:
            return
        cache, decode = self._token_text, self.tokenizer.decode
        for lp in entries:
            if lp is not None:
                lp.decoded = [cache.get(t) or cache.setdefault(
                    t, decode([t], skip_special_tokens=False)) for t in lp.token_ids]

    def _advance(self, child: _Child, out: EngineCoreOutput
                 ) -> tuple[CompletionOutput, str | None]:
        self._decode_logprobs(out.new_logprobs)
        token_ids = out.new_token_ids
        if child.pending_ids:
            token_ids = child.pending_ids + token_ids
        completion = CompletionOutput(child.index, "", token_ids, out.new_logprobs,
                                      out.finish_reason, out.stop_reason)
        error = out.error
        detok = child.detokenizer
        try:
            if detok is not None:
                completion.text = child.pending_text + detok.push(out.new_token_ids)
                if detok.finished and completion.finish_reason is None:
                    completion.finish_reason, completion.stop_reason = "stop", detok.stop_reason
                elif completion.finish_reason is not None and not detok.finished and not (
                        child.continues_elsewhere and completion.finish_reason == "length"):
                    completion.text += detok.flush()
        except Exception as exc:  # one request's bad output must not stop the others
            completion.finish_reason, error = "error", f"{type(exc).__name__}: {exc}"
        return completion, error

    def _delta(self, child: _Child, completion: CompletionOutput, out: EngineCoreOutput,
               error: str | None, now: float) -> RequestOutput:
        parent = child.parent
        metrics = parent.metrics
        if out.new_token_ids:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if completion.finish_reason is not None:
            child.finished = True
            parent.num_unfinished -= 1
            del self._children[out.request_id]
        finished = parent.num_unfinished == 0
        if finished:
            metrics.finished_time = now
            self._parents.pop(parent.request_id, None)
        child.pending_ids, child.pending_text = [], ""
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             [completion], finished, parent.num_cached_tokens,
                             out.prompt_logprobs, error, metrics, out.kv_transfer_params)
