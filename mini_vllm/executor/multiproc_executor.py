"""Tensor parallelism's executor: one worker process a rank, every step run on all of them.

Mirrors upstream ``vllm/v1/executor/multiproc_executor.py`` at v0.22.1
(``MultiprocExecutor`` :102 with ``collective_rpc`` :339, ``execute_model``
:306, ``shutdown`` :441, ``check_health`` :470; ``WorkerProc`` :539 with
``worker_main`` :792 and ``worker_busy_loop`` :944).

The engine process keeps the scheduler; rank ``r``'s worker process joins
the run's process group (``init_distributed_environment`` through a TCP
store on this machine, then ``initialize_model_parallel``), loads the
checkpoint keeping its slice of every weight, sizes and allocates its KV
cache (its heads only) and builds a ``GPUModelRunner``. Every step the
executor sends the ``SchedulerOutput`` to every worker; each runs the same
step on its shard (the layers all-reduce and all-gather among the workers),
samples the same token from the same gathered logits, and rank 0's
``ModelRunnerOutput`` is the step's output.

The transport is simpler than upstream's: one ``multiprocessing`` pipe a
worker, the step's message written to each (upstream writes it once into a
shared-memory ``MessageQueue`` that every worker reads, and reads replies
from one queue a worker). Every worker answers every call (``None`` from
ranks other than ``unique_reply_rank``), so that an error on any rank is
seen.

Failures fail the engine, with a clear error and no process left behind:
a worker that raises, dies (its process sentinel fires) or stays silent
past ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (upstream's variable, 300 s)
makes ``collective_rpc`` stop every worker and raise ``WorkerFailedError``;
workers are daemon processes that also exit when the engine process goes
away. Left out: pipeline and data parallelism, async scheduling's futures,
KV-connector output aggregation, the death pipe (here a watchdog thread).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait

import torch

from mini_vllm.utils.network_utils import get_distributed_init_method, get_open_port


class WorkerFailedError(RuntimeError):
    """A worker process raised, died or hung: the executor has stopped them all."""


def execute_model_timeout() -> float:
    return float(os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300"))


class MultiprocExecutor:
    def __init__(
        self,
        vllm_config,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str,
    ) -> None:
        self.world_size = vllm_config.parallel_config.world_size
        self.is_failed = False
        self.forward_time = 0.0
        self.requests: dict = {}  # the runners' request states live in the workers
        ctx = multiprocessing.get_context("spawn")
        init_method = get_distributed_init_method("127.0.0.1", get_open_port())
        self.procs: list[multiprocessing.Process] = []
        self.conns: list[Connection] = []
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=WorkerProc.worker_main,
                args=(vllm_config, rank, init_method, device.type, dtype, attention_backend),
                kwargs={"conn": child_conn},
                name=f"mini_vllm_worker_tp{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        # Workers are stopped when the executor is collected or at exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        # Every rank loads its shard and sizes its KV cache; all keep the
        # smallest block count (upstream: get_kv_cache_configs takes the min).
        setups = self.collective_rpc("load_model_and_size_kv_cache", timeout=600)
        num_blocks = min(setup.num_blocks for setup in setups)
        self.vocab_size = self.collective_rpc("init_runner", args=(num_blocks,))[0]
        self.kv_cache = setups[0]._replace(num_blocks=num_blocks)

    # BEGIN LAB 17.3: one call on every worker: send it to each, wait for all, fail on any
    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        unique_reply_rank: int | None = None,
    ) -> list:
        """Call ``WorkerProc.<method>(*args)`` on every worker and wait for
        all of them; the answers in rank order (only ``unique_reply_rank``'s
        holds a value when it is set)."""
        # HINT: each worker reads (method, args, unique_reply_rank) from its pipe (self.conns) and
        # HINT: answers ("ok", value) or ("error", traceback). Wait on the pipes and on the
        # HINT: processes' sentinels together (multiprocessing.connection.wait) until every rank
        # HINT: answered; an error, a death or the timeout goes through self._fail, naming the rank.
        if self.is_failed:
            raise WorkerFailedError("the executor's workers have failed and were stopped")
        timeout = execute_model_timeout() if timeout is None else timeout
        for conn in self.conns:
            try:
                conn.send((method, args, unique_reply_rank))
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass  # a dead worker: found below by its sentinel
        answers: list = [None] * self.world_size
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(
                    f"worker rank(s) {sorted(pending)} sent no answer to {method!r} "
                    f"within {timeout:g} s (hung; VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)"
                )
            sentinels = {self.procs[rank].sentinel: rank for rank in pending}
            ready = wait([*pending.values(), *sentinels], timeout=left)
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    # Its end of the pipe closed: it died (no other rank may notice).
                    self.procs[rank].join(1)
                    code = self.procs[rank].exitcode
                    self._fail(f"worker rank {rank} died during {method!r} (exit code {code})")
                if status == "error":
                    # A rank whose peer died fails in its next collective: name the dead one.
                    dead = [r for r, proc in enumerate(self.procs) if not proc.is_alive()]
                    cause = "".join(
                        f"worker rank {r} died (exit code {self.procs[r].exitcode}); "
                        for r in dead
                        if r != rank
                    )
                    self._fail(f"{cause}worker rank {rank} raised during {method!r}:\n{value}")
                answers[rank] = value
                del pending[rank]
            for sentinel, rank in sentinels.items():
                if sentinel in ready and rank in pending and not pending[rank].poll():
                    code = self.procs[rank].exitcode
                    self._fail(f"worker rank {rank} died during {method!r} (exit code {code})")
        return answers

    # END LAB 17.3

    # BEGIN LAB 17.3: a step: every rank runs it, rank 0 answers
    def execute_model(self, scheduler_output, grammar_output=None):
        """Run one step on every rank; rank 0's ``ModelRunnerOutput``."""
        # HINT: the workers' execute_model returns (ModelRunnerOutput, forward seconds); keep the
        # HINT: seconds in self.forward_time.
        output, self.forward_time = self.collective_rpc(
            "execute_model", args=(scheduler_output, grammar_output), unique_reply_rank=0
        )[0]
        return output

    # END LAB 17.3

    def take_draft_token_ids(self):
        return None  # speculative decoding is refused with tensor parallelism

    def check_health(self) -> None:
        dead = [rank for rank, proc in enumerate(self.procs) if not proc.is_alive()]
        if dead or self.is_failed:
            raise WorkerFailedError(f"worker rank(s) {dead} are not running")

    def _fail(self, message: str) -> None:
        self.is_failed = True
        self.shutdown()
        raise WorkerFailedError(f"{message}\nAll {self.world_size} workers were stopped.")

    def shutdown(self) -> None:
        """Stop every worker (asked first, killed if still alive 5 s later) and wait for them."""
        self._finalizer()


