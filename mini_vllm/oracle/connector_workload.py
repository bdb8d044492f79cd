"""The scheduler lockstep with a KV connector: workloads, driver, trace.

A workload of ``mini_vllm/oracle/workload.py`` plus a connector plan
(``mini_vllm/oracle/fake_connector.py``: per request, the tokens a fake
store holds, sync or async loads, "ask again" answers, load delays, failed
blocks, delayed saves) and a ``kv_load_failure_policy``. Each backend's
scheduler loads the fake connector through ``kv_connector_module_path``
(upstream's on upstream's base class, mini_vllm's on mini_vllm's); the
driver plays the workers: it reads each step's connector metadata and
reports finished loads, finished saves and failed blocks in the
``KVConnectorOutput`` of the step they are due. Every step records what
the plain lockstep records, plus every connector call with its arguments
and what it returned, the workers' report, and each request's status and
computed tokens.
"""

from __future__ import annotations

from mini_vllm.oracle.fake_connector import FakeWorker
from mini_vllm.oracle.workload import (
    FIELD_WORDS,
    Arrivals,
    Progress,
    Workload,
    _outputs,
    describe_scheduler_output,
    fake_token,
)

CONNECTOR_FIELD_WORDS = {
    **FIELD_WORDS,
    "connector": "KV-connector calls (name, arguments, what it returned)",
    "kv_output": "the workers' KV report (finished sending, finished receiving, failed blocks)",
    "states": "each request's status and computed tokens after the step",
}


def connector_module(backend) -> str:
    """Where ``backend``'s scheduler finds the fake connector."""
    if backend.__name__ == "mini_vllm.oracle.upstream":
        return "mini_vllm.oracle.fake_connector_upstream"
    return "mini_vllm.oracle.fake_connector"


def connector_config(backend, workload: Workload) -> dict:
    """create_scheduler's keywords: the workload's config, its connector
    plan turned into a kv_transfer_config for ``backend``."""
    config = dict(workload.config)
    plan = config.pop("kv_connector_plan")
    policy = config.pop("kv_load_failure_policy", "fail")
    config["kv_transfer_config"] = {
        "kv_connector": "FakeKVConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": connector_module(backend),
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "plan": plan,
            "block_size": config.get("block_size", 16),
        },
    }
    return config


def run_connector_workload(backend, workload: Workload, scheduler_cls: type | None = None) -> dict:
    """Run a connector workload to completion and return its trace.
    ``scheduler_cls``: a Scheduler class to build instead of the backend's
    own (a lab's, for the graded lockstep)."""
    config = connector_config(backend, workload)
    if scheduler_cls is not None:
        config["scheduler_cls"] = scheduler_cls
    sched = backend.create_scheduler(**config)
    connector = sched.connector
    eos = backend.EOS_TOKEN_ID
    specs = {s.req_id: s for s in workload.requests}
    arrivals = Arrivals(backend, sched, workload)
    objects = arrivals.objects
    worker = FakeWorker()
    steps = []
    step = 0
    progress = Progress()
    while True:
        arrivals.admit(step)
        if not arrivals.pending and not sched.has_requests() and not worker.pending():
            break
        if step >= workload.max_steps:
            raise RuntimeError(f"workload {workload.name!r} did not finish in {step} steps")
        out = sched.schedule()
        record = describe_scheduler_output(out)
        sending, recving, invalid = worker.step(step, out.kv_connector_metadata)
        kv_output = backend.KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            invalid_block_ids=invalid,
        )
        record["kv_output"] = [sorted(sending), sorted(recving), sorted(invalid)]
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = sched.requests[req_id]
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])
            else:
                sampled.append([fake_token(specs[req_id], request.num_output_tokens, eos)])
        runner_output = backend.ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
        record["outputs"] = _outputs(sched.update_from_output(out, runner_output))
        record["connector"] = connector.take_calls()
        record["states"] = [
            [r, objects[r].status.name, objects[r].num_computed_tokens] for r in sorted(objects)
        ]
        record["free_blocks"] = sched.kv_cache_manager.block_pool.get_num_free_blocks()
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
    return {"steps": steps, "final": final, "leftover_calls": connector.take_calls()}
