"""Stop checks run on each newly sampled token, in order."""

from __future__ import annotations

from tokenflow.scheduler.request import Request, RequestStatus


def check_stop(request: Request, num_new_tokens: int, max_model_len: int) -> int | None:
    """Check the last `num_new_tokens` outputs one by one; on a stop, set the request's status
    and stop reason and return how many of the new tokens to keep (the rest are trimmed).
    Returns None when the request goes on.

    EOS and stop token ids are kept in the output (the detokenizer hides special tokens), and
    neither fires before `min_tokens` outputs; length limits always apply.
    """
    params = request.sampling_params
    outputs = request.output_token_ids
    first = len(outputs) - num_new_tokens
    eos = None if params.ignore_eos else request.eos_token_id
    stop_ids = params.stop_token_ids
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
        if (max_tokens is not None and num_outputs >= max_tokens) or (
            num_prompt + num_outputs >= max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return num_outputs - first
    return None
