"""The continuous-batching scheduler: who runs this step, and how many tokens.

Mirrors upstream ``vllm/v1/core/sched/scheduler.py`` at v0.22.1:
``schedule`` (:329), ``_preempt_request`` (:929), ``_update_after_schedule``
(:951), ``_make_cached_request_data`` (:1036), ``update_from_output``
(:1283), ``update_draft_token_ids`` (:1691), ``add_request`` (:1755),
``finish_requests`` (:1779), ``make_spec_decoding_stats`` (:2006); with
structured outputs, ``get_grammar_bitmask`` (:1259), the blocked waiting
queue (``skipped_waiting``, built at scheduler.py:166-167;
``_select_waiting_queue_for_scheduling`` :1619) and
``_try_promote_blocked_waiting_request`` (:2103); with LoRA, the limit of
``max_loras`` distinct adapters a step (:534-542, :571-581, :796-797).
With a KV connector (Phase 15): external hits and asynchronous loads in
the waiting loop (:585-780), the connector's metadata (:909), ``_connector_finished``
(:2038), ``_update_waiting_for_remote_kv`` (:2069),
``_update_from_kv_xfer_finished`` (:2136) and the handling of blocks that
failed to load (``_update_requests_with_invalid_blocks`` :2165,
``_handle_invalid_blocks`` :2268). With images (Phase 13): the encoder
budgets (:184-208), ``_try_schedule_encoder_inputs`` (:1096) for running
and waiting requests, ``scheduled_encoder_inputs`` and
``free_encoder_mm_hashes`` in the output (:893, :901), and
``_free_encoder_inputs`` (:1667) once a step has run.
What is left out, and every deliberate difference: UPSTREAM_PIN.md.

Invariants kept:
- there is no prefill phase and no decode phase: each step hands out one
  token budget so that every request's ``num_computed_tokens`` catches up
  with its ``num_tokens`` (a long prompt takes several steps);
- a step's scheduled tokens never exceed ``max_num_batched_tokens``, and no
  more than ``max_num_seqs`` requests run;
- a step that preempted admits no waiting request;
- with speculation, a running request's drafts are scheduled as extra
  tokens (``num_tokens_with_spec``), charged to the same budget, and the
  rejected ones are taken back off ``num_computed_tokens`` once verified;
- a request waiting for its grammar to compile sits in ``skipped_waiting``
  and is passed over, without holding up the requests behind it, until
  the compile is done; then it is admitted like any other; so does one
  waiting for its KV to arrive (WAITING_FOR_REMOTE_KVS);
- a prefill chunk never ends inside an image it could not encode: it
  stops before the image's placeholders, and a step's encoded embeddings
  never exceed ``max_num_encoder_input_tokens``;
- a finished request whose KV the connector is still saving keeps its
  blocks (and its place in ``self.requests``) until the workers report the
  save done in ``finished_sending``;
- no KV transfer is awaited forever: when the workers' ``get_finished``
  keeps raising, a load ends as a failed load and a held finished request
  is freed (mini only: ``_give_up_on_kv_transfers``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from mini_vllm.config import VllmConfig
from mini_vllm.core.encoder_cache_manager import EncoderCacheManager, compute_mm_encoder_budget
from mini_vllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from mini_vllm.core.sched.interface import SchedulerInterface
from mini_vllm.core.sched.output import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    SchedulerOutput,
)
from mini_vllm.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from mini_vllm.core.sched.utils import check_stop, remove_all
from mini_vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from mini_vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from mini_vllm.engine import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
)
from mini_vllm.kv_cache_interface import KVCacheConfig
from mini_vllm.metrics.stats import SchedulerStats
from mini_vllm.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus
from mini_vllm.spec_decode.metrics import SpecDecodingStats
from mini_vllm.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler(SchedulerInterface):
    # mini only (Phase 15): how many steps in a row a worker's get_finished
    # may raise while a KV transfer is awaited before the scheduler gives that
    # transfer up (_give_up_on_kv_transfers). A few steps of grace for a
    # connector that recovers; the number is mini's own (upstream's engine
    # dies on the first raise).
    MAX_GET_FINISHED_FAILURES = 8

    def __init__(
        self,
        vllm_config: VllmConfig,
        log_stats: bool = False,
        structured_output_manager: StructuredOutputManager | None = None,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        """``structured_output_manager``: the engine's (upstream passes it in,
        scheduler.py:69); without one, a manager with no tokenizer, which
        refuses structured requests. ``kv_cache_config``: the model's KV-cache
        groups (upstream's is required); without one, one full-attention group
        of ``cache_config.num_gpu_blocks`` blocks."""
        self.vllm_config = vllm_config
        self.structured_output_manager = structured_output_manager or StructuredOutputManager(
            vllm_config
        )
        self.scheduler_config = vllm_config.scheduler_config
        self.cache_config = vllm_config.cache_config
        self.log_stats = log_stats

        self.max_num_running_reqs = self.scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = self.scheduler_config.max_num_batched_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.lora_config = vllm_config.lora_config
        self.block_size = self.cache_config.block_size

        # Speculation (vllm/v1/core/sched/scheduler.py:211-220). Upstream also
        # sets num_lookahead_tokens, KV slots reserved past the drafts: EAGLE
        # and draft models need them, n-gram does not (0), so mini_vllm's
        # allocate_slots has no lookahead argument.
        speculative_config = vllm_config.speculative_config
        self.num_spec_tokens = 0
        if speculative_config is not None:
            self.num_spec_tokens = speculative_config.num_speculative_tokens

        num_gpu_blocks = self.cache_config.num_gpu_blocks
        if num_gpu_blocks is None or num_gpu_blocks < 2:
            raise ValueError(
                f"num_gpu_blocks must be at least 2 (block 0 is the null block), "
                f"got {num_gpu_blocks}."
            )

        # req_id -> Request, for every request not yet finished and freed.
        self.requests: dict[str, Request] = {}
        self.policy = SchedulingPolicy(self.scheduler_config.policy)
        self.waiting = create_request_queue(self.policy)
        # Waiting requests that cannot run yet (their grammar is compiling),
        # kept apart so they do not block the queue (scheduler.py:166).
        self.skipped_waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(); told to the workers, then cleared.
        self.finished_req_ids: set[str] = set()
        self.prev_step_scheduled_req_ids: set[str] = set()
        # Ids of requests whose grammar failed to compile, to report as errors.
        self.failed_grammar_reqs: list[str] = []

        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = (
            1 if kv_cache_config is None else len(kv_cache_config.kv_cache_groups)
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_gpu_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            enable_caching=self.cache_config.enable_prefix_caching,
            kv_cache_config=kv_cache_config,
            max_num_batched_tokens=self.max_num_scheduled_tokens,
        )

        # The scheduler half of a KV connector (scheduler.py:118-135); the
        # workers build the other half. Blocks that fail to load are
        # recomputed or fail their request, as kv_load_failure_policy says.
        self.connector: KVConnectorBase_V1 | None = None
        self.recompute_kv_load_failures = True
        kv_transfer_config = vllm_config.kv_transfer_config
        if kv_transfer_config is not None:
            if self.kv_cache_manager.coordinator is not None:
                raise ValueError(
                    "kv_transfer_config: mini_vllm's KV connectors need one "
                    "full-attention KV-cache group."
                )
            self.connector = KVConnectorFactory.create_connector(
                vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
            )
            self.recompute_kv_load_failures = (
                kv_transfer_config.kv_load_failure_policy == "recompute"
            )
        # Requests whose asynchronous load ended (scheduler.py:180-181); the
        # failed ones among them have lost some of their loaded tokens.
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        # mini only: while get_finished keeps raising, the steps in a row each
        # awaited transfer has seen it raise; the transfers given up on, whose
        # late reports are dropped (_give_up_on_kv_transfers).
        self.num_get_finished_failures: dict[str, int] = {}
        self.given_up_kv_req_ids: set[str] = set()
        # P/D: what request_finished returned for a request that stopped this
        # step, for its EngineCoreOutput. Upstream's _free_request returns it
        # (scheduler.py:1480); kept beside here so Lab 03.5's code is unchanged.
        self.finished_kv_transfer_params: dict[str, dict] = {}

        # The encoder budgets of a multimodal model, in embeddings: per step,
        # and what the runner's encoder cache holds (scheduler.py:184-208).
        # A text model has neither (both 0).
        self.max_num_encoder_input_tokens, encoder_cache_size = compute_mm_encoder_budget(
            self.scheduler_config, vllm_config.model_config.mm_max_tokens_per_item or {}
        )
        self.encoder_cache_manager = EncoderCacheManager(cache_size=encoder_cache_size)

    # ------------------------------------------------------------------ schedule

    # BEGIN LAB 03.1: cap a running request's new tokens (threshold, budget, model length)
    def _clamp_new_tokens(self, request: Request, num_new_tokens: int, token_budget: int) -> int:
        """The three caps on a running request's tokens this step.

        1. ``long_prefill_token_threshold`` (if > 0): no request takes more
           than this per step, so one long prompt cannot hog the budget;
        2. the token budget left in this step;
        3. ``max_model_len - 1 - num_computed_tokens``: never compute a
           position at or past the model's length.
        Upstream writes this inline at scheduler.py:390-398.
        """
        # HINT: apply the caps in this order; a threshold of 0 means "no threshold".
        # HINT: the model-length cap only binds upstream with speculative tokens
        # HINT: (without drafts, computed + new never passes the request's real
        # HINT: tokens, at most max_model_len - 1 of them); keep it.
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        if num_new_tokens > token_budget:
            num_new_tokens = token_budget
        max_new_tokens = self.max_model_len - 1 - request.num_computed_tokens
        if num_new_tokens > max_new_tokens:
            num_new_tokens = max_new_tokens
        return num_new_tokens

    # END LAB 03.1

    def schedule(self) -> SchedulerOutput:
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []

        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        num_scheduled_tokens: dict[str, int] = {}
        token_budget = self.max_num_scheduled_tokens
        # req_id -> the drafts scheduled for verification this step.
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        # req_id -> the indices of its mm_features to encode this step, and the
        # encoder embeddings this step may still compute.
        scheduled_encoder_inputs: dict[str, list[int]] = {}
        encoder_compute_budget = self.max_num_encoder_input_tokens
        # The time of this step's SCHEDULED and PREEMPTED events (scheduler.py:360).
        scheduled_timestamp = time.monotonic()

        # Phase 1: the RUNNING requests, in order.
        # (mirrors vllm/v1/core/sched/scheduler.py:366-499)
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if (
                request.num_output_placeholders > 0
                and request.num_computed_tokens + 2 - request.num_output_placeholders
                >= request.num_prompt_tokens + request.max_tokens
            ):
                # Async scheduling only (placeholders are 0 otherwise): the
                # step in flight already samples the last token max_tokens
                # allows, so another step would be wasted.
                # (mirrors vllm/v1/core/sched/scheduler.py:369-383)
                req_index += 1
                continue
            # Placeholders: tokens scheduled but not yet back count as computed
            # input already (async scheduling; 0 otherwise).
            # BEGIN LAB 08.1: a running request's new tokens count its drafts
            # HINT: receives request and token_budget; leaves num_new_tokens: the tokens the
            # HINT: request asks for (its real tokens not yet computed AND its drafts, so the
            # HINT: budget is charged for the drafts too), clamped by self._clamp_new_tokens.
            # HINT: request.num_tokens_with_spec counts the drafts; placeholders (async
            # HINT: scheduling, 0 here) count as computed input already.
            num_new_tokens = self._clamp_new_tokens(
                request,
                request.num_tokens_with_spec
                + request.num_output_placeholders
                - request.num_computed_tokens,
                token_budget,
            )
            # END LAB 08.1
            # Its images whose placeholders this chunk reaches: encode them if
            # the encoder budget and cache allow, else stop the chunk before
            # the first that does not fit (mirrors vllm/v1/core/sched/scheduler.py:400-416).
            encoder_inputs_to_schedule: list[int] = []
            new_encoder_compute_budget = encoder_compute_budget
            if request.has_encoder_inputs:
                encoder_inputs_to_schedule, num_new_tokens, new_encoder_compute_budget = (
                    self._try_schedule_encoder_inputs(
                        request, request.num_computed_tokens, num_new_tokens, encoder_compute_budget
                    )
                )
            if num_new_tokens == 0:
                # Nothing to do for it now (it sits at max_model_len - 1, or its
                # next image does not fit the encoder budget or cache).
                # `continue`, not `break`: later requests may still run.
                req_index += 1
                continue

            # Ask for memory; on None, preempt a victim and ask again.
            # (mirrors vllm/v1/core/sched/scheduler.py:443-490)
            # BEGIN LAB 03.3: allocate_slots -> None -> preempt a victim -> retry
            # HINT: receives request, num_new_tokens and this step's records; leaves new_blocks
            # HINT: (None: give up), token_budget, encoder_compute_budget and req_index right
            # HINT: for the code after it.
            # HINT: loop: ask allocate_slots for num_new_tokens; stop when it returns blocks.
            # HINT: FCFS victim: the tail of self.running. PRIORITY victim: the largest
            # HINT: (priority, arrival_time); if it was already scheduled this step, undo that
            # HINT: (its tokens, blocks, drafts, and the encoder budget its images took).
            # HINT: if the victim is `request` itself, give up on it (new_blocks stays None).
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                if self.policy == SchedulingPolicy.PRIORITY:
                    # Worst priority (largest value), then latest arrival.
                    preempted_req = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    self.running.remove(preempted_req)
                    if preempted_req in scheduled_running_reqs:
                        # Already scheduled this step: hand its tokens back.
                        scheduled_running_reqs.remove(preempted_req)
                        token_budget += num_scheduled_tokens.pop(preempted_req.request_id)
                        req_to_new_blocks.pop(preempted_req.request_id)
                        scheduled_spec_decode_tokens.pop(preempted_req.request_id, None)
                        # And the encoder budget its images took.
                        encoder_compute_budget += sum(
                            map(
                                preempted_req.get_num_encoder_embeds,
                                scheduled_encoder_inputs.pop(preempted_req.request_id, ()),
                            )
                        )
                        req_index -= 1
                else:
                    # FCFS: the most recently admitted request.
                    preempted_req = self.running.pop()
                self._preempt_request(preempted_req)
                preempted_reqs.append(preempted_req)
                if preempted_req is request:
                    break  # it was the victim itself: nothing left to free
            if new_blocks is None:
                break
            # END LAB 03.3

            # BEGIN LAB 03.1: schedule the running request and charge the budget
            # HINT: receives request, new_blocks, num_new_tokens; leaves token_budget charged
            # HINT: and req_index on the next request. Three records: the list of scheduled
            # HINT: running requests, its new blocks, its token count.
            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
            # END LAB 03.1

            # Drafts: whatever the budget and the caps left of num_new_tokens
            # beyond the request's real tokens is drafts, cut to that count.
            # (mirrors vllm/v1/core/sched/scheduler.py:502-517)
            # BEGIN LAB 08.1: the drafts that fit go into scheduled_spec_decode_tokens
            # HINT: receives request (scheduled: its num_computed_tokens not yet advanced) and
            # HINT: num_new_tokens; fills scheduled_spec_decode_tokens. Of num_new_tokens, those
            # HINT: past request.num_tokens and its placeholders (async scheduling, 0 here) are
            # HINT: drafts: schedule that many of spec_token_ids (none if that is 0 or less).
            # HINT: Then clear request.spec_token_ids: fresh drafts arrive through
            # HINT: update_draft_token_ids after the step.
            if request.spec_token_ids:
                num_scheduled_spec_tokens = (
                    num_new_tokens
                    + request.num_computed_tokens
                    - request.num_tokens
                    - request.num_output_placeholders
                )
                if num_scheduled_spec_tokens > 0:
                    scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[
                        :num_scheduled_spec_tokens
                    ]
                # Fresh drafts arrive through update_draft_token_ids after the step.
                request.spec_token_ids = []
            # END LAB 08.1

            # Its images run in the encoder this step: reserve their cache
            # entries (mirrors vllm/v1/core/sched/scheduler.py:520-527).
            # BEGIN LAB 13.1: a scheduled running request's images: record them, reserve, charge
            # HINT: receives request, encoder_inputs_to_schedule (item indices) and
            # HINT: new_encoder_compute_budget; leaves encoder_compute_budget. Record the
            # HINT: items in scheduled_encoder_inputs, allocate each in the encoder cache.
            if encoder_inputs_to_schedule:
                scheduled_encoder_inputs[request.request_id] = encoder_inputs_to_schedule
                for item in encoder_inputs_to_schedule:
                    self.encoder_cache_manager.allocate(request, item)
                encoder_compute_budget = new_encoder_compute_budget
            # END LAB 13.1

        # Phase 2: admit WAITING requests in queue order while three gates
        # stay open. (Upstream checks the same three, in two `if`s and a
        # `while` condition around this loop: scheduler.py:545-549.)
        # (the loop mirrors vllm/v1/core/sched/scheduler.py:548-806)
        # The adapters the running requests scheduled this step already use
        # (vllm/v1/core/sched/scheduler.py:534-542).
        # BEGIN LAB 11.1: the adapters the running requests already use this step
        # HINT: receives scheduled_running_reqs; leaves scheduled_loras, the set of
        # HINT: adapter ids (lora_request.lora_int_id) of the running requests
        # HINT: scheduled this step (empty without a lora_config, and requests on the
        # HINT: base model, lora_request None, add nothing). Running requests were
        # HINT: admitted under the limit, so there are at most max_loras of them.
        scheduled_loras: set[int] = set()
        if self.lora_config is not None:
            scheduled_loras = {
                running_req.lora_request.lora_int_id
                for running_req in scheduled_running_reqs
                if running_req.lora_request is not None
            }
            assert len(scheduled_loras) <= self.lora_config.max_loras
        # END LAB 11.1
        step_skipped_waiting = create_request_queue(self.policy)
        while self.waiting or self.skipped_waiting:
            # BEGIN LAB 03.1: the three admission gates
            # HINT: receives preempted_reqs, token_budget and self.running; only breaks.
            # HINT: no admissions in a step that preempted (memory pressure: admitting
            # HINT: would only thrash); none without budget; none past max_num_seqs.
            if preempted_reqs:
                break
            if token_budget <= 0:
                break
            if len(self.running) == self.max_num_running_reqs:
                break
            # END LAB 03.1
            # BEGIN LAB 12.1: pass over a request whose grammar is still compiling
            # HINT: receives step_skipped_waiting; leaves request_queue and request (its
            # HINT: head, the request to admit), or moves on with `continue`.
            # HINT: _select_waiting_queue_for_scheduling picks the queue. A head in a
            # HINT: blocked status that _try_promote_blocked_waiting_request cannot
            # HINT: promote leaves its queue for this step, into step_skipped_waiting
            # HINT: (at the front), unless the attempt finished it.
            request_queue = self._select_waiting_queue_for_scheduling()
            request = request_queue.peek_request()
            if self._is_blocked_waiting_status(
                request.status
            ) and not self._try_promote_blocked_waiting_request(request):
                # Still compiling (or just failed): pass over it this step.
                request_queue.pop_request()
                if not request.is_finished():
                    step_skipped_waiting.prepend_request(request)
                continue
            # END LAB 12.1
            # A new adapter when max_loras are already in this step: pass over
            # the request, as over a compiling grammar (scheduler.py:571-581).
            # BEGIN LAB 11.1: hold back a request whose adapter would exceed max_loras
            # HINT: receives request (the head of request_queue), scheduled_loras and
            # HINT: step_skipped_waiting; moves on with `continue` or leaves request
            # HINT: to be admitted. An adapter not yet in this step's set, when the set
            # HINT: already holds max_loras ids, must wait: take it out of its queue for
            # HINT: this step (into step_skipped_waiting, at the front, as a compiling
            # HINT: grammar's request) so the requests behind it may still run. A request
            # HINT: on the base model, or on an adapter already in the set, goes on.
            if (
                self.lora_config is not None
                and request.lora_request is not None
                and len(scheduled_loras) == self.lora_config.max_loras
                and request.lora_request.lora_int_id not in scheduled_loras
            ):
                request_queue.pop_request()
                step_skipped_waiting.prepend_request(request)
                continue
            # END LAB 11.1

            num_external_computed_tokens = 0
            load_kv_async = False
            if request.num_computed_tokens == 0:
                # BEGIN LAB 03.6: prefix caching: start from the longest cached prefix
                # HINT: receives request; leaves new_computed_blocks,
                # HINT: num_new_local_computed_tokens and num_computed_tokens defined
                # HINT: (the code after it reads all three). The KV cache manager knows
                # HINT: which full blocks of this request are cached; their tokens
                # HINT: count as computed and cost no budget.
                new_computed_blocks, num_new_local_computed_tokens = (
                    self.kv_cache_manager.get_computed_blocks(request)
                )
                num_computed_tokens = num_new_local_computed_tokens
                # END LAB 03.6

                # A KV connector may hold more of the prompt than the local
                # prefix cache (mirrors vllm/v1/core/sched/scheduler.py:597-623).
                # BEGIN LAB 15.1: ask the connector for the tokens it holds beyond the local hit
                # HINT: receives request, num_new_local_computed_tokens, num_computed_tokens;
                # HINT: leaves num_external_computed_tokens, load_kv_async, num_computed_tokens.
                # HINT: Only with a connector. It answers (tokens, asynchronous?) for the
                # HINT: tokens past the LOCAL hit; None means "not known yet": pass the
                # HINT: request over this step (off the queue, into step_skipped_waiting).
                if self.connector is not None:
                    ext_tokens, load_kv_async = self.connector.get_num_new_matched_tokens(
                        request, num_new_local_computed_tokens
                    )
                    if ext_tokens is None:
                        # The connector cannot tell yet: ask again next step.
                        request_queue.pop_request()
                        step_skipped_waiting.prepend_request(request)
                        continue
                    num_external_computed_tokens = ext_tokens
                    num_computed_tokens += num_external_computed_tokens
                # END LAB 15.1
                assert num_computed_tokens <= request.num_tokens
                # Its first prefill's tokens by source, until its first output
                # hands them out (mirrors vllm/v1/core/sched/scheduler.py:626-632).
                if request.prefill_stats is not None:
                    request.prefill_stats.set(
                        request.num_prompt_tokens,
                        num_new_local_computed_tokens,
                        num_external_computed_tokens,
                    )
            else:
                # Its KV arrived asynchronously: num_computed_tokens says how
                # much (scheduler.py:635-639), and its blocks are held already.
                new_computed_blocks = self.kv_cache_manager.empty_kv_cache_blocks
                num_new_local_computed_tokens = 0
                num_computed_tokens = request.num_computed_tokens

            encoder_inputs_to_schedule = []
            new_encoder_compute_budget = encoder_compute_budget
            if load_kv_async:
                # Its KV loads between steps: blocks now, no work this step.
                num_new_tokens = 0
            else:
                # BEGIN LAB 03.2: how many of a waiting request's tokens to prefill now
                # HINT: receives request, num_computed_tokens, token_budget; leaves
                # HINT: num_new_tokens. num_tokens, not num_prompt_tokens: a resumed
                # HINT: request recomputes its outputs too. Then the threshold, then the
                # HINT: budget; without chunked prefill a prompt that does not fit whole
                # HINT: must wait (stop admitting).
                # Upstream inlines this clamp here too (vllm/v1/core/sched/scheduler.py:654-669):
                # the chunked-prefill check sits between threshold and budget, and a waiting
                # request needs no model-length cap, so _clamp_new_tokens does not fit.
                num_new_tokens = request.num_tokens - num_computed_tokens
                threshold = self.scheduler_config.long_prefill_token_threshold
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                if (
                    not self.scheduler_config.enable_chunked_prefill
                    and num_new_tokens > token_budget
                ):
                    break  # whole prompt or nothing, and it does not fit
                num_new_tokens = min(num_new_tokens, token_budget)
                # END LAB 03.2
                # Its images, as for a running request; one that does not fit
                # stops admissions (mirrors vllm/v1/core/sched/scheduler.py:671-686).
                if request.has_encoder_inputs:
                    encoder_inputs_to_schedule, num_new_tokens, new_encoder_compute_budget = (
                        self._try_schedule_encoder_inputs(
                            request, num_computed_tokens, num_new_tokens, encoder_compute_budget
                        )
                    )
                    if num_new_tokens == 0:
                        break

            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=num_new_local_computed_tokens,
                new_computed_blocks=new_computed_blocks,
                num_external_computed_tokens=num_external_computed_tokens,
                delay_cache_blocks=load_kv_async,
                full_sequence_must_fit=self.scheduler_config.scheduler_reserve_full_isl,
            )
            if new_blocks is None:
                # No memory: stop admitting (strict queue order), and drop the
                # references its cache hits took (scheduler.py:732-740).
                if request.has_encoder_inputs:
                    self.encoder_cache_manager.free(request)
                break

            # The connector learns the request's blocks, and how many of them
            # it fills (mirrors vllm/v1/core/sched/scheduler.py:742-760).
            # BEGIN LAB 15.1: tell the connector the request's blocks
            # HINT: receives request, num_external_computed_tokens; leaves nothing.
            # HINT: Every request admitted here (with a connector), even one with no
            # HINT: external tokens: ALL its blocks (get_blocks), not only the new ones.
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    request,
                    self.kv_cache_manager.get_blocks(request.request_id),
                    num_external_computed_tokens,
                )
            # END LAB 15.1

            request = request_queue.pop_request()
            # BEGIN LAB 15.2: an asynchronous load: wait in WAITING_FOR_REMOTE_KVS
            # HINT: receives request (off its queue now), load_kv_async, num_computed_tokens;
            # HINT: leaves nothing, or skips the rest of the loop. Its blocks are held; it
            # HINT: does not run this step: mark it, pass it over (step_skipped_waiting)
            # HINT: and count the tokens coming as computed.
            if load_kv_async:
                # Wait for the load in the blocked queue; num_computed_tokens
                # counts the tokens coming (scheduler.py:763-780).
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                step_skipped_waiting.prepend_request(request)
                request.num_computed_tokens = num_computed_tokens
                continue
            # END LAB 15.2
            self.running.append(request)
            # BEGIN LAB 03.4: a first-time request or a resumed one?
            # HINT: receives request (just moved to running); leaves nothing but the two lists.
            # HINT: the status says which; the two go to different parts of SchedulerOutput.
            if request.status == RequestStatus.WAITING:
                scheduled_new_reqs.append(request)
            elif request.status == RequestStatus.PREEMPTED:
                scheduled_resumed_reqs.append(request)
            else:
                raise RuntimeError(f"Invalid request status: {request.status}")
            # END LAB 03.4
            # BEGIN LAB 11.1: an admitted request's adapter joins the step's set
            # HINT: receives request (just admitted) and scheduled_loras; leaves
            # HINT: scheduled_loras holding its adapter id too (if it has one).
            if self.lora_config is not None and request.lora_request is not None:
                scheduled_loras.add(request.lora_request.lora_int_id)
            # END LAB 11.1
            # BEGIN LAB 03.1: admit the request and charge the budget
            # HINT: receives request, num_new_tokens, num_computed_tokens; leaves token_budget.
            # HINT: record its blocks (all of them: get_blocks) and its tokens, charge
            # HINT: the budget, mark it RUNNING, and set where its computation starts.
            req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
                request.request_id
            )
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            # END LAB 03.1
            if self.log_stats:  # (mirrors vllm/v1/core/sched/scheduler.py:785-788)
                request.record_event(EngineCoreEventType.SCHEDULED, scheduled_timestamp)
            # BEGIN LAB 13.1: an admitted request's images: record them, reserve, charge
            # HINT: receives request, encoder_inputs_to_schedule and
            # HINT: new_encoder_compute_budget; leaves encoder_compute_budget (as for a
            # HINT: running request above).
            if encoder_inputs_to_schedule:
                scheduled_encoder_inputs[request.request_id] = encoder_inputs_to_schedule
                for input_id in encoder_inputs_to_schedule:
                    self.encoder_cache_manager.allocate(request, input_id)
                encoder_compute_budget = new_encoder_compute_budget
            # END LAB 13.1

        # Skipped this step: back ahead of the older skipped ones (scheduler.py:822).
        # BEGIN LAB 12.1: the requests passed over this step go back to skipped_waiting
        # HINT: receives step_skipped_waiting; leaves self.skipped_waiting holding them,
        # HINT: ahead of the requests already there.
        if step_skipped_waiting:
            self.skipped_waiting.prepend_requests(step_skipped_waiting)
        # END LAB 12.1

        if self.log_stats:  # upstream records it in _preempt_request (scheduler.py:945)
            for request in preempted_reqs:
                request.record_event(EngineCoreEventType.PREEMPTED, scheduled_timestamp)

        # mirrors vllm/v1/core/sched/scheduler.py:826-921
        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs

        num_common_prefix_blocks = [0] * self.num_kv_cache_groups
        if self.running:
            num_common_prefix_blocks = self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0].request_id
            )

        new_reqs_data = [
            NewRequestData.from_request(req, req_to_new_blocks[req.request_id].get_block_ids())
            for req in scheduled_new_reqs
        ]
        cached_reqs_data = self._make_cached_request_data(
            scheduled_running_reqs, scheduled_resumed_reqs, req_to_new_blocks
        )
        self.prev_step_scheduled_req_ids = set(num_scheduled_tokens)

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={req.request_id for req in preempted_reqs},
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            scheduled_encoder_inputs=scheduled_encoder_inputs,
            # Evicted this step: the runner drops these outputs (scheduler.py:901).
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
        )
        # The connector packs this step's loads and saves for the workers and
        # resets its per-step state (scheduler.py:905-911).
        # BEGIN LAB 15.1: the step's connector metadata, for the workers
        # HINT: receives scheduler_output; leaves its kv_connector_metadata set (with
        # HINT: a connector). Once a step, before _update_after_schedule moves
        # HINT: num_computed_tokens on: the connector reads the step as scheduled.
        if self.connector is not None:
            scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(
                scheduler_output
            )
        # END LAB 15.1
        self._update_after_schedule(scheduler_output)
        # Upstream sets this inside _update_after_schedule (scheduler.py:968).
        scheduler_output.has_structured_output_requests = any(
            req.use_structured_output and not req.is_prefill_chunk
            for req in scheduled_running_reqs + scheduled_resumed_reqs + scheduled_new_reqs
        )
        return scheduler_output

    # ------------------------------------------------- the blocked waiting queue

    @staticmethod
    def _is_blocked_waiting_status(status: RequestStatus) -> bool:
        """Waiting, but not runnable yet (scheduler.py:1606; mini_vllm has the
        grammar and remote-KV waits of upstream's three)."""
        return status in (
            RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
            RequestStatus.WAITING_FOR_REMOTE_KVS,
        )

    # BEGIN LAB 12.1: a new or preempted request joins the queue its status says
    def _enqueue_waiting_request(self, request: Request) -> None:
        """Into skipped_waiting while it waits for its grammar, else into waiting."""
        # HINT: _is_blocked_waiting_status says which; both queues have add_request.
        if self._is_blocked_waiting_status(request.status):
            self.skipped_waiting.add_request(request)
        else:
            self.waiting.add_request(request)

    # END LAB 12.1

    # BEGIN LAB 12.1: which waiting queue the next admission comes from
    def _select_waiting_queue_for_scheduling(
        self,
    ) -> FCFSRequestQueue | PriorityRequestQueue | None:
        """FCFS: the skipped queue first (its requests are older); PRIORITY:
        whichever head comes first (scheduler.py:1619)."""
        # HINT: None when both are empty. Under PRIORITY, Request's `<` orders two
        # HINT: requests by (priority, arrival_time); peek_request shows a queue's head.
        if self.policy == SchedulingPolicy.FCFS:
            return self.skipped_waiting or self.waiting or None
        if self.waiting and self.skipped_waiting:
            waiting_req = self.waiting.peek_request()
            skipped_req = self.skipped_waiting.peek_request()
            return self.waiting if waiting_req < skipped_req else self.skipped_waiting
        return self.waiting or self.skipped_waiting or None

    # END LAB 12.1

    # BEGIN LAB 12.1: promote a request whose grammar is ready; fail one whose compile raised
    def _try_promote_blocked_waiting_request(self, request: Request) -> bool:
        """WAITING once its grammar has compiled (True); False while it compiles.

        A compile that raised finishes the request with FINISHED_ERROR (False):
        mini_vllm's addition, where upstream's engine would die on the
        exception (its TODO at vllm/v1/structured_output/__init__.py:181).
        update_from_output reports it.
        """
        # HINT: request.structured_output_request.grammar is None while the compile
        # HINT: runs, the grammar once it is done, and re-raises a compile's exception.
        # HINT: A failed request is freed and its id kept in self.failed_grammar_reqs.
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # Phase 15: runnable once the workers reported its load ended.
            return self._try_promote_remote_kv_request(request)
        assert request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        try:
            grammar = request.structured_output_request.grammar
        except Exception as e:
            logger.error("Request %s: its grammar failed to compile: %s", request.request_id, e)
            request.status = RequestStatus.FINISHED_ERROR
            self._free_request(request)
            self.failed_grammar_reqs.append(request.request_id)
            return False
        if grammar is None:
            return False
        request.status = RequestStatus.WAITING
        return True

    # END LAB 12.1

    # ------------------------------------------------------------ encoder inputs

    # BEGIN LAB 13.1: which images a chunk encodes; stop before one the budget cannot take
    # mirrors vllm/v1/core/sched/scheduler.py:1096-1257
    def _try_schedule_encoder_inputs(
        self,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        encoder_compute_budget: int,
    ) -> tuple[list[int], int, int]:
        """Which of the request's items to encode for the chunk
        ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.

        An item is encoded when the chunk reaches its placeholders, its output
        is neither in the KV cache already (placeholders all computed) nor in
        the encoder cache (a hit takes a reference instead), and the encoder
        budget and cache have room; the first item that has no room ends the
        chunk just before its placeholders (an encoder runs a whole item: its
        attention is bidirectional), or schedules nothing if the chunk already
        starts inside them (a prefix-cache hit can do that).
        Returns (item indices, num_new_tokens, encoder budget left).
        """
        # HINT: walk request.mm_features in prompt order; each has .identifier and
        # HINT: .mm_position (offset, length, get_num_embeds(), get_embeds_indices_in_range).
        # HINT: The encoder cache answers check_and_update_cache (a hit: skip it, it costs
        # HINT: nothing) and can_allocate(request, i, budget left, embeds already promised).
        # HINT: An image twice in one chunk is encoded once.
        if num_new_tokens == 0 or not request.has_encoder_inputs:
            return [], num_new_tokens, encoder_compute_budget
        encoder_inputs_to_schedule: list[int] = []
        # Items already encoded this step (an image twice in one prompt runs once).
        mm_hashes_to_schedule: set[str] = set()
        num_embeds_to_schedule = 0
        for i, mm_feature in enumerate(request.mm_features):
            start_pos = mm_feature.mm_position.offset
            num_encoder_tokens = mm_feature.mm_position.length
            num_encoder_embeds = mm_feature.mm_position.get_num_embeds()
            if start_pos >= num_computed_tokens + num_new_tokens:
                break  # items are in prompt order: no later one is reached either
            if start_pos + num_encoder_tokens <= num_computed_tokens:
                continue  # its placeholders are in the KV cache already
            if mm_feature.identifier in mm_hashes_to_schedule:
                continue
            if self.encoder_cache_manager.check_and_update_cache(request, i):
                continue  # encoded by an earlier step (this request's or another's)
            if (
                self.scheduler_config.disable_chunked_mm_input
                and num_computed_tokens < start_pos
                and num_computed_tokens + num_new_tokens < start_pos + num_encoder_tokens
            ):
                # The chunk would cut the item's placeholders: stop before them.
                num_new_tokens = start_pos - num_computed_tokens
                break
            if not self.encoder_cache_manager.can_allocate(
                request, i, encoder_compute_budget, num_embeds_to_schedule
            ):
                if num_computed_tokens < start_pos:
                    num_new_tokens = start_pos - num_computed_tokens
                else:
                    num_new_tokens = 0
                break
            # Placeholder positions of the chunk that take no embedding (is_embed
            # False) need no encoder output.
            start_idx_rel = max(0, num_computed_tokens - start_pos)
            end_idx_rel = min(num_encoder_tokens, num_computed_tokens + num_new_tokens - start_pos)
            embeds_start, embeds_end = mm_feature.mm_position.get_embeds_indices_in_range(
                start_idx_rel, end_idx_rel
            )
            if embeds_end - embeds_start == 0:
                continue
            num_embeds_to_schedule += num_encoder_embeds
            encoder_compute_budget -= num_encoder_embeds
            mm_hashes_to_schedule.add(mm_feature.identifier)
            encoder_inputs_to_schedule.append(i)
        return encoder_inputs_to_schedule, num_new_tokens, encoder_compute_budget

    # END LAB 13.1

    # BEGIN LAB 13.1: release the images whose placeholders are all computed
    # mirrors vllm/v1/core/sched/scheduler.py:1667-1689
    def _free_encoder_inputs(self, request: Request) -> None:
        """Drop the request's references to items whose placeholders are all
        computed: their embeddings now live in the KV cache."""
        # HINT: the encoder cache's get_cached_input_ids(request) and
        # HINT: free_encoder_input(request, input_id); copy the set before freeing.
        for input_id in list(self.encoder_cache_manager.get_cached_input_ids(request)):
            position = request.mm_features[input_id].mm_position
            if position.offset + position.length <= request.num_computed_tokens:
                self.encoder_cache_manager.free_encoder_input(request, input_id)

    # END LAB 13.1

    # BEGIN LAB 12.2: which requests get bitmask rows this step, and in what order
    # mirrors vllm/v1/core/sched/scheduler.py:1259-1281
    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The bitmask of the structured requests that sample this step, rows
        in scheduled order (None when there are none)."""
        # HINT: scheduler_output.num_scheduled_tokens is in scheduled order. A request
        # HINT: still mid-prefill (is_prefill_chunk) samples nothing: no row. The
        # HINT: manager's grammar_bitmask builds the rows (drafts included).
        if not scheduler_output.has_structured_output_requests:
            return None
        structured_output_request_ids = [
            req_id
            for req_id in scheduler_output.num_scheduled_tokens
            if (req := self.requests.get(req_id))
            and req.use_structured_output
            and not req.is_prefill_chunk
        ]
        if not structured_output_request_ids:
            return None
        bitmask = self.structured_output_manager.grammar_bitmask(
            self.requests,
            structured_output_request_ids,
            scheduler_output.scheduled_spec_decode_tokens,
        )
        return GrammarOutput(structured_output_request_ids, bitmask)

    # END LAB 12.2

    # BEGIN LAB 03.4: running and resumed requests as deltas (CachedRequestData)
    # mirrors vllm/v1/core/sched/scheduler.py:1036-1094
    def _make_cached_request_data(
        self,
        running_reqs: list[Request],
        resumed_reqs: list[Request],
        req_to_new_blocks: dict[str, KVCacheBlocks],
    ) -> CachedRequestData:
        """One ``CachedRequestData`` for the running requests scheduled this step,
        then the resumed ones, as parallel lists in that order.

        Workers keep every request they were sent; for those they saw last
        step only the new block ids and counts travel. A request the
        workers did not see last step (resumed, or skipped for a step) gets
        its whole token list in ``all_token_ids``.
        """
        # HINT: one entry per request in running_reqs + resumed_reqs (that order).
        # HINT: "seen last step" is self.prev_step_scheduled_req_ids.
        # HINT: new block ids: req_to_new_blocks[req_id].get_block_ids(allow_none=True).
        req_ids: list[str] = []
        new_block_ids: list[tuple[list[int], ...] | None] = []
        all_token_ids: dict[str, list[int]] = {}
        num_computed_tokens: list[int] = []
        num_output_tokens: list[int] = []
        for req in running_reqs + resumed_reqs:
            req_id = req.request_id
            req_ids.append(req_id)
            if req_id not in self.prev_step_scheduled_req_ids:
                # The workers did not see it last step: send every token.
                all_token_ids[req_id] = req.all_token_ids.copy()
            new_block_ids.append(req_to_new_blocks[req_id].get_block_ids(allow_none=True))
            num_computed_tokens.append(req.num_computed_tokens)
            num_output_tokens.append(req.num_output_tokens)
        return CachedRequestData(
            req_ids=req_ids,
            resumed_req_ids={req.request_id for req in resumed_reqs},
            new_token_ids=[],
            all_token_ids=all_token_ids,
            new_block_ids=new_block_ids,
            num_computed_tokens=num_computed_tokens,
            num_output_tokens=num_output_tokens,
        )

    # END LAB 03.4

    # BEGIN LAB 03.3: preempt one request (recompute, not swap)
    # mirrors vllm/v1/core/sched/scheduler.py:929-949
    def _preempt_request(self, request: Request) -> None:
        """Free the request's KV cache and send it back to the waiting queue.

        The caller has already taken it out of ``self.running``. Its tokens
        are kept; its KV is recomputed when it is admitted again (vLLM v1
        has no swapping). Prefix caching often makes that recompute cheap:
        its freed blocks stay cached until reused.
        """
        # HINT: free its KV blocks (and its encoder-cache references); PREEMPTED;
        # HINT: nothing computed any more; count the
        # HINT: preemption; and put it at the FRONT of the waiting queue.
        assert request.status == RequestStatus.RUNNING, "Only running requests can be preempted"
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # drafts for KV it no longer has
        request.num_preemptions += 1
        self.waiting.prepend_request(request)

    # END LAB 03.3

    # BEGIN LAB 03.2: advance num_computed_tokens when the step is scheduled
    # mirrors vllm/v1/core/sched/scheduler.py:951-991
    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advance num_computed_tokens now, before the model runs, so the
        next schedule() can plan the next chunk straight away. The output
        above already recorded the pre-step counts the runner needs."""
        # HINT: every scheduled request moves forward by its scheduled tokens; it is
        # HINT: still a prefill chunk while computed < num_tokens. Then start a new
        # HINT: finished_req_ids set (the output holds on to the old one).
        for req_id, num_scheduled_token in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_scheduled_token
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
        # A new set, not clear(): the output just built still refers to the old one.
        self.finished_req_ids = set()

    # END LAB 03.2

    # ------------------------------------------------------- update_from_output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Take in the sampled tokens: append them, check stops, free the finished."""
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        req_id_to_index = model_runner_output.req_id_to_index
        outputs: list[EngineCoreOutput] = []
        stopped_running_reqs: set[Request] = set()
        spec_decoding_stats: SpecDecodingStats | None = None
        kv_connector_output = model_runner_output.kv_connector_output
        # mini only: transfers a get_finished that keeps raising never reports.
        if kv_connector_output is not None:
            kv_connector_output = self._give_up_on_kv_transfers(kv_connector_output)

        # Blocks whose external KV failed to load: their requests go back to
        # the last good block (mirrors vllm/v1/core/sched/scheduler.py:1311-1319).
        failed_kv_load_req_ids: set[str] = set()
        if kv_connector_output and kv_connector_output.invalid_block_ids:
            failed_kv_load_req_ids = self._handle_invalid_blocks(
                kv_connector_output.invalid_block_ids, scheduler_output.num_scheduled_tokens
            )

        # Runs once per scheduled request every step: keep its body lean
        # (upstream's note, vllm/v1/core/sched/scheduler.py:1342).
        for req_id in scheduler_output.num_scheduled_tokens:
            if failed_kv_load_req_ids and req_id in failed_kv_load_req_ids:
                continue  # its step computed on bad KV: nothing it sampled counts
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted while the model was running
            req_index = req_id_to_index[req_id]
            new_token_ids = sampled_token_ids[req_index] if sampled_token_ids else []

            # Rejected drafts were counted as computed by _update_after_schedule:
            # take them back, so the next step recomputes from the first rejected
            # position. The runner returns accepted drafts + 1 token of its own.
            # (mirrors vllm/v1/core/sched/scheduler.py:1368-1390)
            # BEGIN LAB 08.1: roll back the rejected drafts and count them in the stats
            # HINT: receives request, req_id, new_token_ids and spec_decoding_stats; leaves
            # HINT: spec_decoding_stats (updated through self.make_spec_decoding_stats).
            # HINT: only for a request that had drafts scheduled and got tokens back: of
            # HINT: len(new_token_ids) tokens, one is the target's own, the rest accepted
            # HINT: drafts. Take the REJECTED drafts off num_computed_tokens (if above 0), and
            # HINT: off num_output_placeholders (if above 0: async scheduling, 0 here).
            scheduled_spec_token_ids = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if scheduled_spec_token_ids and new_token_ids:
                num_draft_tokens = len(scheduled_spec_token_ids)
                num_accepted = len(new_token_ids) - 1
                num_rejected = num_draft_tokens - num_accepted
                if request.num_computed_tokens > 0:
                    request.num_computed_tokens -= num_rejected
                # Async scheduling counted the drafts as placeholders too.
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= num_rejected
                spec_decoding_stats = self.make_spec_decoding_stats(
                    spec_decoding_stats, num_draft_tokens, num_accepted
                )
            # END LAB 08.1

            # Images now wholly in the KV cache are done with (the step ran).
            if request.has_encoder_inputs:
                self._free_encoder_inputs(request)

            stopped = False
            if new_token_ids:
                new_token_ids, stopped = self._update_request_with_output(request, new_token_ids)
            # The kept tokens advance the grammar; one it refuses ends the
            # request with an error (mirrors vllm/v1/core/sched/scheduler.py:1416-1431).
            # BEGIN LAB 12.3: the kept tokens advance the request's grammar
            # HINT: receives request, req_id, new_token_ids (the kept ones) and stopped;
            # HINT: leaves stopped. Only for requests the manager says should_advance.
            # HINT: A grammar that refuses a token it allowed is a bug somewhere: end
            # HINT: the request with FINISHED_ERROR (and log it).
            if new_token_ids and self.structured_output_manager.should_advance(request):
                grammar = request.structured_output_request.grammar
                if not grammar.accept_tokens(req_id, new_token_ids):
                    logger.error(
                        "Unexpected: grammar rejected tokens %s for request %s. "
                        "Terminating request.",
                        new_token_ids,
                        req_id,
                    )
                    request.status = RequestStatus.FINISHED_ERROR
                    stopped = True
            # END LAB 12.3
            # BEGIN LAB 03.5: a stopped request is finished and freed at once
            # HINT: receives request, stopped, stopped_running_reqs; leaves finish_reason
            # HINT: (None unless it stopped). Read its finish reason, free it, and remember
            # HINT: to drop it from running.
            finish_reason = None
            if stopped:
                finish_reason = request.get_finished_reason()
                self._free_request(request)
                stopped_running_reqs.add(request)
            # END LAB 03.5

            if new_token_ids or stopped:
                new_logprobs = None
                if logprobs is not None and request.sampling_params.logprobs is not None:
                    new_logprobs = logprobs[req_index][: len(new_token_ids)]
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        finish_reason=finish_reason,
                        stop_reason=request.stop_reason,
                        new_logprobs=new_logprobs,
                        kv_transfer_params=self.finished_kv_transfer_params.pop(req_id, None),
                        events=request.take_events(),
                        prefill_stats=request.take_prefill_stats(),
                    )
                )

        # Requests whose grammar failed to compile, finished in schedule().
        for req_id in self.failed_grammar_reqs:
            outputs.append(EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR))
        self.failed_grammar_reqs = []

        # BEGIN LAB 03.5: drop the stopped requests from running
        # HINT: receives stopped_running_reqs; leaves self.running without them.
        # HINT: remove_all returns the new list; keep running's order.
        if stopped_running_reqs:
            self.running = remove_all(self.running, stopped_running_reqs)
        # END LAB 03.5

        # kv_load_failure_policy="fail": the requests that lost loaded KV end
        # with an error (mirrors vllm/v1/core/sched/scheduler.py:1535-1547).
        if failed_kv_load_req_ids and not self.recompute_kv_load_failures:
            requests = [self.requests[req_id] for req_id in failed_kv_load_req_ids]
            self.finish_requests(failed_kv_load_req_ids, RequestStatus.FINISHED_ERROR)
            for request in requests:
                outputs.append(
                    EngineCoreOutput(
                        request.request_id,
                        [],
                        finish_reason=request.get_finished_reason(),
                        events=request.take_events(),
                    )
                )

        if kv_connector_output:
            self._update_from_kv_xfer_finished(kv_connector_output)
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(spec_decoding_stats)
        )

    # BEGIN LAB 03.5: append sampled tokens one by one, stop at the first that ends it
    # mirrors vllm/v1/core/sched/scheduler.py:1649-1665
    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Append tokens one at a time; stop at the first that ends the request.

        Returns the tokens actually kept (cut after the stopping token) and
        whether the request stopped.
        """
        # HINT: request.append_output_token_ids, then check_stop(request, self.max_model_len).
        stopped = False
        for num_new, output_token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(output_token_id)
            stopped = check_stop(request, self.max_model_len)
            if stopped:
                new_token_ids = new_token_ids[:num_new]
                break
        return new_token_ids, stopped

    # END LAB 03.5

    # mirrors vllm/v1/core/sched/scheduler.py:1691-1711
    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Give each request the drafts proposed after this step. A request
        finished meanwhile is skipped; a structured request's drafts are cut
        at the first one its grammar refuses (Phase 12); one still mid-prefill
        keeps none (its next tokens are prompt tokens, not guesses)."""
        for req_id, spec_token_ids in zip(
            draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True
        ):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if self.structured_output_manager.should_advance(request):
                grammar = request.structured_output_request.grammar
                spec_token_ids = grammar.validate_tokens(spec_token_ids)
            self._set_drafts(request, spec_token_ids)

    # BEGIN LAB 08.1: hand a request its fresh drafts (none while it prefills)
    def _set_drafts(self, request: Request, spec_token_ids: list[int]) -> None:
        """Store the drafts the next step verifies, unless the request is
        still prefilling: its next tokens are prompt tokens, not guesses."""
        # HINT: Request.is_prefill_chunk says whether the request is mid-prefill.
        request.spec_token_ids = [] if request.is_prefill_chunk else spec_token_ids

    # END LAB 08.1

    # ------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request. Bad input raises ValueError and changes nothing."""
        if request.request_id in self.requests:
            raise ValueError(
                f"Duplicate request id {request.request_id!r}: it is already in the scheduler."
            )
        if request.num_prompt_tokens == 0:
            raise ValueError(f"Request {request.request_id!r} has an empty prompt.")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"Request {request.request_id!r}: the prompt (length "
                f"{request.num_prompt_tokens}) leaves no room for an output token within "
                f"max_model_len={self.max_model_len}; prompts must be shorter than "
                "max_model_len."
            )
        if request.num_prompt_tokens + request.sampling_params.min_tokens > self.max_model_len:
            # Upstream accepts this and then livelocks: check_stop ignores
            # max_model_len until min_tokens is met, while the clamp in
            # schedule() lets no token past max_model_len - 1.
            raise ValueError(
                f"Request {request.request_id!r}: prompt length {request.num_prompt_tokens} "
                f"+ min_tokens {request.sampling_params.min_tokens} exceeds "
                f"max_model_len={self.max_model_len}, so min_tokens could never be met."
            )
        if request.status not in (
            RequestStatus.WAITING,
            RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
        ):
            raise ValueError(f"Request {request.request_id!r} is {request.status}, not WAITING.")
        self._check_encoder_inputs_fit(request)
        self._enqueue_waiting_request(request)
        self.requests[request.request_id] = request
        if self.connector is not None:
            self.connector.on_new_request(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def _check_encoder_inputs_fit(self, request: Request) -> None:
        """A ValueError for an item the encoder could never take: more
        embeddings than the encoder cache holds (upstream's input processor
        refuses it: vllm/v1/engine/input_processor.py:451), or than one step
        may encode (upstream's budget is never below the largest item its
        processor can make; a bigger one would wait forever)."""
        limit = min(self.encoder_cache_manager.cache_size, self.max_num_encoder_input_tokens)
        for i, feature in enumerate(request.mm_features):
            num_embeds = feature.mm_position.get_num_embeds()
            if num_embeds > limit:
                raise ValueError(
                    f"Request {request.request_id!r}: its {feature.modality} item {i} has "
                    f"{num_embeds} encoder embeddings, more than the encoder can ever take "
                    f"(encoder_cache_size {self.encoder_cache_manager.cache_size}, "
                    f"max_num_encoder_input_tokens {self.max_num_encoder_input_tokens}); "
                    "send a smaller image or raise both."
                )

    # mirrors vllm/v1/core/sched/scheduler.py:1779-1840
    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[str]:
        """Finish requests from outside (e.g. abort). Unknown or already
        finished ids are ignored. ``None`` finishes everything. Returns the
        ids actually finished."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status} is not a finished status.")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        elif request_ids is None:
            request_ids = list(self.requests)
        else:
            request_ids = set(request_ids)

        running_to_remove: set[Request] = set()
        waiting_to_remove: list[Request] = []
        valid_requests: list[Request] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            valid_requests.append(request)
            if request.status == RequestStatus.RUNNING:
                running_to_remove.add(request)
            else:
                waiting_to_remove.append(request)
        if running_to_remove:
            self.running = remove_all(self.running, running_to_remove)
        if waiting_to_remove:
            self.waiting.remove_requests(waiting_to_remove)
            self.skipped_waiting.remove_requests(waiting_to_remove)
        for request in valid_requests:
            # A request still loading keeps its blocks until the load ends:
            # the workers may be writing into them (scheduler.py:1827-1836).
            delay_free_blocks = False
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                delay_free_blocks = request.request_id not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(request.request_id)
                self.failed_recving_kv_req_ids.discard(request.request_id)
            request.status = finished_status
            self._free_request(request, delay_free_blocks=delay_free_blocks)
            self.finished_kv_transfer_params.pop(request.request_id, None)
        return [r.request_id for r in valid_requests]

    # mirrors vllm/v1/core/sched/scheduler.py:1842-1863
    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> None:
        """Finished: tell the workers, and free its blocks unless a KV
        transfer still uses them (then ``_update_from_kv_xfer_finished``
        frees them when the workers report it done)."""
        assert request.is_finished()
        connector_delay_free_blocks = self._connector_finished(request)
        self.encoder_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        if not (delay_free_blocks or connector_delay_free_blocks):
            self._free_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        assert request.is_finished()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.skipped_waiting) + len(self.running)

    def has_finished_requests(self) -> bool:
        """Finished ids to tell the workers, or finished requests whose
        blocks a KV transfer still holds (scheduler.py:1884-1894)."""
        if self.finished_req_ids:
            return True
        if self.connector is None:
            return False
        num_in_queues = len(self.waiting) + len(self.skipped_waiting) + len(self.running)
        return len(self.requests) > num_in_queues

    # ------------------------------------------------------------ KV connector

    def get_kv_connector(self) -> KVConnectorBase_V1 | None:
        return self.connector

    # mirrors vllm/v1/core/sched/scheduler.py:2038-2067
    # BEGIN LAB 15.1: tell the connector the request finished; True: it still reads the blocks
    def _connector_finished(self, request: Request) -> bool:
        """Tell the connector the request finished, with its block ids; True
        when the connector still reads them (an asynchronous save). The
        parameters it returns go out with the request's last output."""
        # HINT: receives request (finished); returns request_finished's first answer (False
        # HINT: without a connector). It takes the request's block ids (one group: a 1-tuple);
        # HINT: its second answer, when not None, is kept in finished_kv_transfer_params.
        if self.connector is None:
            return False
        (block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)
        delay_free_blocks, kv_transfer_params = self.connector.request_finished(request, block_ids)
        if kv_transfer_params is not None:
            self.finished_kv_transfer_params[request.request_id] = kv_transfer_params
        return delay_free_blocks

    # END LAB 15.1

    # mirrors vllm/v1/core/sched/scheduler.py:2069-2101
    # BEGIN LAB 15.2: its load ended: cache the loaded blocks (or give them back)
    def _update_waiting_for_remote_kv(self, request: Request) -> None:
        """Its load ended: register the loaded blocks in the prefix cache (or,
        if every loaded token failed, give the blocks back)."""
        # HINT: receives request (its load reported done); leaves it ready to schedule. A
        # HINT: failed load (failed_recving_kv_req_ids) was cut back to its last good block:
        # HINT: cache up to there, or free the blocks if nothing is left. A clean one caches
        # HINT: num_computed_tokens; a hit on every token recomputes the last one (its
        # HINT: logits give the first output token).
        assert self.connector is not None
        if request.request_id in self.failed_recving_kv_req_ids:
            # _update_requests_with_invalid_blocks cut num_computed_tokens back.
            if request.num_computed_tokens:
                self._cache_blocks(request, request.num_computed_tokens)
            else:
                self.kv_cache_manager.free(request)
            self.failed_recving_kv_req_ids.remove(request.request_id)
        else:
            self._cache_blocks(request, request.num_computed_tokens)
            # A hit on the whole prompt: recompute the last token, whose
            # logits sample the first output token.
            if request.num_computed_tokens == request.num_tokens:
                request.num_computed_tokens = request.num_tokens - 1
        self.finished_recving_kv_req_ids.remove(request.request_id)

    # END LAB 15.2

    def _cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Upstream's KVCacheManager.cache_blocks checks enable_caching itself
        (kv_cache_manager.py:552); mini_vllm's (Lab 02.3) leaves it to callers."""
        if self.kv_cache_manager.enable_caching:
            self.kv_cache_manager.cache_blocks(request, num_computed_tokens)

    # mirrors vllm/v1/core/sched/scheduler.py:2107-2117
    # BEGIN LAB 15.2: WAITING (or PREEMPTED) once the workers reported the load
    def _try_promote_remote_kv_request(self, request: Request) -> bool:
        """WAITING (PREEMPTED if it was preempted before) once the workers
        reported its load ended; False until then."""
        # HINT: receives request (WAITING_FOR_REMOTE_KVS); returns whether it can be
        # HINT: scheduled now. The status after: PREEMPTED if it was ever preempted, else
        # HINT: WAITING.
        if request.request_id not in self.finished_recving_kv_req_ids:
            return False
        self._update_waiting_for_remote_kv(request)
        request.status = (
            RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        )
        return True

    # END LAB 15.2

    # mirrors vllm/v1/core/sched/scheduler.py:2136-2163
    # BEGIN LAB 15.2: the workers' report: loads and saves that ended
    def _update_from_kv_xfer_finished(self, kv_connector_output: KVConnectorOutput) -> None:
        """The workers' report: loads that ended make their requests
        schedulable; saves that ended free their finished requests' blocks."""
        # HINT: receives kv_connector_output; leaves finished_recving_kv_req_ids grown and
        # HINT: the blocks of finished requests freed. Tell the connector first. A finished
        # HINT: load: the request is promoted later if still waiting, freed now if it was
        # HINT: aborted meanwhile. A finished save: free the (finished) request's blocks.
        if self.connector is not None:
            self.connector.update_connector_output(kv_connector_output)
        for req_id in kv_connector_output.finished_recving or ():
            assert req_id in self.requests, f"finished_recving: unknown request {req_id!r}"
            request = self.requests[req_id]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            else:
                # Aborted while loading: its blocks were kept until now.
                assert request.is_finished()
                self._free_blocks(request)
        for req_id in kv_connector_output.finished_sending or ():
            # mini only: the runner also reports finished requests whose save
            # raised; one whose blocks were not held is already gone.
            if req_id in self.requests:
                self._free_blocks(self.requests[req_id])

    # END LAB 15.2

    # mirrors vllm/v1/core/sched/scheduler.py:2165-2266
    # BEGIN LAB 15.2: cut back the requests that read a block that failed to load
    def _update_requests_with_invalid_blocks(
        self,
        requests: Iterable[Request],
        invalid_block_ids: set[int],
        num_scheduled_tokens: dict[str, int],
        evict_blocks: bool = True,
    ) -> tuple[set[str], int, set[int]]:
        """Cut each affected request's num_computed_tokens back to its first
        invalid block. Returns the affected ids, the tokens to recompute, and
        the blocks to evict from the prefix cache (the invalid ones and all
        after them). A block shared with a request earlier in the scan is
        recomputed by that one only."""
        # HINT: receives the requests to scan, the failed block ids, the step's
        # HINT: num_scheduled_tokens; returns (affected ids, tokens to recompute, blocks to
        # HINT: evict). Only blocks computed BEFORE this step count; cut num_computed_tokens
        # HINT: to the first bad block's start. A bad block already claimed by an earlier
        # HINT: request in the scan is that one's to recompute.
        affected_req_ids: set[str] = set()
        total_affected_tokens = 0
        blocks_to_evict: set[int] = set()
        marked_invalid_block_ids: set[int] = set()
        for request in requests:
            is_affected = False
            marked_invalid_block = False
            req_id = request.request_id
            (req_block_ids,) = self.kv_cache_manager.get_block_ids(req_id)
            # Only blocks computed before this step can hold loaded tokens.
            req_num_computed_tokens = request.num_computed_tokens - num_scheduled_tokens.get(
                req_id, 0
            )
            req_num_computed_blocks = (
                req_num_computed_tokens + self.block_size - 1
            ) // self.block_size
            for idx, block_id in zip(range(req_num_computed_blocks), req_block_ids, strict=False):
                if block_id not in invalid_block_ids:
                    continue
                is_affected = True
                if block_id in marked_invalid_block_ids:
                    continue  # an earlier request recomputes it
                marked_invalid_block_ids.add(block_id)
                if marked_invalid_block:
                    continue  # already cut back at an earlier block
                marked_invalid_block = True
                request.num_computed_tokens = idx * self.block_size
                total_affected_tokens += req_num_computed_tokens - request.num_computed_tokens
                if evict_blocks:
                    blocks_to_evict.update(req_block_ids[idx:])
            if is_affected:
                if not marked_invalid_block:
                    # Every bad block is recomputed by an earlier request:
                    # keep only what was computed before this step.
                    total_affected_tokens += request.num_computed_tokens - req_num_computed_tokens
                    request.num_computed_tokens = req_num_computed_tokens
                affected_req_ids.add(req_id)
        return affected_req_ids, total_affected_tokens, blocks_to_evict

    # END LAB 15.2

    # mirrors vllm/v1/core/sched/scheduler.py:2268-2335
    def _handle_invalid_blocks(
        self, invalid_block_ids: set[int], num_scheduled_tokens: dict[str, int]
    ) -> set[str]:
        """Requests hit by blocks that failed to load. Asynchronous loads are
        marked to retry once their load ends; the running requests returned
        are skipped by update_from_output (their step is redone); with the
        "fail" policy every affected request is returned, to be finished."""
        async_load_reqs = (
            req
            for req in self.skipped_waiting
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        )
        async_failed_req_ids, num_failed_tokens, _ = self._update_requests_with_invalid_blocks(
            async_load_reqs, invalid_block_ids, num_scheduled_tokens, evict_blocks=False
        )
        sync_failed_req_ids, num_sync_failed_tokens, sync_blocks_to_evict = (
            self._update_requests_with_invalid_blocks(
                self.running, invalid_block_ids, num_scheduled_tokens, evict_blocks=True
            )
        )
        num_failed_requests = len(async_failed_req_ids) + len(sync_failed_req_ids)
        num_failed_tokens += num_sync_failed_tokens
        if not num_failed_requests:
            return set()
        if sync_blocks_to_evict and not self.recompute_kv_load_failures:
            self.kv_cache_manager.evict_blocks(sync_blocks_to_evict)
        if not self.recompute_kv_load_failures:
            logger.error(
                "Failing %d request(s) on KV load failure (%d tokens affected): %s",
                num_failed_requests,
                num_failed_tokens,
                async_failed_req_ids | sync_failed_req_ids,
            )
            return async_failed_req_ids | sync_failed_req_ids
        logger.warning(
            "Recovered from KV load failure: %d request(s) rescheduled (%d tokens affected).",
            num_failed_requests,
            num_failed_tokens,
        )
        self.failed_recving_kv_req_ids |= async_failed_req_ids
        return sync_failed_req_ids

    def _give_up_on_kv_transfers(self, output: KVConnectorOutput) -> KVConnectorOutput:
        """mini only: the workers' report, with the transfers that a raising
        get_finished has left hanging ended as failures the rest of
        update_from_output already handles.

        A transfer is awaited by a request in WAITING_FOR_REMOTE_KVS (its
        load) or by a finished request whose blocks are held (a save or send,
        or a load it was aborted in). Once get_finished has raised
        MAX_GET_FINISHED_FAILURES steps in a row while a transfer was
        awaited, that transfer is given up: a load ends in finished_recving
        with the blocks it was filling in invalid_block_ids, so the request
        is recomputed or fails alone by kv_load_failure_policy; a finished
        request ends in finished_sending, so its blocks are freed. A call
        that does not raise resets the count. A report that comes after
        (the connector recovered) is dropped for those requests."""
        sending = set(output.finished_sending or ())
        recving = set(output.finished_recving or ())
        late = self.given_up_kv_req_ids & (sending | recving)
        self.given_up_kv_req_ids -= late
        sending -= late
        recving -= late
        invalid_block_ids = set(output.invalid_block_ids)
        counts: dict[str, int] = {}
        if output.get_finished_failed:
            for req_id, request in self.requests.items():
                loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                if req_id in self.finished_recving_kv_req_ids or not (
                    loading or request.is_finished()
                ):
                    continue  # nothing awaited
                count = self.num_get_finished_failures.get(req_id, 0) + 1
                if count < self.MAX_GET_FINISHED_FAILURES:
                    counts[req_id] = count
                    continue
                logger.error(
                    "Request %s: giving up its KV transfer, get_finished raised %d steps in a row.",
                    req_id,
                    count,
                )
                self.given_up_kv_req_ids.add(req_id)
                if loading:
                    recving.add(req_id)
                    invalid_block_ids |= self._loading_block_ids(request)
                else:
                    sending.add(req_id)
        self.num_get_finished_failures = counts
        return dataclasses.replace(
            output,
            finished_sending=sending or None,
            finished_recving=recving or None,
            invalid_block_ids=invalid_block_ids,
        )

    def _loading_block_ids(self, request: Request) -> set[int]:
        """The blocks an asynchronous load fills: those holding its computed
        tokens that are not in the prefix cache (a load's blocks are cached
        only once it ends; a local hit's blocks already are)."""
        (blocks,) = self.kv_cache_manager.get_blocks(request.request_id).blocks
        num_blocks = -(-request.num_computed_tokens // self.block_size)
        return {block.block_id for block in blocks[:num_blocks] if block.block_hash is None}

    def make_stats(
        self, spec_decoding_stats: SpecDecodingStats | None = None
    ) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_skipped_waiting_reqs=len(self.skipped_waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            spec_decoding_stats=spec_decoding_stats,
        )

    # mirrors vllm/v1/core/sched/scheduler.py:2006-2023
    def make_spec_decoding_stats(
        self,
        spec_decoding_stats: SpecDecodingStats | None,
        num_draft_tokens: int,
        num_accepted_tokens: int,
    ) -> SpecDecodingStats | None:
        """Add one request's verified draft to this step's stats (created on
        the first one); None when stats are off."""
        if not self.log_stats or not num_draft_tokens:
            return None
        if spec_decoding_stats is None:
            spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
        spec_decoding_stats.observe_draft(num_draft_tokens, num_accepted_tokens)
        return spec_decoding_stats

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Empty the prefix cache; False (nothing done) while a request holds blocks.

        With ``reset_running_requests``, first preempt every running request,
        last first, so they resume in their running order; then nothing holds a
        block and the reset succeeds (upstream can still fail here, on requests
        waiting for remote KV). Upstream: scheduler.py:1896.
        """
        if reset_running_requests:
            while self.running:
                request = self.running.pop()
                self._preempt_request(request)
                if self.log_stats:
                    request.record_event(EngineCoreEventType.PREEMPTED)
            # They were not scheduled by this step any more.
            self.prev_step_scheduled_req_ids.clear()
        return self.kv_cache_manager.reset_prefix_cache()
