"""Checks the Phase 17 graded suites share: your tensor-parallel pieces, run
where the reference runs its own, in this process and in spawned ones.

The starters re-open only the methods that hold a lab, and the reference
builds its process groups, layers and executor by name. ``installed(impl)``
puts the student's classes where the reference would put its own:

- ``GroupCoordinator`` in parallel_state, so ``initialize_model_parallel``
  builds the student's group (its ``all_reduce`` and ``all_gather``);
- the parallel layers, in their modules and wherever mini_vllm imported
  them (llama.py). ``MergedColumnParallelLinear`` and ``QKVParallelLinear``
  are also given the methods the starter re-opens on
  ``ColumnParallelLinear`` (upstream defines them on the base class, which
  both inherit), and ``ParallelLMHead`` those re-opened on
  ``VocabParallelEmbedding``;
- ``MultiprocExecutor`` (the engine takes it by name for ``"mp"``) and the
  worker's entry point: each spawned worker process loads the student's
  code too before it builds its model (``GradedWorkerProc.worker_main``
  reads the lab from ``MINI_VLLM_GRADED_LAB``; IMPL and MINI_VLLM_LABS_DIR
  travel in the environment, as spawn copies it).

``run_ranks(fn, n, *args, lab=...)`` is tests/tp_workers.py's harness with
the student's code installed in each rank before its groups are built, the
pinned upstream's parallel state on the same process group, and each
rank's failure kept as text (``fn`` returns ``{section: result}``; a section
that raised holds ``{"error": traceback}``), so that one unwritten region
fails the tests that need it and no other.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from mini_vllm.grading import impl as impl_mod

LAB_ENV = "MINI_VLLM_GRADED_LAB"

# (reference module, class names) the student's starters may re-open.
CLASSES = {
    "mini_vllm.distributed.parallel_state": ["GroupCoordinator"],
    "mini_vllm.model_executor.layers.linear": [
        "ColumnParallelLinear",
        "MergedColumnParallelLinear",
        "QKVParallelLinear",
        "RowParallelLinear",
    ],
    "mini_vllm.model_executor.layers.vocab_parallel_embedding": [
        "VocabParallelEmbedding",
        "ParallelLMHead",
    ],
    "mini_vllm.executor.multiproc_executor": ["MultiprocExecutor"],
}
# Classes that inherit a re-opened base in the reference: {class: base}.
INHERITS = {
    "MergedColumnParallelLinear": "ColumnParallelLinear",
    "QKVParallelLinear": "ColumnParallelLinear",
    "ParallelLMHead": "VocabParallelEmbedding",
}
STARTER = {
    "mini_vllm.distributed.parallel_state": "parallel_state",
    "mini_vllm.model_executor.layers.linear": "linear",
    "mini_vllm.model_executor.layers.vocab_parallel_embedding": "vocab_parallel_embedding",
    "mini_vllm.executor.multiproc_executor": "multiproc_executor",
}


def reopened(student: type, reference: type) -> dict:
    """The methods ``student`` (a starter's subclass of ``reference``) re-opens."""
    if student is reference:
        return {}
    return {k: v for k, v in vars(student).items() if callable(v) and not k.startswith("__")}


def student_classes(impl) -> dict[str, dict[str, type]]:
    """{reference module: {class name: the class to use in its place}}."""
    import importlib

    out: dict[str, dict[str, type]] = {}
    for module_name, names in CLASSES.items():
        reference = importlib.import_module(module_name)
        starter = getattr(impl, STARTER[module_name])
        classes = {}
        for name in names:
            ref_cls = getattr(reference, name)
            cls = getattr(starter, name, ref_cls)
            base = INHERITS.get(name)
            if base is not None:
                # The base's re-opened methods, where this class inherits them.
                ref_base = getattr(reference, base)
                extra = {
                    k: v
                    for k, v in reopened(getattr(starter, base, ref_base), ref_base).items()
                    if getattr(ref_cls, k, None) is getattr(ref_base, k, None)
                }
                if extra:
                    cls = type(name, (cls,), {**extra, "__module__": cls.__module__})
            if cls is not ref_cls:
                classes[name] = cls
        out[module_name] = classes
    return out


@contextlib.contextmanager
def installed(impl, workers: bool = True):
    """While open, the reference builds the student's classes (see the module
    docstring); ``workers``: the executor's workers load them too."""
    import mini_vllm.executor.multiproc_executor as mp_executor
    import mini_vllm.model_executor.models.llama  # noqa: F401 (its imported names are patched)

    saved: list[tuple[object, str, object]] = []
    try:
        for module_name, classes in student_classes(impl).items():
            ref_module = sys.modules[module_name]
            for name, cls in classes.items():
                original = getattr(ref_module, name)
                for module in list(sys.modules.values()):
                    if (module is not None and getattr(module, "__name__", "") or "").startswith(
                        "mini_vllm."
                    ) and module.__dict__.get(name) is original:
                        saved.append((module, name, original))
                        setattr(module, name, cls)
        if workers:
            saved.append((mp_executor, "WorkerProc", mp_executor.WorkerProc))
            mp_executor.WorkerProc = GradedWorkerProc
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


@contextlib.contextmanager
def graded_lab(lab: str):
    """Spawned workers load ``lab``'s code (the environment they inherit)."""
    before = os.environ.get(LAB_ENV)
    os.environ[LAB_ENV] = lab
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LAB_ENV, None)
        else:
            os.environ[LAB_ENV] = before


