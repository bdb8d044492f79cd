"""One engine step: schedule, run the model, take in its output.

Mirrors upstream ``vllm/v1/engine/core.py`` (``EngineCore`` :94:
``_initialize_kv_caches`` :235, ``add_request`` :337, ``abort_requests``
:374, ``step`` :428, ``step_with_batch_queue`` :469) at v0.22.1. Left out: the
busy loop and ZMQ process boundary (``EngineCoreProc``), pipeline parallelism's
deeper queues, utility calls, and structured outputs under async scheduling
(upstream defers their bitmask, core.py:509; mini_vllm refuses the pair).

Structured outputs (upstream core.py:132, :441, :815): the engine owns the
``StructuredOutputManager`` and hands it to the scheduler; ``add_request``
starts a structured request's grammar compile; ``step`` asks the scheduler
for the step's grammar bitmask and gives it to the runner with the batch
(upstream passes it to ``sample_tokens``, the second half of its split step).

With ``async_scheduling`` the scheduler is the ``AsyncScheduler`` and the
engine keeps up to two steps in flight (``step_with_batch_queue``): the
model runner runs each step on one worker thread (upstream's
``UniProcExecutor`` with ``max_concurrent_batches`` 2,
vllm/v1/executor/uniproc_executor.py:77), and while step N's forward runs
there (torch releases the GIL), this thread schedules step N+1, then takes
in step N's output and the front end detokenizes it. Steps run on the worker
in order, so when step N+1 starts its inputs the runner has already appended
step N's sampled token to its own token table: that is where a request
scheduled before its token was known gets it (upstream patches the previous
step's sampled ids into the device's input ids instead, ``prev_sampled_token_ids``
in gpu_model_runner.py; see UPSTREAM_PIN.md).

The KV cache is sized from one ``FullAttentionSpec`` shared by every
attention layer (``mini_vllm.kv_cache_interface``, the same arithmetic as
upstream's), in ``worker/gpu_worker.py``; a model with sliding-window layers
gets a ``KVCacheConfig`` of several groups instead, which the scheduler's
KV-cache manager and the runner's block tables (one per group) share.

With ``tensor_parallel_size > 1`` the model and its KV cache live in the
``MultiprocExecutor``'s worker processes (executor/multiproc_executor.py;
upstream's ``EngineCore`` always drives a ``model_executor``): the engine
core keeps the scheduler, takes the block count the ranks agree on, and
calls the executor where it would call its model runner.

The scheduler class is pluggable (``SchedulerConfig.scheduler_cls``, as
upstream): anything with mini_vllm's Scheduler interface can drive the real
model, which is how the labs run a student's scheduler.
"""

from __future__ import annotations

import importlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mini_vllm.config import VllmConfig
from mini_vllm.core.sched.async_scheduler import AsyncScheduler
from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.engine import EngineCoreOutputs
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.request import Request, RequestStatus
from mini_vllm.structured_output import StructuredOutputManager
from mini_vllm.worker.gpu_model_runner import GPUModelRunner
from mini_vllm.worker.gpu_worker import initialize_kv_cache


def resolve_scheduler_cls(scheduler_cls, async_scheduling: bool = False) -> type:
    """A class, a 'package.module.Class' path, or None (mini_vllm's Scheduler,
    or its AsyncScheduler with async scheduling, as upstream's default)."""
    if scheduler_cls is None:
        return AsyncScheduler if async_scheduling else Scheduler
    if isinstance(scheduler_cls, str):
        module_name, _, class_name = scheduler_cls.replace(":", ".").rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"Cannot import scheduler_cls {scheduler_cls!r}: {e}") from e
    return scheduler_cls


