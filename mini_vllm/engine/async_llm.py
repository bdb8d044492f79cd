"""``AsyncLLM``: many concurrent callers, one engine, continuous batching.

Mirrors upstream ``vllm/v1/engine/async_llm.py`` (``AsyncLLM`` :70, ``add_request``
:280, ``generate`` :524, the output handler :637, ``abort`` :709) and
``RequestOutputCollector`` (vllm/v1/engine/output_processor.py:45) at v0.22.1.

Two sides, as upstream, with a thread where upstream has a process:
- the engine core (``EngineCoreThread``; upstream's ``EngineCoreProc.run_busy_loop``
  (vllm/v1/engine/core.py:1193) in its own process): a thread that owns
  ``EngineCore`` alone. It applies the adds and aborts waiting in its input
  queue, runs one ``step()``, and hands the ``EngineCoreOutputs`` to the event
  loop; with nothing to do it blocks on the input queue.
- the front end, on the asyncio event loop: ``add_request`` validates and
  tokenizes (``InputProcessor``; a bad request raises ``ValueError`` here and
  nothing is queued), the output handler task runs ``OutputProcessor`` on each
  step's outputs and puts every ``RequestOutput`` into its request's collector,
  and ``generate`` reads the collector and yields.

Invariants: only the engine-core thread touches ``EngineCore``; only the event
loop touches the input and output processors and the collectors. A generator
closed early (the client went away: ``GeneratorExit`` or ``CancelledError``)
aborts its requests, whose KV blocks the engine core then frees.

Differences (see UPSTREAM_PIN.md):
- ``n`` and the output kind are arguments of ``generate`` (upstream: the
  ``SamplingParams`` fields ``n`` and ``output_kind``). ``n > 1`` fans out to
  child requests ``f"{index}_{request_id}"`` with seed ``seed + index``, as
  upstream's ``ParentRequest.get_child_info`` (vllm/v1/engine/parallel_sampling.py:83).
- mini_vllm's ``OutputProcessor`` makes cumulative outputs; ``generate`` turns
  them into deltas for ``RequestOutputKind.DELTA`` (upstream's output processor
  makes the deltas). A collector keeps only the newest cumulative output of each
  child, so a slow reader gets one delta covering everything it missed, as
  upstream's collector merges deltas.
- A step that raises fails the requests the engine core held (each caller gets
  ``EngineGenerateError``; their KV blocks are freed and leave the prefix cache,
  ``EngineCore.fail_requests``) and the loop keeps serving. Upstream's engine
  core dies instead (``EngineDeadError``).
A request may carry a ``LoRARequest`` (``generate(..., lora_request=...)``);
adapters are read by the runner at their first step, or beforehand by the
server (``--lora-modules``). Left out: the ZMQ process boundary, data
parallelism, adding or removing adapters at run time (``add_lora``), pooling,
streaming input, pause/resume, sleep, profiling, tracing.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import queue
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from mini_vllm.engine import EngineCoreOutputs
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.metrics.loggers import PrometheusStatLogger
from mini_vllm.metrics.stats import IterationStats
from mini_vllm.outputs import CompletionOutput, RequestOutput
from mini_vllm.sampling_params import SamplingParams


class RequestOutputKind(enum.Enum):
    """What each yielded output holds (upstream: vllm/sampling_params.py:151, a
    SamplingParams field)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the last yield
    FINAL_ONLY = 2  # one output, when every completion has finished


class EngineGenerateError(Exception):
    """A request failed inside the engine (upstream: vllm/v1/engine/exceptions.py)."""


