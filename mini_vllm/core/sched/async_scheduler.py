"""The scheduler for async scheduling: plan step N+1 before step N's tokens are back.

Mirrors upstream ``vllm/v1/core/sched/async_scheduler.py`` at v0.22.1
(``AsyncScheduler`` :12, ``_update_after_schedule`` :18,
``_update_request_with_output`` :37). The engine core keeps two steps in
flight (``EngineCore.step_with_batch_queue``), so ``schedule()`` runs while
the previous step's sampled token is still unknown. That token is counted
as an *output placeholder*: a decode request scheduled again before its
token arrives already has its next input position reserved, and the model
runner fills the real id in from the previous step's sample.

For a steady decoding request the placeholders go 1 (scheduled once),
2 (scheduled again before the first token came back), 1 (one token came
back), 2, 1, ... Its ``num_computed_tokens`` runs ahead of ``num_tokens``
by the placeholders, and the update that brings a token in lands one step
late.

With k speculative tokens drafted in the worker (upstream's EAGLE, MTP,
draft-model and n-gram-GPU drafters; the CPU n-gram drafter is refused with
async scheduling) the scheduler never sees a draft's id: each request that
samples holds k ``-1`` placeholder drafts, a decode step schedules 1 + k
tokens and adds 1 + k placeholders, and when the output comes back the
base takes the rejected drafts off the computed tokens and the
placeholders. mini_vllm's engine has no such drafter; the scheduler is
checked against upstream's in lockstep.

What is left out (structured output, KV connectors, the lookahead slots
EAGLE reserves), and where mini_vllm spells a piece of upstream's base
``Scheduler`` here instead of in ``scheduler.py``: UPSTREAM_PIN.md.

Invariants kept, between steps:
- ``0 <= num_output_placeholders <= 2 * (1 + k)`` (1 + its drafts per step
  in flight);
- ``num_computed_tokens <= num_tokens + num_output_placeholders`` for a
  running request;
- a request whose output stops it while it sits preempted in the waiting
  queue leaves the queue (only async scheduling can stop a preempted
  request: its token was sampled by a step scheduled before the preemption).
"""

from __future__ import annotations

from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.engine import EngineCoreOutputs
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    # mirrors vllm/v1/core/sched/async_scheduler.py:13-16
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The drafts a request holds between steps: their ids are proposed in
        # the worker and never come back here, only how many were accepted.
        # One shared read-only list (schedule() slices it, never changes it).
        self._spec_token_placeholders: list[int] = [-1] * self.num_spec_tokens

    # mirrors vllm/v1/core/sched/async_scheduler.py:18-35
    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advance the counts as the base does, then add placeholders for
        each request that samples this step (a prefill chunk samples nothing):
        one for its sampled token and one per draft it verifies."""
        cached = scheduler_output.scheduled_cached_reqs
        # The workers count the in-flight tokens as outputs already
        # (upstream adds them in _make_cached_request_data, scheduler.py:1082).
        cached.num_output_tokens = [
            n + self.requests[req_id].num_output_placeholders
            for req_id, n in zip(cached.req_ids, cached.num_output_tokens, strict=True)
        ]
        # The base class by name, not super(): the lab starter's class
        # subclasses this one, and super() there would run this method again.
        Scheduler._update_after_schedule(self, scheduler_output)
        # BEGIN LAB 14.1: placeholders: 1 + its drafts per request that samples this step
        # HINT: scheduler_output.num_scheduled_tokens holds every scheduled request's id;
        # HINT: a request still mid-prefill after this chunk (is_prefill_chunk) samples nothing.
        # HINT: A request verifying drafts this step (scheduler_output.scheduled_spec_decode_tokens)
        # HINT: may get them all back as tokens: one placeholder each, on top of its own sampled
        # HINT: token. Then give it self._spec_token_placeholders as its next drafts (the worker
        # HINT: proposes them; their ids never reach the scheduler).
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.is_prefill_chunk:
                continue
            # This step samples one token for it and verifies its drafts; how
            # many come back is not known until the output is.
            request.num_output_placeholders += 1 + len(spec_decode_tokens.get(req_id, ()))
            # Its next step verifies k drafts the worker proposes meanwhile
            # (empty without speculation).
            request.spec_token_ids = self._spec_token_placeholders
        # END LAB 14.1

    # mirrors vllm/v1/core/sched/async_scheduler.py:37-61
    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Take in a token one step late: it fills a placeholder, and the
        blocks it completes join the prefix cache now that their ids are known."""
        if request.async_tokens_to_discard > 0:
            # reset_prefix_cache preempted the request while this output was
            # in flight; it was recomputed from scratch, so drop the token.
            request.async_tokens_to_discard -= 1
            return [], False

        # BEGIN LAB 14.1: a late token fills a placeholder; cache the blocks it completes
        # HINT: the base (call Scheduler._update_request_with_output(self, ...) by name, not
        # HINT: super()) appends the tokens and checks the stops; each token it kept fills a
        # HINT: placeholder. Then, if the request was RUNNING (it holds blocks) and prefix
        # HINT: caching is on, cache_blocks up to the tokens whose ids are all known.
        status_before_update = request.status
        new_token_ids, stopped = Scheduler._update_request_with_output(self, request, new_token_ids)
        request.num_output_placeholders -= len(new_token_ids)
        assert request.num_output_placeholders >= 0

        # A preempted request holds no blocks: nothing to cache.
        if status_before_update == RequestStatus.RUNNING and self.kv_cache_manager.enable_caching:
            # Blocks full of tokens whose ids are now all known; the
            # placeholders' positions are computed but have no ids yet.
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders
            )
        return new_token_ids, stopped
        # END LAB 14.1

    # upstream: the stopped_preempted_reqs of scheduler.py:1482-1485, 1528-1531
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """The base update, then drop from the waiting queue any request that
        a late token stopped while it sat there preempted."""
        preempted = [
            request
            for req_id in scheduler_output.num_scheduled_tokens
            if (request := self.requests.get(req_id)) is not None
            and request.status == RequestStatus.PREEMPTED
        ]
        outputs = Scheduler.update_from_output(self, scheduler_output, model_runner_output)
        # BEGIN LAB 14.1: a request stopped while preempted leaves the waiting queue
        # HINT: of `preempted` (PREEMPTED before the update), the ones the update finished
        # HINT: still sit in self.waiting: take them out (waiting.remove_requests).
        stopped_preempted_reqs = [r for r in preempted if r.is_finished()]
        if stopped_preempted_reqs:
            self.waiting.remove_requests(stopped_preempted_reqs)
        # END LAB 14.1
        return outputs

    # upstream: scheduler.py:1912-1924 (inside the base reset_prefix_cache)
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Outputs in flight for a request preempted here are stale: its KV is
        recomputed from scratch, so they are discarded when they come back."""
        if reset_running_requests:
            for request in self.running:
                request.async_tokens_to_discard = request.num_output_placeholders
                request.num_output_placeholders = 0
        return super().reset_prefix_cache(reset_running_requests)