class EngineCore:
    def __init__(
        self,
        vllm_config: VllmConfig,
        model: torch.nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str,
        tokenizer=None,
    ) -> None:
        """``tokenizer``: the model's Hugging Face tokenizer, which structured
        outputs compile their grammars against (None: they are refused)."""
        self.vllm_config = vllm_config
        cache = vllm_config.cache_config
        parallel = vllm_config.parallel_config
        self.model_executor = None
        if parallel.world_size > 1:
            # Tensor parallelism: the model and its KV cache live in one worker
            # process per rank (each holding its heads only); the executor
            # runs every step on all of them and returns rank 0's output.
            if parallel.distributed_executor_backend == "ray":
                from mini_vllm.executor.ray_executor import RayDistributedExecutor as executor_cls
            else:
                from mini_vllm.executor.multiproc_executor import MultiprocExecutor as executor_cls

            self.model_executor = executor_cls(vllm_config, device, dtype, attention_backend)
            kv = self.model_executor.kv_cache
        else:
            kv = initialize_kv_cache(vllm_config, model, device, dtype, attention_backend)
        self.kv_cache_config, self.kv_cache_spec = kv.kv_cache_config, kv.kv_cache_spec
        self.num_layers, self.bytes_per_block = kv.num_layers, kv.bytes_per_block
        self.kv_caches, num_blocks = kv.kv_caches, kv.num_blocks
        cache.num_gpu_blocks = num_blocks
        if self.model_executor is not None:
            self.model_runner = self.model_executor
        else:
            self.model_runner = GPUModelRunner(
                vllm_config, model, device, kv_cache_config=self.kv_cache_config
            )
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling
        scheduler_cls = resolve_scheduler_cls(
            vllm_config.scheduler_config.scheduler_cls, self.async_scheduling
        )
        # Stats on, unlike upstream's default: LLMEngine.get_stats adds up the
        # prefix-cache counts they carry.
        self.structured_output_manager = StructuredOutputManager(
            vllm_config, tokenizer=tokenizer, vocab_size=self.model_runner.vocab_size
        )
        scheduler_kwargs = {}
        if self.kv_cache_config is not None:
            scheduler_kwargs["kv_cache_config"] = self.kv_cache_config
        self.scheduler = scheduler_cls(
            vllm_config,
            log_stats=True,
            structured_output_manager=self.structured_output_manager,
            **scheduler_kwargs,
        )
        self.profiler = None  # TorchProfilerWrapper, built by the first profile()
        # Running totals for reports and tests.
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0

        # Async scheduling: steps in flight, newest on the left, each with
        # the future of its model output; one worker thread runs the model.
        # (upstream: core.py:191-197 and uniproc_executor.py:77)
        self.batch_queue_size = 2 if self.async_scheduling else 1
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] | None = None
        self.worker: ThreadPoolExecutor | None = None
        if self.batch_queue_size > 1:
            self.batch_queue = deque(maxlen=self.batch_queue_size)
            self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mini_vllm_worker")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (upstream: EngineCore.shutdown)."""
        if self.model_executor is not None:
            self.model_executor.shutdown()

    def add_request(self, request: Request) -> None:
        """Hand a new request to the scheduler (a structured one starts its
        grammar first). If anything raises, whatever the scheduler already
        holds of this request is taken back (``_forget_new_request``)."""
        if request.use_structured_output and self.async_scheduling:
            raise ValueError(
                f"Request {request.request_id!r}: structured outputs are not supported "
                "with async_scheduling=True in mini_vllm (see UPSTREAM_PIN.md)."
            )
        try:
            if request.use_structured_output:
                self.structured_output_manager.grammar_init(request)
            self.scheduler.add_request(request)
        except BaseException:
            self._forget_new_request(request)
            raise

    def _forget_new_request(self, request: Request) -> None:
        """Remove ``request`` from the scheduler's table and waiting queues,
        wherever a failed ``add_request`` left it (e.g. pushed into the
        waiting queue, not yet in ``requests``). Found by identity: a request
        already there under the same id stays. A new request holds no KV
        blocks, so there is nothing to free. (mini_vllm only: upstream's
        engine core has no rollback.)"""
        scheduler = self.scheduler
        requests = getattr(scheduler, "requests", {})
        if requests.get(request.request_id) is request:
            del requests[request.request_id]
        for name in ("waiting", "skipped_waiting"):
            queue = getattr(scheduler, name, None)
            if queue is not None:
                queue.remove_requests([request])

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def fail_requests(self, request_ids: list[str]) -> None:
        """Abort requests whose step raised, and forget their KV.

        ``schedule()`` advanced their ``num_computed_tokens`` and cached their
        full blocks *before* the model wrote those blocks, so after a failed
        step neither can be trusted: the requests are aborted (their blocks go
        back to the pool) and their blocks leave the prefix cache, as upstream
        evicts the blocks whose KV failed to load. Unknown or finished ids are
        ignored. Upstream has no recovery: its engine dies on a failed step.
        """
        if self.batch_queue:
            # Async scheduling: let the steps in flight end (the worker must
            # not run while the runner is cleaned up below) and drop their
            # outputs. Both callers (LLM.generate, AsyncLLM's engine thread)
            # then fail every unfinished request: no surviving request waits
            # for a dropped output.
            for future, _ in self.batch_queue:
                future.exception()
            self.batch_queue.clear()
        kv_cache_manager = self.scheduler.kv_cache_manager
        block_ids = [
            block_id
            for request_id in request_ids
            if request_id in self.scheduler.requests
            for block_id in kv_cache_manager.get_block_ids(request_id)[0]
        ]
        self.abort_requests(request_ids)
        kv_cache_manager.evict_blocks(block_ids)
        # A step cut short before the runner read its finished_req_ids leaves
        # those requests' states behind: keep only the scheduler's live ones.
        runner = self.model_runner
        runner.requests = {r: s for r, s in runner.requests.items() if r in self.scheduler.requests}

    # BEGIN LAB 01.2: EngineCore.step: schedule, run the model, update from its output
    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, take in its output: one engine step.

        With no request in the scheduler (none waiting, running, or finished
        and not yet reported) there is nothing to do: return empty outputs
        without calling schedule(). Also count the step, its preemptions and
        its scheduled tokens (``num_steps``, ``num_preemptions``,
        ``num_scheduled_tokens``).
        """
        # HINT: self.scheduler has has_requests(), schedule(), update_from_output();
        # HINT: self.model_runner.execute_model(scheduler_output, grammar_output) runs the
        # HINT: model and samples; grammar_output is self.scheduler.get_grammar_bitmask(...).
        if not self.scheduler.has_requests():
            return EngineCoreOutputs()
        scheduler_output = self.scheduler.schedule()
        self.num_steps += 1
        self.num_preemptions += len(scheduler_output.preempted_req_ids or ())
        self.num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
        model_output = self.model_runner.execute_model(scheduler_output, grammar_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    # END LAB 01.2

    def step_fn(self) -> EngineCoreOutputs:
        """What LLMEngine.step calls: ``step``, or ``step_with_batch_queue``
        with async scheduling. Upstream picks one when the engine is built
        (core.py:216-218) and its InprocClient calls it; a method here, so that
        a ``step`` shadowed on the instance (the labs' recorders) is the one run."""
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        outputs = self.step()
        self.post_step()
        return outputs

    # mirrors vllm/v1/worker/gpu_worker.py:874-930 (Worker.profile)
    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Start or stop the torch profiler around the steps that follow
        (``LLM.start_profile`` / ``stop_profile``); stopping writes the trace.
        Upstream runs this in each worker; mini_vllm's one worker is here,
        named as upstream names rank 0 (``<prefix>_dp0_pp0_tp0_dcp0_ep0_rank0``)."""
        config = self.vllm_config.profiler_config
        if config.profiler is None:
            raise RuntimeError(
                "Profiling is not enabled. Please set profiler_config to enable profiling, "
                "e.g. LLM(..., profiler_config={'profiler': 'torch', "
                "'torch_profiler_dir': YOUR_DIR_PATH_TO_DUMP_TRACE})"
            )
        if self.model_executor is not None:
            raise RuntimeError("mini_vllm profiles one process only (tensor_parallel_size=1).")
        if is_start:
            if self.profiler is None:  # the first start names the trace
                from mini_vllm.profiler.wrapper import TorchProfilerWrapper

                suffix = "dp0_pp0_tp0_dcp0_ep0_rank0"
                name = f"{profile_prefix}_{suffix}" if profile_prefix else suffix
                self.profiler = TorchProfilerWrapper(config, worker_name=name)
            self.profiler.start()
        elif self.profiler is not None:
            self.profiler.stop()

    def post_step(self) -> None:
        """With speculation, hand the drafts the runner proposed after this
        step to the scheduler (vllm/v1/engine/core.py:459-467; upstream's busy
        loop calls it after every step, and skips it with async scheduling)."""
        if self.vllm_config.speculative_config is not None:
            draft_token_ids = self.model_runner.take_draft_token_ids()
            if draft_token_ids is not None:
                self.scheduler.update_draft_token_ids(draft_token_ids)

    # mirrors vllm/v1/engine/core.py:469-585
    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """One engine step with up to two steps in flight.

        1. If there is work, schedule a step and hand it to the worker thread
           without waiting. If it runs tokens, the queue is not full and the
           oldest step is still running, return at once (empty outputs):
           filling the queue comes before taking outputs in.
        2. Otherwise wait for the oldest step and take in its output.
        """
        batch_queue = self.batch_queue
        assert batch_queue is not None and self.worker is not None
        # BEGIN LAB 14.2: step_with_batch_queue: fill the queue, then take the oldest out
        # HINT: schedule only if self.scheduler.has_requests(), count the step as step() does,
        # HINT: and self.worker.submit(self.model_runner.execute_model, scheduler_output);
        # HINT: the queue is newest-left (appendleft / pop); a Future has done() and result().
        if self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            self.num_steps += 1
            self.num_preemptions += len(scheduler_output.preempted_req_ids or ())
            self.num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
            future = self.worker.submit(self.model_runner.execute_model, scheduler_output)
            batch_queue.appendleft((future, scheduler_output))
            if (
                scheduler_output.total_num_scheduled_tokens > 0
                and len(batch_queue) < self.batch_queue_size
                and not batch_queue[-1][0].done()
            ):
                return EngineCoreOutputs()
        elif not batch_queue:
            return EngineCoreOutputs()

        future, scheduler_output = batch_queue.pop()
        model_output = future.result()
        return self.scheduler.update_from_output(scheduler_output, model_output)
        # END LAB 14.2
