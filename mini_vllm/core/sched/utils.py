"""Stop-condition check and a list helper used by the scheduler.

Mirrors upstream ``vllm/v1/core/sched/utils.py`` at v0.22.1 (``check_stop``
:94, ``remove_all`` :62). Left out: repetition detection, pooling.

Order of checks (it decides the finish reason when several apply):
min_tokens not reached -> keep going; EOS -> stopped; a stop token ->
stopped (stop_reason = that token); max_model_len or max_tokens reached ->
length-capped.
"""

from __future__ import annotations

from mini_vllm.request import Request, RequestStatus


# mirrors vllm/v1/core/sched/utils.py:62-91
def remove_all(lst: list, items_to_remove: set) -> list:
    """``lst`` without ``items_to_remove``; callers must use the return value."""
    if not items_to_remove:
        return lst
    if len(items_to_remove) == 1:
        item = next(iter(items_to_remove))
        if item in lst:
            lst.remove(item)
        return lst
    return [item for item in lst if item not in items_to_remove]


# BEGIN LAB 03.5: the stop conditions, in upstream's order
# mirrors vllm/v1/core/sched/utils.py:94-130
def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status on the request if its last token ends it.

    Returns True if it did. The order decides the reason when several hold:
    min_tokens not yet reached -> keep going (even past EOS); EOS ->
    FINISHED_STOPPED; a stop token -> FINISHED_STOPPED with stop_reason set
    to it; max_model_len or max_tokens reached -> FINISHED_LENGTH_CAPPED.
    """
    # HINT: the request's sampling_params has min_tokens, eos_token_id, stop_token_ids;
    # HINT: request.max_tokens, request.num_tokens, request.num_output_tokens.
    params = request.sampling_params
    # Read once: this runs for every sampled token, and nothing below appends.
    num_output_tokens = request.num_output_tokens
    if num_output_tokens < params.min_tokens:
        return False
    last_token_id = request.output_token_ids[-1]
    if last_token_id == params.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    if request.num_tokens >= max_model_len or num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


# END LAB 03.5
