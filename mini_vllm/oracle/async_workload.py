"""A workload driver for async scheduling: outputs come back one step late.

``run_workload_async`` runs a backend's ``AsyncScheduler`` (built with
``async_scheduling=True``) the way upstream's engine core drives it with a
batch queue of two (``EngineCore.step_with_batch_queue``,
vllm/v1/engine/core.py:469): each engine step schedules a batch if there is
work and puts it in the queue; while the queue is not full and the batch ran
tokens, the step returns without waiting; otherwise it takes the oldest batch
out, and its fake-model output goes to ``update_from_output``. The fake
worker is taken to be never done before it is waited on (upstream peeks at
``future.done()``, a race; here the queue always fills), so the run is
deterministic and the two schedulers see the same calls.

The fake model is ``workload.fake_token``: a request that samples in a batch
(not mid-prefill once the batch is scheduled) gets the token for its output
index *when the output is delivered*, which is the index upstream's model
would have sampled at, because updates arrive in step order.

With ``num_speculative_tokens`` in the config the schedulers run as upstream's
does for a drafter in the worker (EAGLE, MTP; the engine core hands them no
draft ids, vllm/v1/engine/core.py:460-467): each request that samples holds k
placeholder drafts (-1) for its next step. The fake worker drafts what the
fake model would say, and the fake model accepts ``RequestSpec.accepted`` of
the drafts a batch verified (``workload.verified_tokens``): the delivered
output holds the accepted drafts and one token more, and the schedulers take
the rejected ones back off their counts and placeholders.

Each engine step's record holds the scheduled batch (the fields of
``describe_scheduler_output``, if one was scheduled), which batch's output
was delivered, the update's outputs (and spec-decode stats), free blocks
and prefix-cached blocks, each scheduled request's placeholders right after
``schedule()`` and every request's placeholders and counts at the end of
the step; with KV-cache groups (``kv_groups``) also the delivered update's
prefix-cache stats and every request's block table in each group.
``first_difference`` compares two traces with ``ASYNC_FIELD_WORDS``.
"""

from __future__ import annotations

from collections import deque

from mini_vllm.oracle.workload import (
    FIELD_WORDS,
    Arrivals,
    Progress,
    Workload,
    _group_tables,
    _outputs,
    _prefix_cache_stats,
    _spec_stats,
    describe_scheduler_output,
    encoder_cache_state,
    fake_token,
    verified_tokens,
)

# Upstream's UniProcExecutor.max_concurrent_batches with async scheduling
# (vllm/v1/executor/uniproc_executor.py:77).
BATCH_QUEUE_SIZE = 2

ASYNC_FIELD_WORDS = {
    **FIELD_WORDS,
    "scheduled_placeholders": "placeholders of each scheduled request, after schedule()",
    "cached_blocks": "prefix-cached block ids, and each request's cached-block count",
    "delivered": "the scheduled batch whose output update_from_output took",
    "spec_stats": "spec-decode stats of the delivered output (drafts, draft tokens, accepted, "
    "accepted per position)",
    "requests": "each request's (id, placeholders, computed tokens, tokens, status)",
}


def run_workload_async(backend, workload: Workload, scheduler=None) -> dict:
    """Run a workload through an async scheduler with a batch queue of two.

    ``scheduler`` may be given (built by ``backend.create_scheduler`` with
    ``async_scheduling=True``), for example a student's.
    """
    sched = scheduler or backend.create_scheduler(**workload.config, async_scheduling=True)
    hybrid = workload.config.get("kv_groups") is not None
    eos = backend.EOS_TOKEN_ID
    specs = {s.req_id: s for s in workload.requests}
    arrivals = Arrivals(backend, sched, workload)
    objects = arrivals.objects
    steps = []
    # Newest batch on the left, as upstream's deque: (batch number, output,
    # ids of the requests that sample in it).
    batch_queue: deque = deque()
    num_batches = 0
    step = 0
    progress = Progress()
    while True:
        arrivals.admit(step)
        if not arrivals.pending and not sched.has_requests() and not batch_queue:
            break
        if step >= workload.max_steps:
            raise RuntimeError(f"workload {workload.name!r} did not finish in {step} steps")

        record: dict = {}
        deliver = True
        if sched.has_requests():
            out = sched.schedule()
            record.update(describe_scheduler_output(out))
            sampling = [
                r for r in out.num_scheduled_tokens if not sched.requests[r].is_prefill_chunk
            ]
            record["scheduled_placeholders"] = [
                [r, sched.requests[r].num_output_placeholders] for r in out.num_scheduled_tokens
            ]
            batch_queue.appendleft((num_batches, out, sampling))
            num_batches += 1
            # A batch that ran tokens does not wait for the oldest one
            # unless the queue is full.
            deliver = out.total_num_scheduled_tokens == 0 or len(batch_queue) == BATCH_QUEUE_SIZE
        elif not batch_queue:
            deliver = False  # idle: waiting for arrivals
        if deliver:
            batch, out, sampling = batch_queue.pop()
            runner_output = _late_runner_output(backend, sched, out, sampling, specs, eos)
            result = sched.update_from_output(out, runner_output)
            record["delivered"] = batch
            record["outputs"] = _outputs(result)
            stats = _spec_stats(result)
            if stats is not None:
                record["spec_stats"] = stats
            record["free_blocks"] = sched.kv_cache_manager.block_pool.get_num_free_blocks()
            kv = backend.manager_state(sched.kv_cache_manager)
            # Which blocks are in the prefix cache: a delivered token completes
            # a block that only now can be cached.
            record["cached_blocks"] = [kv["cached_blocks"], kv["num_cached_block"]]
            if hybrid:
                record["prefix_cache"] = _prefix_cache_stats(result)
        if hybrid:
            # KV-cache groups: every request's block table in each group.
            record["tables"] = _group_tables(sched)
        if workload.config.get("mm_max_tokens_per_item") is not None:
            # Images (Phase 13): the encoder cache after this step's schedule
            # and whatever output it took.
            record["encoder_cache"] = encoder_cache_state(sched.encoder_cache_manager)
        record["requests"] = [
            [r.request_id, r.num_output_placeholders, r.num_computed_tokens, r.num_tokens]
            + [r.status.name]
            for r in sorted(sched.requests.values(), key=lambda r: r.request_id)
        ]
        steps.append(record)
        progress.after_step(sched, step)
        step += 1

    final = {
        req_id: {
            "status": objects[req_id].status.name,
            "output_token_ids": list(objects[req_id].output_token_ids),
            "num_preemptions": objects[req_id].num_preemptions,
        }
        for req_id in sorted(objects)
    }
    return {"steps": steps, "final": final}


def _late_runner_output(backend, sched, out, sampling, specs, eos):
    """The batch's output, built when it is delivered: one token for each
    request that sampled in it, at the output index it has reached by now
    (an aborted request gets a token too; update_from_output skips it), after
    the drafts it verified that the fake model accepts."""
    req_ids = list(out.num_scheduled_tokens)
    spec_tokens = out.scheduled_spec_decode_tokens
    sampled = []
    for req_id in req_ids:
        if req_id not in sampling:
            sampled.append([])
            continue
        request = sched.requests.get(req_id)
        index = request.num_output_tokens if request is not None else 0
        spec = specs[req_id]
        # The worker's drafts: what the fake model says next (the scheduler
        # saw only placeholders for them).
        drafts = [fake_token(spec, index + i, eos) for i in range(len(spec_tokens.get(req_id, ())))]
        sampled.append(verified_tokens(spec, index, drafts, eos))
    return backend.ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