class GradedWorkerProc:
    """The spawn target the executor starts while ``installed`` is open:
    the student's code of ``$MINI_VLLM_GRADED_LAB`` goes in first, then the
    reference worker runs (it builds the model with the classes installed)."""

    @staticmethod
    def worker_main(*args, conn) -> None:
        from mini_vllm.executor import multiproc_executor

        reference_worker_proc = multiproc_executor.WorkerProc
        lab = os.environ.get(LAB_ENV)
        try:
            student = impl_mod.load(lab) if lab else None
        except Exception:
            conn.send(("error", traceback.format_exc()))
            return
        with installed(student, workers=False) if student else contextlib.nullcontext():
            reference_worker_proc.worker_main(*args, conn=conn)


# --- N gloo ranks, the student's code in each -----------------------------------


def _entry(rank, fn, world_size, port, out_dir, lab, upstream, args):
    torch.set_num_threads(1)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from mini_vllm.distributed import parallel_state as mini_ps

    init_method = f"tcp://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        try:
            student = impl_mod.load(lab)
        except Exception:
            result = {"load": {"error": traceback.format_exc()}}
            torch.save(result, Path(out_dir) / f"rank{rank}.pt")
            return
        stack.enter_context(installed(student, workers=False))
        mini_ps.init_distributed_environment(world_size, rank, init_method, -1, "gloo")
        mini_ps.initialize_model_parallel(world_size)
        if upstream:
            from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
            from vllm.distributed import parallel_state as up_ps

            cpu_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
            stack.enter_context(set_current_vllm_config(cpu_config))
            up_ps.init_distributed_environment(world_size, rank, init_method, rank, "gloo")
            up_ps.initialize_model_parallel(world_size)
        stack.enter_context(torch.no_grad())
        result = fn(rank, world_size, student, *args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    mini_ps.destroy_model_parallel()
    mini_ps.destroy_distributed_environment()


def run_ranks(fn, world_size: int, *args, lab: str, upstream: bool = False) -> list[dict]:
    """``[fn(0, world_size, impl, *args), ...]``, each in its own rank with
    ``lab``'s code under grade installed; every rank is stopped on the way out."""
    import torch.multiprocessing as mp

    from mini_vllm.utils.network_utils import get_open_port

    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, get_open_port(), out_dir, lab, upstream, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            while not context.join(timeout=1):
                pass
        finally:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]


def section(results: dict, name: str):
    """``fn``'s result for section ``name``; a section that raised fails the test with its error."""
    import pytest

    if "load" in results:
        pytest.fail(f"your Phase 17 code did not load in the rank:\n{results['load']['error']}")
    got = results[name]
    if isinstance(got, dict) and "error" in got:
        error = got["error"]
        if "NotImplementedError" in error:
            last = error.strip().splitlines()[-1]
            pytest.fail(f"{last}: a lab region is not written yet.", pytrace=False)
        pytest.fail(f"{name} raised in the rank:\n{error}", pytrace=False)
    return got


