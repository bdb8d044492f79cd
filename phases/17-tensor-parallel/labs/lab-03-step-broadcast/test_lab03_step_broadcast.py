"""Lab 17.3 — the executor's step broadcast: every worker runs every step.

Graded: the ``LAB 17.3`` regions of ``labs/phase_17/multiproc_executor.py``
(``MultiprocExecutor.collective_rpc`` and ``execute_model``), by running
your executor: mini_vllm's ``LLM`` with ``tensor_parallel_size=2`` and
``distributed_executor_backend="mp"`` takes your ``MultiprocExecutor`` (as
the engine takes the reference's, by name), which starts one worker process
a rank (the reference's ``WorkerProc``) and drives them through your
``collective_rpc``:

1. the tiny seeded Llama's greedy tokens equal transformers' on the same
   weights, and every rank ran every step (each rank's collectives count
   one all-reduce for the embedding, two a layer and one all-gather of the
   logits per step: a rank left out of a step would have hung the others);
2. over three forked workers without a model (``EchoWorker``, served by
   the reference's worker loop): answers come back in rank order, and only
   ``unique_reply_rank``'s holds a value when it is set; a worker that
   raises, dies or hangs past the timeout fails the executor with
   ``WorkerFailedError`` naming the rank, every worker is stopped, and later
   calls are refused;
3. last, a worker of the real engine killed between steps: the next step
   fails naming it, and no worker is left.
"""

from __future__ import annotations

import os
import signal

import pytest
from phase17_helpers import KV_BYTES, NUM_TOKENS, prompts

from mini_vllm.executor.multiproc_executor import WorkerFailedError
from mini_vllm.grading.checks import written
from mini_vllm.grading.tp_checks import (
    executor_over_echo_workers,
    graded_lab,
    installed,
    wait_gone,
)

TP = 2


def build_llm(impl, lab_id: str, path):
    """An LLM whose executor is yours (its workers spawned with your lab's code)."""
    from mini_vllm.entrypoints.llm import LLM

    with installed(impl), graded_lab(lab_id):
        return written(
            LLM,
            str(path),
            kv_cache_memory_bytes=KV_BYTES,
            max_model_len=128,
            tensor_parallel_size=TP,
            distributed_executor_backend="mp",
        )


def greedy_tokens(llm) -> list[list[int]]:
    from mini_vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = written(
        llm.generate, [{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama, request):
    from mini_vllm.grading import impl as impl_mod
    from mini_vllm.grading.plugin import lab_of

    lab = lab_of(request.path)
    impl = impl_mod.load(lab)
    llm = build_llm(impl, lab, tiny_llama[0])
    yield llm
    llm.llm_engine.engine_core.shutdown()


def executor(llm):
    return llm.llm_engine.engine_core.model_executor


@pytest.mark.points(6)
@pytest.mark.timeout(300)
def test_every_rank_runs_every_step_and_rank_0_answers(llm, tiny_llama, impl):
    assert type(executor(llm)).__module__.startswith(("labs.", "mini_vllm.executor")), (
        "the engine did not take the executor under grade"
    )
    got = greedy_tokens(llm)
    for i, (mine, want) in enumerate(zip(got, tiny_llama[1], strict=True)):
        assert mine == want, (
            f"prompt {i}: TP=2 through your executor sampled {mine}, transformers {want}: "
            "rank 0's ModelRunnerOutput is the step's output"
        )
    core, hf_config = llm.llm_engine.engine_core, llm.llm_engine.hf_config
    per_forward = 1 + 2 * hf_config.num_hidden_layers
    stats = written(executor(llm).collective_rpc, "comm_stats")
    assert len(stats) == TP, f"collective_rpc gave {len(stats)} answers for {TP} workers"
    for rank, s in enumerate(stats):
        want = {"all_reduce": per_forward * core.num_steps, "all_gather": core.num_steps}
        assert s["calls"] == want, (
            f"rank {rank} ran collectives {s['calls']} over {core.num_steps} steps, want {want}: "
            "every step's SchedulerOutput goes to every worker"
        )


_KEEP = []


@pytest.fixture
def echo(impl):
    """Your executor over three forked workers without a model (tp_checks.EchoWorker),
    served by the reference's worker loop; stopped afterwards."""
    executor = executor_over_echo_workers(impl.multiproc_executor.MultiprocExecutor, 3)
    yield executor
    executor.shutdown()
    _KEEP.append(executor)


@pytest.mark.points(3)
@pytest.mark.timeout(60)
def test_answers_come_back_in_rank_order(echo):
    ranks = written(echo.collective_rpc, "whoami")
    assert ranks == [0, 1, 2], (
        f"each worker's rank, asked of all three: got {ranks}; the answers are in rank order"
    )
    only = written(echo.collective_rpc, "whoami", unique_reply_rank=1)
    assert only == [None, 1, None], (
        f"with unique_reply_rank=1 got {only}: every worker answers, only rank 1 with a value"
    )


@pytest.mark.points(3)
@pytest.mark.timeout(60)
def test_a_worker_that_raises_fails_the_engine_naming_it(echo):
    procs = list(echo.procs)
    with pytest.raises(WorkerFailedError) as failure:
        written(echo.collective_rpc, "fail_on", args=(2,))
    message = str(failure.value)
    assert "worker rank 2 raised" in message, (
        f"rank 2 raised: the error must name it, as 'worker rank 2 raised': {message[:300]}"
    )
    assert "rank 2 was told to fail" in message, (
        f"the error must carry the worker's traceback: {message[:300]}"
    )
    left = wait_gone(procs)
    assert not left, f"{len(left)} worker process(es) left running after the failure"
    with pytest.raises(WorkerFailedError):
        written(echo.collective_rpc, "whoami")


@pytest.mark.points(3)
@pytest.mark.timeout(60)
def test_a_worker_that_dies_fails_the_engine_naming_it(echo):
    procs = list(echo.procs)
    written(echo.collective_rpc, "whoami")
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(10)
    with pytest.raises(WorkerFailedError, match="worker rank 1 died"):
        written(echo.collective_rpc, "whoami")
    left = wait_gone(procs)
    assert not left, f"{len(left)} worker process(es) left running after rank 1 died"


@pytest.mark.points(2)
@pytest.mark.timeout(60)
def test_a_worker_that_hangs_times_out_and_every_worker_stops(echo):
    procs = list(echo.procs)
    written(echo.collective_rpc, "whoami")
    os.kill(procs[0].pid, signal.SIGSTOP)
    with pytest.raises(WorkerFailedError, match=r"worker rank\(s\) \[0\] sent no answer"):
        written(echo.collective_rpc, "whoami", timeout=2)
    left = wait_gone(procs)
    assert not left, f"{len(left)} worker process(es) left running after rank 0 hung"


@pytest.mark.points(3)
@pytest.mark.timeout(120)
def test_a_worker_dying_mid_run_fails_the_engine(llm, impl):
    """Last, on the real engine: rank 1 killed between steps; the next step fails."""
    procs = list(executor(llm).procs)
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(10)
    with pytest.raises(WorkerFailedError, match="worker rank 1 died"):
        greedy_tokens(llm)
    left = wait_gone(procs)
    assert not left, f"{len(left)} worker process(es) left running after rank 1 died"
    with pytest.raises(WorkerFailedError, match="have failed"):
        greedy_tokens(llm)
