"""Helpers shared by Phase 05's graded suites: small persistent batches, the
sides of the lockstep drivers with your classes in them, and the engine with
your runner pieces plugged in.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)

The lockstep drivers are the project's own: mini_vllm/oracle/batch_workload.py
(an ``InputBatch`` edited as a runner edits it) and
mini_vllm/oracle/runner_workload.py (the pinned upstream scheduler's outputs
through a runner's ``_update_states``). Here their "mini" side is built from
your code.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from mini_vllm.grading.checks import written  # noqa: F401 (the lab tests import it from here)
from mini_vllm.oracle.batch_workload import VOCAB_SIZE, MiniSide
from mini_vllm.oracle.runner_workload import MiniRunnerSide
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.gpu_input_batch import CachedRequestState


def batch_side(impl):
    """The lockstep's mini side with your ``InputBatch``."""
    return functools.partial(MiniSide, input_batch_cls=impl.gpu_input_batch.InputBatch)


def runner_side(impl):
    """The runner lockstep's mini side with your ``GPUModelRunner``."""
    return functools.partial(MiniRunnerSide, runner_cls=impl.gpu_model_runner.GPUModelRunner)


def make_input_batch(impl, max_num_reqs=6, max_model_len=32, block_size=4):
    return impl.gpu_input_batch.InputBatch(
        max_num_reqs=max_num_reqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        pin_memory=False,
        vocab_size=VOCAB_SIZE,
        block_sizes=[block_size],
    )


def request(req_id, prompt, blocks=(), computed=0, seed=None, **params) -> CachedRequestState:
    """A runner's request state; a seeded random request gets its generator
    as the runner gives it (only when sampling is random)."""
    sp = SamplingParams(seed=seed, **params)
    generator = None
    if seed is not None and not sp.sampling_type_greedy:
        generator = torch.Generator().manual_seed(seed)
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=sp,
        generator=generator,
        block_ids=(list(blocks),),
        num_computed_tokens=computed,
    )


def rows(batch) -> list:
    """[(request id, its token ids, its block ids) per row], holes as None."""
    table = batch.block_table[0]
    out = []
    for i, req_id in enumerate(batch.req_ids):
        if req_id is None:
            out.append(None)
            continue
        n, nb = int(batch.num_tokens_no_spec[i]), int(table.num_blocks_per_row[i])
        out.append(
            (req_id, batch.token_ids_cpu[i, :n].tolist(), table.block_table.np[i, :nb].tolist())
        )
    return out


def plug_into_engine(impl, monkeypatch) -> None:
    """Make the engine build your runner pieces: ``EngineCore`` builds your
    ``GPUModelRunner``, whose constructor builds your ``InputBatch``, whose
    block table holds your ``BlockTable``s, and whose reorder step calls your
    ``reorder_batch_to_split_decodes_and_prefills``. (Each of your classes
    subclasses the reference's, so the reference code around your regions
    finds them through these module names.)"""
    from mini_vllm.engine import core
    from mini_vllm.worker import block_table, gpu_model_runner

    monkeypatch.setattr(core, "GPUModelRunner", impl.gpu_model_runner.GPUModelRunner)
    monkeypatch.setattr(gpu_model_runner, "InputBatch", impl.gpu_input_batch.InputBatch)
    monkeypatch.setattr(block_table, "BlockTable", impl.block_table.BlockTable)
    monkeypatch.setattr(
        gpu_model_runner,
        "reorder_batch_to_split_decodes_and_prefills",
        impl.utils.reorder_batch_to_split_decodes_and_prefills,
    )


def assert_plugged(impl, llm) -> None:
    """The engine really runs your pieces (not the reference's)."""
    runner = llm.llm_engine.engine_core.model_runner
    batch = runner.input_batch
    assert type(runner) is impl.gpu_model_runner.GPUModelRunner
    assert type(batch) is impl.gpu_input_batch.InputBatch
    assert type(batch.block_table[0]) is impl.block_table.BlockTable


class RecordingBatch:
    """What ``reorder_batch_to_split_decodes_and_prefills`` reads of a batch
    (request ids, prompt and computed counts) and a ``swap_states`` that
    records each swap: rows are (num_prompt_tokens, num_computed_tokens)."""

    def __init__(self, rows: list[tuple[int, int]]) -> None:
        self.req_ids = [f"r{i}" for i in range(len(rows))]
        self.num_prompt_tokens = np.array([p for p, _ in rows], dtype=np.int32)
        self.num_computed_tokens_cpu = np.array([c for _, c in rows], dtype=np.int32)
        self.swaps: list[tuple[int, int]] = []

    def swap_states(self, i1: int, i2: int) -> None:
        if i1 == i2 or not (0 <= i1 < len(self.req_ids) and 0 <= i2 < len(self.req_ids)):
            raise ValueError(f"swap_states({i1}, {i2}) on a batch of {len(self.req_ids)} rows")
        self.swaps.append((i1, i2))
        ids = self.req_ids
        ids[i1], ids[i2] = ids[i2], ids[i1]
        for array in (self.num_prompt_tokens, self.num_computed_tokens_cpu):
            array[[i1, i2]] = array[[i2, i1]]


def every_region_written(impl) -> None:
    """Fail at once if a Phase 05 region of ``impl`` still raises
    NotImplementedError: a few cheap calls that reach every region, so a real
    run does not load a model first to find out."""
    from types import SimpleNamespace

    from mini_vllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    batch = make_input_batch(impl)
    for req_id in ("a", "b"):
        written(batch.add_request, request(req_id, [1, 2], blocks=[1]))
    batch.refresh_metadata()
    written(batch.remove_request, "a")
    written(batch.condense)  # moves b down into row 0
    table = impl.block_table.BlockTable(4, 2, 2, 4, False, torch.device("cpu"))
    written(table.append_row, [3], 0)
    written(table.move_row, 0, 1)
    written(table.swap_row, 0, 1)
    table.commit_block_table(1)
    qsl, positions = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0])
    written(table.compute_slot_mapping, 1, qsl, positions)
    so = SimpleNamespace(num_scheduled_tokens={"r0": 2, "r1": 1})
    written(
        impl.utils.reorder_batch_to_split_decodes_and_prefills, RecordingBatch([(2, 0), (2, 2)]), so
    )
    runner = runner_side(impl)({"block_size": 4, "max_num_seqs": 2}, None, 64, 63).runner
    new = NewRequestData("a", [1, 2], SamplingParams(), ([1],), 0)
    out = SchedulerOutput([new], CachedRequestData.make_empty(), {"a": 2}, 2, [0], set())
    written(runner._update_states, out)
    cached = CachedRequestData(["a"], set(), [[]], {}, [None], [2], [1])
    written(runner._update_states, SchedulerOutput([], cached, {"a": 1}, 1, [0], set()))
