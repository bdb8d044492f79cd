"""Process groups and their collectives: the world, and the tensor-parallel group.

Mirrors upstream ``vllm/distributed/parallel_state.py`` at v0.22.1
(``GroupCoordinator`` :290 with ``all_reduce`` :514, ``all_gather`` :543,
``broadcast`` :618, ``broadcast_object`` :633, ``barrier`` :1052, ``destroy``
:1077; ``get_world_group`` :1149, ``get_tp_group`` :1241,
``init_distributed_environment`` :1370, ``initialize_model_parallel`` :1506,
``get_tensor_model_parallel_world_size`` :1849,
``get_tensor_model_parallel_rank`` :1854,
``destroy_model_parallel`` :1875, ``destroy_distributed_environment`` :1914).

Every process of a run calls ``init_distributed_environment`` with the same
``distributed_init_method``: ``tcp://host:port`` names a TCP store that rank
0 opens and every other rank dials, so the same call works for processes of
one machine and of several. Then ``initialize_model_parallel(tp)`` cuts the
world into groups of ``tp`` consecutive ranks; a parallel layer asks
``get_tp_group()`` for its rank and its collectives.

A ``GroupCoordinator`` holds two torch.distributed groups over the same
ranks: ``device_group`` on the run's backend (NCCL on CUDA, gloo on CPU) for
tensors, and ``cpu_group`` on gloo for Python objects, as upstream's.
Collectives on a group of one return their input untouched. Each
coordinator counts the tensor collectives it ran, their input bytes and
the seconds spent inside them (``comm_calls``, ``comm_bytes``,
``comm_seconds``; mini_vllm's, for measuring a step).

Left out: pipeline, data, expert and context parallel groups, the device
communicators (custom all-reduce, symmetric memory, the CPU shm all-reduce:
here ``all_reduce`` and ``all_gather`` call torch.distributed directly, as
upstream's base ``DeviceCommunicatorBase`` does), the shared-memory
``MessageQueue`` broadcaster, torch.compile custom ops, elastic EP, tensor
dicts, send/recv. One deliberate difference: a process that never called
``initialize_model_parallel`` counts as a tensor-parallel group of one
(``get_tensor_model_parallel_world_size`` is 1, its rank 0), so a model
built outside any run (tests, notebooks) needs no set-up; upstream's
single-process executor initialises a world of one instead.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class GroupCoordinator:
    """One process's view of the group it belongs to, out of ``group_ranks``.

    ``rank``: the global rank; ``ranks``: the global ranks of this group;
    ``rank_in_group``: its place among them; ``local_rank``: which device on
    this machine (``cuda:local_rank``).
    """

    def __init__(
        self,
        group_ranks: list[list[int]],
        local_rank: int,
        torch_distributed_backend: str,
        group_name: str | None = None,
    ) -> None:
        self.unique_name = group_name or "anonymous"
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        self.ranks: list[int] = []
        # Every process must create every group, members or not (new_group is
        # collective over the whole world); each keeps the one it is in.
        for ranks in group_ranks:
            device_group = dist.new_group(ranks, backend=torch_distributed_backend)
            cpu_group = dist.new_group(ranks, backend="gloo")
            if self.rank in ranks:
                self.ranks = list(ranks)
                self.device_group, self.cpu_group = device_group, cpu_group
        if not self.ranks:
            raise ValueError(f"rank {self.rank} is in none of the groups {group_ranks}")
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.rank)
        if torch_distributed_backend == "nccl":
            self.device = torch.device(f"cuda:{local_rank}")
        else:
            self.device = torch.device("cpu")
        # mini_vllm only: how many tensor collectives ran, their input bytes
        # and the wall seconds inside them, by name (what a TP step costs in
        # communication; the seconds include waiting for the slowest rank).
        self.comm_calls: Counter[str] = Counter()
        self.comm_bytes: Counter[str] = Counter()
        self.comm_seconds: Counter[str] = Counter()

    def _count(self, name: str, input_: torch.Tensor) -> None:
        self.comm_calls[name] += 1
        self.comm_bytes[name] += input_.numel() * input_.element_size()

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    # BEGIN LAB 17.1: the all-reduce: every rank gets the sum
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``input_`` over the group, on every rank
        (computed in place; the sum is returned)."""
        # HINT: a group of one returns its input untouched; count the call (self._count) and time it
        # HINT: (self.comm_seconds) before handing input_ to torch.distributed on self.device_group.
        if self.world_size == 1:
            return input_
        self._count("all_reduce", input_)
        start = time.perf_counter()
        dist.all_reduce(input_, group=self.device_group)
        self.comm_seconds["all_reduce"] += time.perf_counter() - start
        return input_

    # END LAB 17.1

    # BEGIN LAB 17.1: the all-gather: every rank's slice, concatenated along dim
    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``input_`` concatenated along ``dim``, in rank order,
        on every rank."""
        # HINT: torch.distributed gathers along a new leading dim (dist.all_gather_single into a
        # HINT: [world_size * rows, ...] tensor); move that dim next to `dim`, then merge the two.
        if self.world_size == 1:
            return input_
        if not -input_.dim() <= dim < input_.dim():
            raise ValueError(f"dim {dim} is out of range for a tensor of shape {input_.shape}")
        dim %= input_.dim()
        self._count("all_gather", input_)
        # Gather along a new leading dim, then move it next to ``dim`` and merge.
        out = torch.empty(
            (self.world_size * input_.shape[0],) + tuple(input_.shape[1:]),
            dtype=input_.dtype,
            device=input_.device,
        )
        # (upstream calls all_gather_into_tensor: torch 2.13 renamed it all_gather_single)
        start = time.perf_counter()
        dist.all_gather_single(out, input_.contiguous(), group=self.device_group)
        self.comm_seconds["all_gather"] += time.perf_counter() - start
        out = out.reshape((self.world_size,) + tuple(input_.shape)).movedim(0, dim)
        shape = list(input_.shape)
        shape[dim] *= self.world_size
        return out.reshape(shape)

    # END LAB 17.1

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``input_`` of rank ``src`` (in the group) copied into every rank's ``input_``."""
        if not 0 <= src < self.world_size:
            raise ValueError(
                f"src must be a rank in the group (0..{self.world_size - 1}), got {src}"
            )
        if self.world_size == 1:
            return input_
        dist.broadcast(input_, src=self.ranks[src], group=self.device_group)
        return input_

    def broadcast_object(self, obj: Any | None = None, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj``, returned on every rank (over ``cpu_group``)."""
        if not 0 <= src < self.world_size:
            raise ValueError(
                f"src must be a rank in the group (0..{self.world_size - 1}), got {src}"
            )
        if self.world_size == 1:
            return obj
        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank of the group is here."""
        dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        for name in ("device_group", "cpu_group"):
            group = self.__dict__.pop(name, None)
            if group is not None:
                dist.destroy_process_group(group)


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None


def get_world_group() -> GroupCoordinator:
    if _WORLD is None:
        raise RuntimeError("the world group is not initialized: call init_distributed_environment")
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    if _TP is None:
        raise RuntimeError(
            "the tensor model parallel group is not initialized: call initialize_model_parallel"
        )
    return _TP


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def init_distributed_environment(
    world_size: int = -1,
    rank: int = -1,
    distributed_init_method: str = "env://",
    local_rank: int = -1,
    backend: str = "nccl",
    timeout: timedelta | None = None,
) -> None:
    """Join the run's default process group and build the world group.

    ``distributed_init_method``: ``tcp://host:port`` (rank 0 listens there)
    or ``env://`` (MASTER_ADDR / MASTER_PORT). A backend this torch lacks
    (NCCL on a CPU-only build) falls back to gloo, as upstream's does.
    """
    global _WORLD
    if not dist.is_initialized():
        if not dist.is_backend_available(backend):
            backend = "gloo"
        dist.init_process_group(
            backend=backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            timeout=timeout,
        )
    if local_rank == -1:
        # One machine: the global rank is the device index.
        if distributed_init_method == "env://":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        else:
            local_rank = dist.get_rank()
    if _WORLD is None:
        ranks = list(range(dist.get_world_size()))
        _WORLD = GroupCoordinator([ranks], local_rank, dist.get_backend(), "world")
    elif _WORLD.world_size != dist.get_world_size():
        raise RuntimeError("the world group is already initialized with another world size")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1, backend: str | None = None
) -> None:
    """Cut the world into tensor-parallel groups of consecutive ranks:
    with 4 ranks and ``tensor_model_parallel_size=2``, [0, 1] and [2, 3]."""
    global _TP
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed_environment before initialize_model_parallel")
    if _TP is not None:
        raise RuntimeError("the tensor model parallel group is already initialized")
    world_size = dist.get_world_size()
    tp = tensor_model_parallel_size
    if tp < 1 or world_size % tp != 0:
        raise ValueError(
            f"tensor_model_parallel_size ({tp}) must divide the world size ({world_size})"
        )
    backend = backend or dist.get_backend(get_world_group().device_group)
    group_ranks = [list(range(start, start + tp)) for start in range(0, world_size, tp)]
    _TP = GroupCoordinator(group_ranks, get_world_group().local_rank, backend, "tp")


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-parallel group's size (1 outside any run: see the module docstring)."""
    return _TP.world_size if _TP is not None else 1


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in the tensor-parallel group (0 outside any run)."""
    return _TP.rank_in_group if _TP is not None else 0


def destroy_model_parallel() -> None:
    global _TP
    if _TP is not None:
        _TP.destroy()
    _TP = None


def destroy_distributed_environment() -> None:
    global _WORLD
    if _WORLD is not None:
        _WORLD.destroy()
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()