def guarded(out: dict, name: str):
    """A context that records ``name``'s result in ``out``, or its traceback if it raised."""

    @contextlib.contextmanager
    def run():
        try:
            yield
        except Exception:
            out[name] = {"error": traceback.format_exc()}

    return run()


def seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def wait_gone(procs, seconds: float = 10.0) -> list:
    """The processes of ``procs`` still alive after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        time.sleep(0.1)
    return [p for p in procs if p.is_alive()]


# --- Lab 17.1: what each rank computes, yours beside upstream's ----------------------

HIDDEN, INTER, TOKENS = 48, 96, 5


def _rank_tensor(rank: int, *shape: int) -> torch.Tensor:
    """A tensor that differs from rank to rank."""
    return seeded(*shape, seed=100 + rank)


def _layer_record(mini, up, mini_y, up_y, params) -> dict:
    if isinstance(up_y, tuple):
        up_y = up_y[0]
    return {
        "shapes": {p: (tuple(getattr(mini, p).shape), tuple(getattr(up, p).shape)) for p in params},
        "weights_equal": {p: torch.equal(getattr(mini, p), getattr(up, p)) for p in params},
        "mini_y": mini_y.clone(),
        "up_y": up_y.clone(),
    }


def collectives_and_linears(rank: int, world_size: int, impl) -> dict:
    """Lab 17.1 on one rank: your group's collectives next to upstream's
    ``get_tp_group()``'s on the same ranks, and your column, merged and row
    layers next to upstream's, loaded from the same whole tensors and run
    on the same input."""
    from vllm.distributed import parallel_state as up_ps
    from vllm.model_executor.layers import linear as up_linear

    from mini_vllm.distributed import parallel_state as mini_ps
    from mini_vllm.model_executor.layers import linear as mini_linear

    out: dict = {}
    mine, up_group = mini_ps.get_tp_group(), up_ps.get_tp_group()
    out["group_class"] = type(mine).__qualname__

    with guarded(out, "all_reduce"):
        got = []
        calls_before = mine.comm_calls["all_reduce"]
        bytes_before = mine.comm_bytes["all_reduce"]
        sent = 0
        for shape in [(5,), (3, 4), (2, 3, 4)]:
            x = _rank_tensor(rank, *shape)
            got.append((shape, mine.all_reduce(x.clone()), up_group.all_reduce(x.clone())))
            sent += x.numel() * x.element_size()
        out["all_reduce"] = {
            "results": got,
            "calls": mine.comm_calls["all_reduce"] - calls_before,
            "bytes": mine.comm_bytes["all_reduce"] - bytes_before,
            "sent": sent,
        }

    with guarded(out, "all_gather"):
        got = []
        calls_before = mine.comm_calls["all_gather"]
        x = _rank_tensor(rank, 2, 3, 4)
        for dim in (0, 1, 2, -1, -2):
            got.append((dim, mine.all_gather(x, dim), up_group.all_gather(x, dim)))
        out["all_gather"] = {
            "results": got,
            "calls": mine.comm_calls["all_gather"] - calls_before,
        }

    x = seeded(TOKENS, HIDDEN, seed=1)
    w, b = seeded(INTER, HIDDEN, seed=2), seeded(INTER, seed=3)
    for gather in (False, True):
        with guarded(out, f"column gather_output={gather}"):
            mini = mini_linear.ColumnParallelLinear(HIDDEN, INTER, bias=True, gather_output=gather)
            up = up_linear.ColumnParallelLinear(HIDDEN, INTER, bias=True, gather_output=gather)
            mini.weight_loader("weight", w)
            mini.weight_loader("bias", b)
            up.weight_loader(up.weight, w)
            up.weight_loader(up.bias, b)
            out[f"column gather_output={gather}"] = _layer_record(
                mini, up, mini(x), up(x), ("weight", "bias")
            )

    with guarded(out, "merged"):
        gate, upw = seeded(INTER, HIDDEN, seed=4), seeded(INTER, HIDDEN, seed=5)
        mini = mini_linear.MergedColumnParallelLinear(HIDDEN, [INTER, INTER])
        up = up_linear.MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False)
        for shard, tensor in enumerate((gate, upw)):
            mini.weight_loader("weight", tensor, shard)
            up.weight_loader(up.weight, tensor, shard)
        out["merged"] = _layer_record(mini, up, mini(x), up(x), ("weight",))

    w, b = seeded(HIDDEN, INTER, seed=9), seeded(HIDDEN, seed=10)
    x_inter = seeded(TOKENS, INTER, seed=11)
    part = INTER // world_size
    x_part = x_inter[:, rank * part : (rank + 1) * part]
    # (upstream refuses a bias without the all-reduce: linear.py:1477)
    for name, kwargs, x_in in [
        ("row", {"bias": True}, x_part),
        ("row input_is_parallel=False", {"bias": True, "input_is_parallel": False}, x_inter),
        ("row reduce_results=False", {"bias": False, "reduce_results": False}, x_part),
    ]:
        with guarded(out, name):
            mini = mini_linear.RowParallelLinear(INTER, HIDDEN, **kwargs)
            up = up_linear.RowParallelLinear(INTER, HIDDEN, **kwargs)
            params = ("weight", "bias") if kwargs["bias"] else ("weight",)
            for param in params:
                tensor = w if param == "weight" else b
                mini.weight_loader(param, tensor)
                up.weight_loader(getattr(up, param), tensor)
            out[name] = _layer_record(mini, up, mini(x_in), up(x_in), params)
    return out


# --- Lab 17.2: one rank of a split, in this process ---------------------------------


class OneRankOfMany:
    """A stand-in tensor-parallel group: rank ``rank_in_group`` of
    ``world_size``, whose all-reduce hands back this rank's partial result
    (the test adds the ranks' parts up itself)."""

    def __init__(self, world_size: int, rank_in_group: int) -> None:
        self.world_size, self.rank_in_group = world_size, rank_in_group
        self.unique_name = "tp"

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        return input_


@contextlib.contextmanager
def as_rank(tp: int, rank: int):
    """Layers built inside see rank ``rank`` of ``tp``, mini_vllm's and upstream's alike."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as up_ps

    from mini_vllm.distributed import parallel_state as mini_ps

    saved = mini_ps._TP, up_ps._TP
    mini_ps._TP = up_ps._TP = OneRankOfMany(tp, rank)
    try:
        with set_current_vllm_config(_cpu_config()), torch.no_grad():
            yield
    finally:
        mini_ps._TP, up_ps._TP = saved


_CPU_CONFIG = None


def _cpu_config():
    global _CPU_CONFIG
    if _CPU_CONFIG is None:
        from vllm.config import DeviceConfig, VllmConfig

        _CPU_CONFIG = VllmConfig(device_config=DeviceConfig(device="cpu"))
    return _CPU_CONFIG


# --- Lab 17.3: your executor over workers without a model ----------------------------


class EchoWorker:
    """A worker without a model, for the executor's failure paths: it
    answers its rank, raises when told to, and is served by the reference's
    ``WorkerProc.worker_busy_loop`` like a real worker."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def whoami(self) -> int:
        return self.rank

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"rank {rank} was told to fail")
        return self.rank