class EngineCoreThread:
    """The engine-core side: one thread that alone adds, aborts and steps."""

    def __init__(self, llm_engine: LLMEngine, on_output) -> None:
        self.engine_core = llm_engine.engine_core
        self.on_output = on_output  # called on this thread with each step's result
        self.input_queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self.run_busy_loop, name="EngineCore", daemon=True)
        self.thread.start()

    def add_requests(self, requests) -> None:
        self.input_queue.put(("add", requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.input_queue.put(("abort", request_ids))

    def shutdown(self) -> None:
        self.input_queue.put(("shutdown", None))
        self.thread.join()

    def _process_input_queue(self) -> bool:
        """Apply every waiting input, blocking first while the core is idle.

        Returns False on shutdown."""
        core = self.engine_core
        block = not core.scheduler.has_requests()
        while True:
            try:
                kind, payload = self.input_queue.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "shutdown":
                # Whatever still runs is aborted, so that its KV blocks go back
                # to the pool (this engine core outlives the thread).
                core.abort_requests(list(core.scheduler.requests))
                return False
            if kind == "add":
                for request in payload:
                    try:
                        core.add_request(request)
                    except Exception as e:  # the scheduler refused it: it alone fails
                        self.on_output(([request.request_id], e))
            else:
                core.abort_requests(payload)

    def run_busy_loop(self) -> None:
        while self._process_input_queue():
            try:
                outputs = self.engine_core.step_fn()
            except Exception as e:
                failed = list(self.engine_core.scheduler.requests)
                self.engine_core.fail_requests(failed)
                self.on_output((failed, e))
                continue
            self.on_output(outputs)


class RequestOutputCollector:
    """One parent request's outputs, from the output handler to ``generate``.

    Keeps the newest cumulative output of each child not yet read (an
    exception replaces everything)."""

    def __init__(self, request_id: str, child_ids: list[str]) -> None:
        self.request_id = request_id
        self.child_ids = child_ids
        self.pending: dict[int, RequestOutput] = {}
        self.error: Exception | None = None
        self.ready = asyncio.Event()

    def put(self, index: int, output: RequestOutput) -> None:
        self.pending[index] = output
        self.ready.set()

    def put_error(self, error: Exception) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> list[tuple[int, RequestOutput]]:
        """The newest output of every child that moved since the last call."""
        # BEGIN LAB 16.3: wait for this request's outputs, then hand over all of them
        # HINT: receives self (pending, error, ready); returns [(child index, output)] sorted
        # HINT: by index, or raises the error. Wait on the event while there is nothing to
        # HINT: hand over (the output handler sets it); clear it before returning; empty
        # HINT: pending so the next call waits for new outputs.
        while not self.pending and self.error is None:
            await self.ready.wait()
        self.ready.clear()
        if self.error is not None:
            raise self.error
        outputs = sorted(self.pending.items())
        self.pending = {}
        return outputs
        # END LAB 16.3


@dataclass
class _Sent:
    """How much of one child's output ``generate`` has yielded."""

    text_len: int = 0
    num_tokens: int = 0


def _delta(output: RequestOutput, sent: _Sent) -> CompletionOutput:
    """The part of a cumulative output not yet yielded."""
    done = output.outputs[0]
    delta = CompletionOutput(
        index=done.index,
        text=done.text[sent.text_len :],
        token_ids=done.token_ids[sent.num_tokens :],
        cumulative_logprob=done.cumulative_logprob,
        logprobs=done.logprobs[sent.num_tokens :] if done.logprobs is not None else None,
        finish_reason=done.finish_reason,
        stop_reason=done.stop_reason,
    )
    sent.text_len, sent.num_tokens = len(done.text), len(done.token_ids)
    return delta


class AsyncLLM:
    def __init__(self, llm_engine: LLMEngine, model_name: str = "") -> None:
        self.llm_engine = llm_engine
        self.vllm_config = llm_engine.vllm_config
        self.tokenizer = llm_engine.tokenizer
        self.input_processor = llm_engine.input_processor
        self.output_processor = llm_engine.output_processor
        # Stats on, as upstream's AsyncLLM (log_stats): every request added
        # from now on keeps its timestamps for the metrics.
        self.output_processor.log_stats = True
        self.stat_logger = PrometheusStatLogger(self.vllm_config, model_name)
        self.collectors: dict[str, tuple[RequestOutputCollector, int]] = {}  # child id ->
        self.engine_core: EngineCoreThread | None = None
        self.output_handler: asyncio.Task | None = None
        self.output_queue: asyncio.Queue | None = None

    @classmethod
    def from_model(cls, model: str, model_name: str = "", **llm_kwargs) -> AsyncLLM:
        """Load ``model`` with ``LLM``'s arguments and defaults."""
        from mini_vllm.entrypoints.llm import LLM

        return cls(LLM(model, **llm_kwargs).llm_engine, model_name or model)

    def _run_output_handler(self) -> None:
        """Start the engine-core thread and the output handler, on first use."""
        if self.output_handler is not None:
            return
        loop = asyncio.get_running_loop()
        self.output_queue = asyncio.Queue()
        put = self.output_queue.put_nowait
        self.engine_core = EngineCoreThread(
            self.llm_engine, lambda item: loop.call_soon_threadsafe(put, item)
        )
        self.output_handler = loop.create_task(self._output_handler())

    async def _output_handler(self) -> None:
        while True:
            item = await self.output_queue.get()
            if not isinstance(item, EngineCoreOutputs):
                failed, error = item  # the step failed; the core already dropped them
                self._fail_requests(failed, error)
                continue
            try:
                self._process_outputs(item)
            except Exception as error:
                # Turning these outputs into RequestOutputs failed: their
                # requests fail, the others go on.
                failed = [out.request_id for out in item.outputs]
                self._fail_requests(failed, error)
                self.engine_core.abort_requests(failed)

    def _fail_requests(self, request_ids: list[str], error: Exception) -> None:
        """Forget these requests here; their callers get EngineGenerateError."""
        self.output_processor.abort_requests(request_ids)
        for request_id in request_ids:
            if (entry := self.collectors.pop(request_id, None)) is not None:
                message = f"Request {request_id} failed: {type(error).__name__}: {error}"
                entry[0].put_error(EngineGenerateError(message))

    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        # The step's stats, as upstream's output handler (async_llm.py:663-705):
        # an IterationStats when the step has outputs, recorded with the
        # scheduler's stats after the outputs are handled.
        iteration_stats = IterationStats() if outputs.outputs else None
        processed = self.output_processor.process_outputs(outputs, iteration_stats)
        # BEGIN LAB 16.3: route each output to its own request's collector
        # HINT: receives processed.request_outputs (one per child request that moved);
        # HINT: leaves each in its collector. self.collectors maps a child id to
        # HINT: (collector, child index); a finished child's entry is removed, so that
        # HINT: nothing is kept for a request that is over.
        for output in processed.request_outputs:
            collector, index = self.collectors[output.request_id]
            collector.put(index, output)
            if output.finished:
                del self.collectors[output.request_id]
        # END LAB 16.3
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        self.stat_logger.record(outputs.scheduler_stats, iteration_stats)
        self.llm_engine.record_stats(outputs.scheduler_stats)  # get_stats' totals

    def add_request(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams,
        n: int = 1,
        lora_request=None,
    ) -> RequestOutputCollector:
        """Validate and queue ``n`` child requests (each with ``lora_request``'s
        adapter, if any); ValueError queues nothing."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be at least 1, got {n}.")
        self._run_output_handler()
        child_ids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        if any(c in self.collectors for c in child_ids):
            raise ValueError(f"Duplicate request id {request_id!r}.")
        processed = []
        for index, child_id in enumerate(child_ids):
            params = sampling_params
            if n > 1 and params.seed is not None:
                params = copy.copy(params)
                params.seed = sampling_params.seed + index
            processed.append(
                self.input_processor.process_inputs(
                    child_id, prompt, params, lora_request=lora_request
                )
            )
        collector = RequestOutputCollector(request_id, child_ids)
        try:
            for index, (prompt_text, request) in enumerate(processed):
                self.output_processor.add_request(
                    request.request_id,
                    prompt_text,
                    request.prompt_token_ids,
                    request.arrival_time,
                    request.sampling_params,
                )
                self.collectors[request.request_id] = (collector, index)
        except BaseException:
            # All children or none: take back the ones already added.
            self.output_processor.abort_requests(child_ids)
            for child_id in child_ids:
                self.collectors.pop(child_id, None)
            raise
        self.engine_core.add_requests([request for _, request in processed])
        return collector

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        n: int = 1,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request=None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield ``RequestOutput``s of one request as the engine makes them.

        Each holds one completion (``outputs[0].index`` says which of the
        ``n``), except with ``FINAL_ONLY``: one output holding all ``n``."""
        collector = None
        try:
            collector = self.add_request(request_id, prompt, sampling_params, n, lora_request)
            sent = [_Sent() for _ in range(n)]
            final: list[RequestOutput | None] = [None] * n
            while any(out is None for out in final):
                for index, output in await collector.get():
                    completion = output.outputs[0]
                    if output.finished:
                        final[index] = output
                    if output_kind == RequestOutputKind.FINAL_ONLY:
                        continue
                    if output_kind == RequestOutputKind.DELTA:
                        completion = _delta(output, sent[index])
                    completion.index = index
                    yield RequestOutput(
                        request_id,
                        output.prompt,
                        output.prompt_token_ids,
                        [completion],
                        finished=all(out is not None for out in final),
                        metrics=output.metrics,
                        kv_transfer_params=output.kv_transfer_params,
                    )
            if output_kind == RequestOutputKind.FINAL_ONLY:
                completions = []
                for index, output in enumerate(final):
                    completions.append(output.outputs[0])
                    completions[-1].index = index
                first = final[0]
                yield RequestOutput(
                    request_id,
                    first.prompt,
                    first.prompt_token_ids,
                    completions,
                    finished=True,
                    metrics=first.metrics,
                    kv_transfer_params=first.kv_transfer_params,
                )
        except BaseException:
            # BEGIN LAB 16.3: the caller went away: abort what still runs
            # HINT: receives collector (None if add_request itself failed); re-raises.
            # HINT: GeneratorExit (the generator was closed), CancelledError (its task was
            # HINT: cancelled) or a child's error all land here: abort every child of this
            # HINT: request, then re-raise the same exception.
            if collector is not None:
                self.abort(collector.child_ids)
            raise
            # END LAB 16.3

    def abort(self, request_ids: str | list[str]) -> None:
        """Forget these (child) requests here and free them in the engine core."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        # BEGIN LAB 16.3: forget the requests here, then free them in the engine core
        # HINT: receives request_ids (a list); returns nothing. Drop their collectors (an
        # HINT: id may be gone already), let the output processor forget them (it returns
        # HINT: the ids it still knew), and send only those to the engine-core thread
        # HINT: (self.engine_core.abort_requests): that is what frees their KV blocks.
        for request_id in request_ids:
            self.collectors.pop(request_id, None)
        known = self.output_processor.abort_requests(request_ids)
        if known and self.engine_core is not None:
            self.engine_core.abort_requests(known)
        # END LAB 16.3

    def check_health(self) -> bool:
        """False once the engine-core thread has died (it never should)."""
        return self.engine_core is None or self.engine_core.thread.is_alive()

    def shutdown(self) -> None:
        """Stop the engine-core thread and the output handler (if they started).

        Call it while the event loop still runs (the server does, on its way
        out): the thread hands every step to the loop, and a step handed to a
        closed loop raises "Event loop is closed" on the thread. Requests still
        in the engine core are aborted, their blocks freed."""
        if self.engine_core is not None:
            self.engine_core.shutdown()
            self.engine_core = None
        if self.output_handler is not None:
            if not self.output_handler.get_loop().is_closed():
                self.output_handler.cancel()
            self.output_handler = None
