"""Stop checks run on each newly sampled token, in order."""

from __future__ import annotations

from collections.abc import Sequence

from tokenflow.scheduler.request import Request, RequestStatus
from tokenflow.scheduler.sampling_params import RepetitionDetectionParams, SamplingParams

# The stop reason of a request that repetition detection ended (its finish reason is "stop").
REPETITION_STOP_REASON = "repetition"


def check_stop(request: Request, num_new_tokens: int, max_model_len: int) -> int | None:
    """Check the last `num_new_tokens` outputs one by one; on a stop, set the request's status
    and stop reason and return how many of the new tokens to keep (the rest are trimmed).
    Returns None when the request goes on.

    EOS and stop token ids are kept in the output (the detokenizer hides special tokens), and
    neither fires before `min_tokens` outputs; nor does repetition detection, which keeps the
    whole last repetition. Length limits always apply.
    """
    params = request.sampling_params
    outputs = request.output_token_ids
    first = len(outputs) - num_new_tokens
    eos = None if params.ignore_eos else request.eos_token_id
    stop_ids = params.stop_token_ids
    repetition = params.repetition_detection
    max_tokens = params.max_tokens
    num_prompt = request.num_prompt_tokens
    for i in range(first, len(outputs)):
        num_outputs = i + 1
        token = outputs[i]
        if num_outputs > params.min_tokens:
            if token == eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return num_outputs - first
            if stop_ids and token in stop_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return num_outputs - first
            if repetition is not None and ends_in_repetition(outputs, num_outputs, repetition):
                request.status = RequestStatus.FINISHED_REPETITION
                request.stop_reason = REPETITION_STOP_REASON
                return num_outputs - first
        if (max_tokens is not None and num_outputs >= max_tokens) or (
            num_prompt + num_outputs >= max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return num_outputs - first
    return None


def ends_in_repetition(tokens: Sequence[int], end: int,
                       params: RepetitionDetectionParams) -> bool:
    """Whether `tokens[:end]` ends in one pattern of `min_pattern_size` to `max_pattern_size`
    tokens repeated `min_count` times in a row."""
    count = params.min_count
    last = tokens[end - 1]
    for size in range(params.min_pattern_size, params.max_pattern_size + 1):
        start = end - size * count
        if start < 0:
            return False  # every longer pattern needs even more tokens
        # tokens[start:end] is `count` copies of one pattern exactly when each of its tokens
        # equals the one `size` places later: two slices, compared in C. Testing the last
        # token against one period back first rejects almost every size without copying.
        if tokens[end - 1 - size] == last and tokens[start:end - size] == tokens[start + size:end]:
            return True
    return False


def first_full_check(params: SamplingParams, length_limit: int) -> int:
    """The number of outputs from which every new token needs the full `check_stop`, on top of
    stop tokens (which the scheduler tests itself): the length limit, or earlier for a request
    with repetition detection, as soon as a repetition could end there. A request without
    repetition detection so costs the per-token pre-check nothing extra."""
    repetition = params.repetition_detection
    if repetition is None:
        return length_limit
    earliest = max(params.min_tokens + 1, repetition.min_pattern_size * repetition.min_count)
    return min(length_limit, earliest)
