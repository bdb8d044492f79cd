"""Preemption by swapping: vLLM v0's other way to make room (Phase 19).

Not upstream at the pin: vLLM v1 (v0.22.1) only preempts by recompute
(``_preempt_request``, vllm/v1/core/sched/scheduler.py:929). This module
rebuilds, on top of mini_vllm's v1 ``Scheduler``, the swapping that vLLM v0
had, as read in vllm-project/vllm at commit
0054e1fa0f8ac79f0524b6b1f4d7c02f9e37eca1, vllm/core/scheduler.py:
``PreemptionMode.SWAP``, the ``swapped`` queue, ``_swap_out`` /
``_swap_in`` and ``SchedulerOutputs.blocks_to_swap_out`` (GPU -> CPU) /
``blocks_to_swap_in`` (CPU -> GPU), which the worker's ``CacheEngine``
copied before the step's forward.

How it works here:
- a victim's KV blocks (those its computed tokens fill) are given CPU
  blocks from a second, smaller pool of ``cache_config.num_cpu_blocks``;
  its GPU blocks are freed; it keeps its computed count and waits in
  ``self.swapped`` (v0's SWAPPED state: v1's ``RequestStatus`` has no such
  member, so a swapped request is PREEMPTED and in ``self.swapped``);
- a step that preempted nobody swaps requests back in, oldest first,
  while the GPU pool has room: fresh GPU blocks, the CPU ones freed. It
  does so after the running requests are scheduled and before the first
  admission, as v0's ``_schedule_chunked_prefill`` did (running, then
  swapped, then new prefills); a step that tries no admission swaps in at
  its end. Each goes to the front of the waiting queue holding its blocks
  and its computed count, so it is admitted before any waiting request,
  with no recompute (the base admits a waiting request that holds computed
  blocks as it does one whose KV arrived from a connector);
- v0's watermark: the scheduler above built its block manager with no
  ``watermark`` argument, so ``BlockSpaceManagerV1``'s default, 0.01, held
  (vllm/core/block_manager_v1.py, read at the one commit available to us,
  00a456f1656e0fa60f0b212ed9b824fe9e688a8b: ``watermark_blocks``,
  ``can_allocate``, ``can_swap_in``). Here, while other requests run, an
  admission or a swap-in must leave ``int(cache_config.watermark * GPU
  blocks)`` blocks free, so the running ones are not preempted at their
  next block;
- the step's ``SwapSchedulerOutput`` carries both block maps; the model
  runner copies them (``GPUModelRunner._swap_blocks``) before its forward.
  Like v0, one step never swaps both ways (a step that preempted swaps
  nothing in).

Where it differs from v0: v0 swapped only a group of several sequences
(beam search; ``Scheduler._preempt`` recomputed a single sequence) and
raised when the CPU space was full; here every victim is swapped while the
CPU pool has room, and falls back to recompute when it has not. v0 also
refused for good a prompt larger than all blocks but the watermark; here
the watermark holds only while others run, so such a request waits for the
running ones to finish. Left out: swapping with more than one KV-cache
group, and the copy-on-write ``blocks_to_copy``.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.core.sched.request_queue import SchedulingPolicy
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.request import Request, RequestStatus


@dataclass
class SwapSchedulerOutput(SchedulerOutput):
    # (GPU block, CPU block) pairs to copy out, and (CPU block, GPU block)
    # pairs to copy in, before this step's forward (v0's SchedulerOutputs).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)


class SwapScheduler(Scheduler):
    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        if self.num_kv_cache_groups != 1:
            raise ValueError("SwapScheduler: swapping needs one KV-cache group.")
        if self.scheduler_config.async_scheduling or self.connector is not None:
            raise ValueError("SwapScheduler: no async_scheduling or kv_transfer_config.")
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError("SwapScheduler: policy must be 'fcfs'.")
        num_cpu_blocks = vllm_config.cache_config.num_cpu_blocks or 0
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}.")
        self.num_cpu_blocks = num_cpu_blocks
        # The CPU pool: a free list, as v0's CPU allocator was (no caching).
        self.free_cpu_block_ids: deque[int] = deque(range(num_cpu_blocks))
        # Swapped-out requests, oldest first, and each one's CPU blocks.
        self.swapped: deque[Request] = deque()
        self.req_to_cpu_blocks: dict[str, list[int]] = {}
        # This step's copies, handed out with its output.
        self.blocks_to_swap_out: list[tuple[int, int]] = []
        self.blocks_to_swap_in: list[tuple[int, int]] = []
        # Counters for tests and the benchmark.
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self.num_recompute_preemptions = 0
        self.num_blocks_swapped = 0
        # v0's watermark (BlockSpaceManagerV1.watermark_blocks): the GPU
        # blocks an admission or a swap-in must leave free while others run.
        num_gpu_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks
        self.watermark_blocks = int(vllm_config.cache_config.watermark * num_gpu_blocks)
        # v1 admits a waiting request through kv_cache_manager.allocate_slots:
        # every such call goes through the watermark check first.
        self._allocate_slots = self.kv_cache_manager.allocate_slots
        self.kv_cache_manager.allocate_slots = self._allocate_slots_above_watermark
        # Whether this step's swap-in ran (at its first admission, or at its end).
        self._swap_in_tried = False

    # ------------------------------------------------------------ schedule

    def schedule(self) -> SwapSchedulerOutput:
        self._resumed_first()
        self._swap_in_tried = False
        output = super().schedule()  # _preempt_request fills blocks_to_swap_out
        if not output.preempted_req_ids and not self._swap_in_tried:
            # No admission was tried (nothing waiting, no budget or no seat
            # left): swap in now, for the next step.
            self._schedule_swapped()
        swap_output = SwapSchedulerOutput(
            **{f.name: getattr(output, f.name) for f in dataclasses.fields(output)},
            blocks_to_swap_out=self.blocks_to_swap_out,
            blocks_to_swap_in=self.blocks_to_swap_in,
        )
        self.blocks_to_swap_out, self.blocks_to_swap_in = [], []
        return swap_output

    def _resumed_first(self) -> None:
        """Swapped-in requests back at the head of the waiting queue, ahead
        of recompute victims queued since: they hold blocks, and a request
        before them that cannot fit must not keep them waiting."""
        resumed = self._swapped_in_waiting()
        if resumed:
            self.waiting.remove_requests(resumed)
            self.waiting.prepend_requests(reversed(resumed))

    def _select_waiting_queue_for_scheduling(self):
        """At a step's first admission, swap requests in first, so they go
        ahead of new prefills: v0's order, running then swapped then new
        (``Scheduler._schedule_chunked_prefill``). The base only admits, and
        so only gets here, in a step that preempted nobody."""
        if not self._swap_in_tried:
            self._swap_in_tried = True
            self._schedule_swapped()
        return super()._select_waiting_queue_for_scheduling()

    def _allocate_slots_above_watermark(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks=None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
    ):
        """``kv_cache_manager.allocate_slots``, except that a request not
        running (being admitted or swapped in) gets None when, with others
        running, it would leave fewer than ``watermark_blocks`` free (v0's
        ``can_allocate``: free - required >= watermark, else later)."""
        if request.status != RequestStatus.RUNNING and self.running and self.watermark_blocks:
            manager = self.kv_cache_manager
            num_tokens = (
                request.num_computed_tokens
                + num_new_computed_tokens
                + num_new_tokens
                + num_lookahead_tokens
            )
            if full_sequence_must_fit:
                num_tokens = max(num_tokens, request.num_tokens)
            hits = new_computed_blocks.blocks[0] if new_computed_blocks else ()
            needed = manager._get_num_blocks_to_allocate(
                request.request_id, min(num_tokens, manager.max_model_len), hits
            )
            if manager.block_pool.get_num_free_blocks() - needed < self.watermark_blocks:
                return None
        return self._allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
        )

    # BEGIN LAB 19.1: a victim: swapped out if the CPU pool holds it, else recomputed
    def _preempt_request(self, request: Request) -> None:
        """Swap the victim out if the CPU pool can hold its KV, else recompute."""
        # HINT: _can_swap_out says whether it fits; the base class's _preempt_request recomputes.
        # HINT: count every recompute in self.num_recompute_preemptions.
        if self._can_swap_out(request):
            self._swap_out(request)
        else:
            self.num_recompute_preemptions += 1
            super()._preempt_request(request)

    # END LAB 19.1

    def _num_blocks_to_swap(self, num_tokens: int) -> int:
        """The blocks holding ``num_tokens`` computed tokens."""
        return cdiv(num_tokens, self.block_size)

    # BEGIN LAB 19.1: does the CPU pool hold the victim's filled blocks
    def _can_swap_out(self, request: Request) -> bool:
        """Whether the free CPU blocks can hold the victim's filled ones."""
        # HINT: the blocks its computed tokens fill (_num_blocks_to_swap);
        # HINT: a victim with none has nothing to swap.
        needed = self._num_blocks_to_swap(request.num_computed_tokens)
        return 0 < needed <= len(self.free_cpu_block_ids)

    # END LAB 19.1

    # BEGIN LAB 19.1: swap a victim out
    def _swap_out(self, request: Request) -> None:
        """Copy its filled blocks to CPU blocks, free its GPU blocks, and park
        it in ``self.swapped`` with its computed tokens kept."""
        # HINT: pair its first GPU blocks with CPU blocks taken from free_cpu_block_ids
        # HINT: (blocks_to_swap_out); free it as the base does (KV and encoder cache),
        # HINT: PREEMPTED, num_preemptions + 1, num_computed_tokens kept; remember its
        # HINT: CPU blocks, append it to self.swapped, count num_swapped_out and num_blocks_swapped.
        assert request.status == RequestStatus.RUNNING, "Only running requests can be preempted"
        num_blocks = self._num_blocks_to_swap(request.num_computed_tokens)
        gpu_block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0][:num_blocks]
        cpu_block_ids = [self.free_cpu_block_ids.popleft() for _ in range(num_blocks)]
        self.blocks_to_swap_out.extend(zip(gpu_block_ids, cpu_block_ids, strict=True))
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.req_to_cpu_blocks[request.request_id] = cpu_block_ids
        self.swapped.append(request)
        self.num_swapped_out += 1
        self.num_blocks_swapped += num_blocks

    # END LAB 19.1

    # BEGIN LAB 19.1: swap requests back in, oldest first
    def _schedule_swapped(self) -> None:
        """Swap requests back in, oldest first, while they fit on the GPU and
        under max_num_seqs; stop at the first that does not (v0's order).
        They join the front of the waiting queue in that order."""
        # HINT: stop at the first that would pass max_num_seqs (running, plus those swapped
        # HINT: in and not yet admitted) or does not fit (_can_swap_in); the ones swapped in
        # HINT: go to the front of self.waiting in their order (waiting.prepend_request).
        swapped_in: list[Request] = []
        while self.swapped:
            request = self.swapped[0]
            resumed = self._swapped_in_waiting() + swapped_in
            if len(self.running) + len(resumed) >= self.max_num_running_reqs:
                break
            if not self._can_swap_in(request, resumed):
                break
            self._swap_in(self.swapped.popleft())
            swapped_in.append(request)
        for request in reversed(swapped_in):
            self.waiting.prepend_request(request)

    # END LAB 19.1

    def _swapped_in_waiting(self) -> list[Request]:
        """Requests swapped in but not admitted yet: the only waiting ones
        with computed tokens (a recompute victim has none)."""
        return [r for r in self.waiting if r.num_computed_tokens > 0]

    def _can_swap_in(self, request: Request, resumed: list[Request]) -> bool:
        """Room on the GPU for all its tokens, after the blocks the requests
        swapped in before it still need to run, and the watermark while
        others run (v0's ``can_swap_in``): so the requests holding swapped-in
        blocks can always be admitted, and never wait for each other's."""
        still_needed = sum(
            cdiv(r.num_tokens, self.block_size)
            - len(self.kv_cache_manager.get_block_ids(r.request_id)[0])
            for r in resumed
        )
        needed = cdiv(request.num_tokens, self.block_size)
        reserve = self.watermark_blocks if self.running else 0
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        return needed + still_needed + reserve <= free

    # BEGIN LAB 19.1: swap one request back in
    def _swap_in(self, request: Request) -> None:
        """Give it GPU blocks for its computed tokens and copy its CPU blocks
        there; its CPU blocks go back to the pool."""
        # HINT: allocate_slots counts from num_computed_tokens: 0 for the call, then restore;
        # HINT: pair its CPU blocks with the new GPU blocks (blocks_to_swap_in), free the CPU ones.
        num_computed_tokens = request.num_computed_tokens
        request.num_computed_tokens = 0  # allocate_slots counts from here
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_computed_tokens)
        request.num_computed_tokens = num_computed_tokens
        assert new_blocks is not None, "_can_swap_in checked the room"
        gpu_block_ids = new_blocks.get_block_ids()[0]
        cpu_block_ids = self.req_to_cpu_blocks.pop(request.request_id)
        self.blocks_to_swap_in.extend(zip(cpu_block_ids, gpu_block_ids, strict=True))
        self.free_cpu_block_ids.extend(cpu_block_ids)
        self.num_swapped_in += 1

    # END LAB 19.1

    # ------------------------------------------------ the rest of the life

    def finish_requests(self, request_ids, finished_status):
        """Aborting a swapped request also gives its CPU blocks back."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        ids = set(self.requests) if request_ids is None else set(request_ids)
        for request in [r for r in self.swapped if r.request_id in ids]:
            self.swapped.remove(request)
            self.free_cpu_block_ids.extend(self.req_to_cpu_blocks.pop(request.request_id))
            # Where the base looks for a PREEMPTED request to finish it.
            self.waiting.prepend_request(request)
        return super().finish_requests(request_ids, finished_status)

    def get_num_unfinished_requests(self) -> int:
        return super().get_num_unfinished_requests() + len(self.swapped)