def _stop_workers(procs: list, conns: list[Connection]) -> None:
    for proc, conn in zip(procs, conns, strict=True):
        if proc.is_alive():
            try:
                conn.send(("shutdown", (), None))
            except OSError:
                pass
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()  # also ends a stopped (SIGSTOP) or hung process
            proc.join(5)
    for conn in conns:
        conn.close()


class WorkerProc:
    """One rank: its slice of the model, its KV cache, its model runner."""

    def __init__(self, vllm_config, rank, init_method, device_type, dtype, attention_backend):
        from mini_vllm.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )

        self.vllm_config, self.rank, self.dtype = vllm_config, rank, dtype
        self.attention_backend = attention_backend
        world_size = vllm_config.parallel_config.world_size
        if device_type == "cuda":
            self.device = torch.device(f"cuda:{rank}")
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        init_distributed_environment(
            world_size, rank, init_method, rank, "nccl" if device_type == "cuda" else "gloo"
        )
        initialize_model_parallel(world_size)
        torch.manual_seed(vllm_config.model_config.seed)  # every rank samples alike
        self.model = self.setup = self.runner = None

    def load_model_and_size_kv_cache(self):
        from mini_vllm.model_executor.model_loader import load_model
        from mini_vllm.worker.gpu_worker import initialize_kv_cache

        model_config = self.vllm_config.model_config
        self.model = load_model(
            model_config.model,
            device=self.device,
            dtype=self.dtype,
            load_tokenizer=False,
            quantization=model_config.quantization,
        ).model
        self.setup = initialize_kv_cache(
            self.vllm_config, self.model, self.device, self.dtype, self.attention_backend
        )
        return self.setup._replace(kv_caches=[])  # sizes only: tensors stay here

    def init_runner(self, num_blocks: int):
        from mini_vllm.worker.gpu_model_runner import GPUModelRunner
        from mini_vllm.worker.gpu_worker import initialize_kv_cache

        if num_blocks != self.setup.num_blocks:  # another rank holds fewer
            self.setup = initialize_kv_cache(
                self.vllm_config,
                self.model,
                self.device,
                self.dtype,
                self.attention_backend,
                num_gpu_blocks_override=num_blocks,
            )
        self.runner = GPUModelRunner(
            self.vllm_config, self.model, self.device, kv_cache_config=self.setup.kv_cache_config
        )
        return self.runner.vocab_size

    def execute_model(self, scheduler_output, grammar_output=None):
        output = self.runner.execute_model(scheduler_output, grammar_output)
        return output, self.runner.forward_time

    def comm_stats(self) -> dict:
        """This rank's tensor collectives so far, by name: {"calls", "bytes",
        "seconds"}; and the torch threads it computes with ("threads")."""
        from mini_vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return {
            "calls": dict(group.comm_calls),
            "bytes": dict(group.comm_bytes),
            "seconds": dict(group.comm_seconds),
            "threads": torch.get_num_threads(),
        }

    @staticmethod
    def worker_main(*args, conn: Connection) -> None:
        """The worker process: set up, then serve calls until told to stop."""
        torch.set_num_threads(1)  # the ranks share this machine's cores
        _exit_with_parent()
        try:
            worker = WorkerProc(*args)
            WorkerProc.worker_busy_loop(worker, conn)
        except (EOFError, KeyboardInterrupt):
            pass  # the engine went away
        except Exception:
            try:
                conn.send(("error", traceback.format_exc()))
            except OSError:
                pass

    @staticmethod
    def worker_busy_loop(worker: WorkerProc, conn: Connection) -> None:
        while True:
            method, args, reply_rank = conn.recv()
            if method == "shutdown":
                from mini_vllm.distributed.parallel_state import (
                    destroy_distributed_environment,
                    destroy_model_parallel,
                )

                destroy_model_parallel()
                destroy_distributed_environment()
                return
            try:
                output = getattr(worker, method)(*args)
            except Exception:
                conn.send(("error", traceback.format_exc()))
                raise
            conn.send(("ok", output if reply_rank in (None, worker.rank) else None))


def _exit_with_parent() -> None:
    """End this worker when the engine process dies, even mid-collective."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="mini_vllm_parent_watch").start()
