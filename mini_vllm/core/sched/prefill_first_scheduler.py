"""Prefill first: nano-vllm's policy, a step all prefill or all decode (Phase 19).

Not upstream at the pin: vLLM v1 (v0.22.1) hands one token budget to
running and waiting requests alike, so a step mixes decodes with prefill
chunks (vllm/v1/core/sched/scheduler.py:329). nano-vllm's scheduler
(GeeeekExplorer/nano-vllm at commit
06005bd4602e0dc6e4c80e64c159658dbc468fae, nanovllm/engine/scheduler.py,
``Scheduler.schedule``) first admits waiting sequences whole while the
budget and the blocks allow, and returns that batch, prefills only, if it
admitted any; only otherwise does it decode every running sequence,
preempting (recompute) from the tail when a sequence cannot grow.

Here that choice is made on top of mini_vllm's v1 ``Scheduler``, before
its ``schedule()`` runs:
- a *prefill step* when some request has prompt (or, resumed, output)
  tokens left to compute and the blocks for them are free: the decoding
  requests sit the step out, hidden from the base's running loop, and
  still count against ``max_num_seqs``;
- otherwise a *decode step*: the running requests decode and nobody is
  admitted (the base sees the batch as full).
A request decodes when every token before its last is computed
(``_is_decode``). Kept from v1, unlike nano-vllm: chunked prefill inside a
prefill step (a long prompt takes several prefill steps), prefix caching,
and v1's preemption within the requests the step runs.
"""

from __future__ import annotations

from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.request import Request


class PrefillFirstScheduler(Scheduler):
    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        if self.scheduler_config.async_scheduling:
            raise ValueError("PrefillFirstScheduler: no async_scheduling.")
        # For tests and the benchmark: how many steps of each kind ran.
        self.num_prefill_steps = 0
        self.num_decode_steps = 0

    # BEGIN LAB 19.2: one step, all prefill or all decode
    def schedule(self) -> SchedulerOutput:
        """A prefill step or a decode step, never both (nano-vllm's rule)."""
        # HINT: the decoding running requests (_is_decode); _is_prefill_step chooses;
        # HINT: _schedule_only runs the base on the prefills (admitting) or the decodes (not);
        # HINT: count the step in num_prefill_steps or num_decode_steps.
        decodes = [r for r in self.running if self._is_decode(r)]
        if self._is_prefill_step(decodes):
            self.num_prefill_steps += 1
            prefills = [r for r in self.running if r not in decodes]
            return self._schedule_only(prefills, admit=True)
        self.num_decode_steps += 1
        return self._schedule_only(decodes, admit=False)

    # END LAB 19.2

    # BEGIN LAB 19.2: which running requests decode
    @staticmethod
    def _is_decode(request: Request) -> bool:
        """Every token but the last computed: its next step is one decode."""
        # HINT: a prompt not all computed is a prefill, even with one token left to compute.
        return request.num_computed_tokens >= max(request.num_prompt_tokens, request.num_tokens - 1)

    # END LAB 19.2

    # BEGIN LAB 19.2: is this a prefill step
    def _is_prefill_step(self, decodes: list[Request]) -> bool:
        """Prefill if nothing decodes, or if a prefill could run now: a
        running request mid-prefill, or the head of the waiting queue
        while there is room for one more request, whose blocks are free."""
        # HINT: with nothing decoding, prefill; a waiting head counts only under max_num_seqs;
        # HINT: _blocks_free_for(request) says whether its blocks are free.
        if not decodes:
            return True
        candidates = [r for r in self.running if r not in decodes]
        if self.waiting and len(self.running) < self.max_num_running_reqs:
            candidates.append(self.waiting.peek_request())
        return any(self._blocks_free_for(r) for r in candidates)

    # END LAB 19.2

    def _blocks_free_for(self, request: Request) -> bool:
        """The free pool holds every block the request still lacks (all its
        tokens, ignoring prefix hits: a bound that never says yes wrongly)."""
        held = len(self.kv_cache_manager.get_block_ids(request.request_id)[0])
        needed = cdiv(request.num_tokens, self.block_size) - held
        return needed <= self.kv_cache_manager.block_pool.get_num_free_blocks()

    def _schedule_only(self, visible: list[Request], admit: bool) -> SchedulerOutput:
        """The base's schedule() seeing only ``visible`` of the running
        requests. With ``admit`` the hidden ones still hold their seats
        under max_num_seqs; without, nobody is admitted (the batch counts
        as full). Afterwards running keeps its order, with the requests
        admitted this step at the end."""
        before = list(self.running)
        num_hidden = len(before) - len(visible)
        saved_max = self.max_num_running_reqs
        self.running = list(visible)
        self.max_num_running_reqs = saved_max - num_hidden if admit else len(visible)
        try:
            output = super().schedule()
        finally:
            self.max_num_running_reqs = saved_max
            visible_before, still_visible = set(visible), set(self.running)
            admitted = [r for r in self.running if r not in visible_before]
            self.running = [
                r for r in before if r not in visible_before or r in still_visible
            ] + admitted
        return output
