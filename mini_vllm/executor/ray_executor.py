"""Tensor parallelism on Ray: the same workers as ``MultiprocExecutor``, as Ray actors.

Mirrors upstream ``vllm/v1/executor/ray_executor.py`` at v0.22.1
(``RayDistributedExecutor`` :64 with ``shutdown`` :107, ``execute_model``
:407, ``collective_rpc`` :487, ``check_health`` :642) and the actor class
of ``vllm/v1/executor/ray_utils.py`` (``RayWorkerWrapper``, with its
``execute_method`` and ``get_node_ip``).

Each rank is an actor holding a ``WorkerProc`` (multiproc_executor.py):
the same set-up, shards, KV cache and runner; ``collective_rpc`` calls a
method on every actor and ``ray.get``s the answers. Rank 0's actor names
the TCP store's address (its node's IP and a port free there), so the run
spans machines as it runs on one: start a Ray cluster (``ray start --head``
on one host, ``ray start --address=HEAD:6379`` on the others), set
``RAY_ADDRESS=auto`` and run with ``distributed_executor_backend="ray"``;
without ``RAY_ADDRESS`` a local cluster is started on this machine. Actors
reserve one GPU each on CUDA and no CPU on a CPU machine (three ranks may
share two cores).

Failures as with the multiprocessing executor: an actor that raises, dies
or misses ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` ends the engine with
``WorkerFailedError`` naming the rank, and every actor is killed. Left
out: placement groups and bundle indices, Ray's compiled graphs (upstream
runs each step through one), pipeline parallelism, nsight, env-var
propagation.
"""

from __future__ import annotations

import os
import time

import torch

from mini_vllm.executor.multiproc_executor import (
    WorkerFailedError,
    WorkerProc,
    execute_model_timeout,
)
from mini_vllm.utils.network_utils import get_distributed_init_method, get_open_port


class RayWorkerWrapper:
    """One rank's actor: builds its ``WorkerProc`` when told where the run meets."""

    def __init__(self) -> None:
        self.worker: WorkerProc | None = None

    def get_node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def get_open_port(self) -> int:
        return get_open_port()

    def get_pid(self) -> int:
        return os.getpid()

    def init_worker(self, *args) -> None:
        torch.set_num_threads(1)  # the ranks may share this machine's cores
        self.worker = WorkerProc(*args)

    def execute_method(self, method: str, *args):
        return getattr(self.worker, method)(*args)


class RayDistributedExecutor:
    uses_ray = True

    def __init__(self, vllm_config, device: torch.device, dtype, attention_backend: str) -> None:
        import ray

        self.world_size = vllm_config.parallel_config.world_size
        self.is_failed = False
        self.forward_time = 0.0
        self.requests: dict = {}  # the runners' request states live in the actors
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        resources = {"num_gpus": 1} if device.type == "cuda" else {"num_cpus": 0}
        actor_cls = ray.remote(**resources)(RayWorkerWrapper)
        self.workers = [actor_cls.remote() for _ in range(self.world_size)]
        try:
            ip, port = ray.get(
                [self.workers[0].get_node_ip.remote(), self.workers[0].get_open_port.remote()]
            )
            init_method = get_distributed_init_method(ip, port)
            ray.get(
                [
                    worker.init_worker.remote(
                        vllm_config, rank, init_method, device.type, dtype, attention_backend
                    )
                    for rank, worker in enumerate(self.workers)
                ],
                timeout=600,
            )
        except Exception as e:
            self._fail(f"the Ray workers did not start: {e}")
        setups = self.collective_rpc("load_model_and_size_kv_cache", timeout=600)
        num_blocks = min(setup.num_blocks for setup in setups)
        self.vocab_size = self.collective_rpc("init_runner", args=(num_blocks,))[0]
        self.kv_cache = setups[0]._replace(num_blocks=num_blocks)

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list:
        """``WorkerProc.<method>(*args)`` on every actor; the answers in rank order."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self.is_failed:
            raise WorkerFailedError("the executor's workers have failed and were stopped")
        timeout = execute_model_timeout() if timeout is None else timeout
        refs = [worker.execute_method.remote(method, *args) for worker in self.workers]
        deadline = time.monotonic() + timeout
        answers, errors, dead = [None] * self.world_size, {}, []
        pending = dict(enumerate(refs))
        while pending:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(left, 0))
            if not ready:
                self._fail(
                    f"worker rank(s) {sorted(pending)} sent no answer to {method!r} "
                    f"within {timeout:g} s (hung; VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)"
                )
            for rank, ref in list(pending.items()):
                if ref not in ready:
                    continue
                del pending[rank]
                try:
                    answers[rank] = ray.get(ref)
                except RayActorError:
                    dead.append(rank)
                except (GetTimeoutError, Exception) as e:
                    errors[rank] = e
            if dead or errors:
                # A rank whose peer died fails in its next collective: give the
                # others a moment, so that a dead actor is named as the cause.
                ray.wait(list(pending.values()), num_returns=len(pending), timeout=5)
                for rank, ref in pending.items():
                    try:
                        ray.get(ref, timeout=0)
                    except RayActorError:
                        dead.append(rank)
                    except Exception:
                        pass
                break
        if dead:
            self._fail(f"worker rank {dead[0]} died during {method!r} (its Ray actor is gone)")
        if errors:
            rank, error = next(iter(errors.items()))
            self._fail(f"worker rank {rank} raised during {method!r}:\n{error}")
        return answers

    def execute_model(self, scheduler_output, grammar_output=None):
        """Run one step on every rank; rank 0's ``ModelRunnerOutput``."""
        outputs = self.collective_rpc("execute_model", args=(scheduler_output, grammar_output))
        output, self.forward_time = outputs[0]
        return output

    def take_draft_token_ids(self):
        return None  # speculative decoding is refused with tensor parallelism

    def check_health(self) -> None:
        if self.is_failed:
            raise WorkerFailedError("the executor's workers have failed and were stopped")

    def _fail(self, message: str) -> None:
        self.is_failed = True
        self.shutdown()
        raise WorkerFailedError(f"{message}\nAll {self.world_size} workers were stopped.")

    def shutdown(self) -> None:
        """Kill every actor (and the local Ray cluster this executor started)."""
        import ray

        for worker in getattr(self, "workers", []):
            try:
                ray.kill(worker)
            except Exception:
                pass
        self.workers = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False