def _echo_worker_main(rank: int, conn) -> None:
    from mini_vllm.executor.multiproc_executor import WorkerProc

    try:
        WorkerProc.worker_busy_loop(EchoWorker(rank), conn)
    except (EOFError, KeyboardInterrupt):
        pass
    except Exception:
        pass  # the busy loop sent the error before re-raising
    os._exit(0)


def executor_over_echo_workers(executor_cls: type, world_size: int):
    """An instance of ``executor_cls`` (a ``MultiprocExecutor``) driving
    ``world_size`` forked ``EchoWorker`` processes, set up as its
    ``__init__`` sets up real workers (the same attributes, the same
    finalizer); forking keeps it under a second."""
    import multiprocessing
    import weakref

    from mini_vllm.executor.multiproc_executor import _stop_workers

    ctx = multiprocessing.get_context("fork")
    executor = object.__new__(executor_cls)
    executor.world_size, executor.is_failed = world_size, False
    executor.forward_time, executor.requests = 0.0, {}
    executor.procs, executor.conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=_echo_worker_main, args=(rank, child_conn), daemon=True)
        proc.start()
        child_conn.close()
        executor.procs.append(proc)
        executor.conns.append(parent_conn)
    executor._finalizer = weakref.finalize(executor, _stop_workers, executor.procs, executor.conns)
    return executor
