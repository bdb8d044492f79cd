"""Record a request lifecycle run: every request's status after every engine step.

mini_vllm-only tooling (no upstream twin), used by Phase 01's graded suites
and notebook. ``lifecycle_workload`` builds four-to-five requests for
SmolLM2 on a KV cache too small for all of them, so that in one run one
request is preempted and resumed, one is aborted by the user, one stops on
a stop token id (FINISHED_STOPPED), one on a stop string (finished by the
front end, so FINISHED_ABORTED in EngineCore) and one at max_tokens
(FINISHED_LENGTH_CAPPED). ``trace_run`` drives an ``LLMEngine`` step by step
and records, per step, what crosses each boundary:

- EngineCore -> scheduler: the SchedulerOutput (tokens scheduled per request,
  preempted ids, finished ids);
- scheduler -> front end: the EngineCoreOutputs (new token ids, finish
  reasons);
- front end -> user: the RequestOutputs (text, finish_reason, stop_reason);
- and the Request objects' statuses and the free KV blocks after the step.

The stop token and the stop string are taken from a short greedy probe run
of the same prompts, so they are reached whatever the weights generate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from mini_vllm.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from mini_vllm.oracle.workload import Progress
from mini_vllm.sampling_params import SamplingParams

PROMPTS = {
    "length": "The capital of France is",
    "stop_token": "Continuous batching lets an inference server",
    "stop_string": "Write a haiku about the sea:",
    "abort": "A list of three prime numbers: 2, 3,",
    "preempted": "Paged attention stores the KV cache in fixed-size blocks so that",
}
MAX_TOKENS = 20
ABORT_AFTER_STEP = 4


def make_engine(
    loaded,
    *,
    num_gpu_blocks: int = 6,
    block_size: int = 16,
    max_model_len: int = 64,
    max_num_batched_tokens: int = 64,
    engine_cls=None,
    device: str | None = None,
):
    """An LLMEngine on already-loaded weights, with a small KV cache."""
    from mini_vllm.engine.llm_engine import LLMEngine

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = VllmConfig(
        model_config=ModelConfig(max_model_len=max_model_len, model="smollm2", dtype="float32"),
        cache_config=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=True,
            num_gpu_blocks_override=num_gpu_blocks,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=True,
        ),
        device_config=DeviceConfig(device=device),
        attention_config=AttentionConfig(backend="torch"),
    )
    return (engine_cls or LLMEngine)(config, loaded)


@dataclass
class Workload:
    prompts: dict[str, str]
    params: dict[str, SamplingParams]
    aborts: dict[int, list[str]] = field(default_factory=dict)  # after step N: abort ids


def lifecycle_workload(loaded) -> Workload:
    """The five requests above; the stop token and stop string come from a
    greedy probe of the reference engine (ample KV cache)."""
    probe = make_engine(loaded, num_gpu_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for rid in ("stop_token", "stop_string"):
        probe.add_request(rid, PROMPTS[rid], greedy)
    done = {}
    while probe.has_unfinished_requests():
        for out in probe.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    # Stop on the 5th sampled token's id; stop on a string that straddles
    # the 4th and 5th tokens' text when it can (the last char of one token
    # and the first of the next), else on the 5th token's text.
    stop_token = done["stop_token"].token_ids[4]
    tok = probe.tokenizer
    ids = done["stop_string"].token_ids
    before, upto = tok.decode(ids[:4]), tok.decode(ids[:5])
    stop_string = upto[len(before) - 1 : len(before) + 1] if len(upto) > len(before) else upto
    if not stop_string.strip():
        stop_string = upto[len(before) :] or upto
    base = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = {
        "length": SamplingParams(**base),
        "stop_token": SamplingParams(**base, stop_token_ids=[stop_token]),
        "stop_string": SamplingParams(**base, stop=[stop_string]),
        "abort": SamplingParams(**base),
        "preempted": SamplingParams(**base),
    }
    return Workload(dict(PROMPTS), params, {ABORT_AFTER_STEP: ["abort"]})


@dataclass
class StepRecord:
    step: int
    statuses: dict[str, str]  # request id -> RequestStatus name
    scheduled: dict[str, int]  # SchedulerOutput.num_scheduled_tokens
    preempted: list[str]
    finished_in_core: list[str]  # SchedulerOutput.finished_req_ids
    new_token_ids: dict[str, list[int]]  # EngineCoreOutput per request
    core_finish: dict[str, str]  # finish reasons EngineCore reported
    text: dict[str, str]  # RequestOutput text so far
    finish_reason: dict[str, str | None]
    stop_reason: dict[str, int | str | None]
    free_blocks: int


def trace_run(engine, workload: Workload, max_steps: int = 500) -> list[StepRecord]:
    """Add every request, then step until done; one StepRecord per step
    (record 0 is the state after add_request, before any step)."""
    core = engine.engine_core
    sched = core.scheduler
    seen: dict = {}
    requests = {}
    for rid, prompt in workload.prompts.items():
        engine.add_request(rid, prompt, workload.params[rid])
        requests[rid] = sched.requests[rid]

    real_schedule, real_core_step = sched.schedule, core.step

    def schedule():
        seen["sched"] = out = real_schedule()
        return out

    def core_step():
        seen["core"] = out = real_core_step()
        return out

    sched.schedule, core.step = schedule, core_step
    pool = sched.kv_cache_manager.block_pool
    records = [
        StepRecord(
            0,
            {r: requests[r].status.name for r in requests},
            {},
            [],
            [],
            {},
            {},
            {},
            {},
            {},
            pool.get_num_free_blocks(),
        )
    ]
    progress = Progress()
    try:
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            if step > max_steps:
                raise RuntimeError(f"the run did not finish in {max_steps} steps")
            seen.clear()
            outputs = engine.step()
            progress.after_step(sched, step)
            so, co = seen.get("sched"), seen.get("core")
            rec = StepRecord(
                step,
                {r: requests[r].status.name for r in requests},
                dict(so.num_scheduled_tokens) if so else {},
                sorted(so.preempted_req_ids or ()) if so else [],
                sorted(so.finished_req_ids) if so else [],
                {o.request_id: list(o.new_token_ids) for o in co.outputs} if co else {},
                {
                    o.request_id: str(o.finish_reason)
                    for o in co.outputs
                    if o.finish_reason is not None
                }
                if co
                else {},
                {o.request_id: o.outputs[0].text for o in outputs},
                {o.request_id: o.outputs[0].finish_reason for o in outputs},
                {o.request_id: o.outputs[0].stop_reason for o in outputs},
                pool.get_num_free_blocks(),
            )
            for rid in workload.aborts.get(step, []):
                engine.abort_request(rid)
                rec.statuses[rid] = requests[rid].status.name
            rec.free_blocks = pool.get_num_free_blocks()
            records.append(rec)
    finally:
        del sched.schedule, core.step
    return records


def final_outputs(records: list[StepRecord]) -> dict[str, dict]:
    """Per request: its last text, finish_reason, stop_reason and final status."""
    out: dict[str, dict] = {}
    for rec in records:
        for rid in rec.text:
            out.setdefault(rid, {})
            out[rid].update(
                text=rec.text[rid],
                finish_reason=rec.finish_reason[rid],
                stop_reason=rec.stop_reason[rid],
            )
        for rid, status in rec.statuses.items():
            out.setdefault(rid, {})["status"] = status
    return out


def student_engine(impl, loaded, monkeypatch, **config):
    """An LLMEngine running every Phase 01 lab region of ``impl`` (see
    ``mini_vllm.grading.impl``): its Request class (built by the input
    processor), its detokenizer (built by the output processor), its
    ``LLMEngine.step`` and its ``EngineCore.step``. ``monkeypatch`` is
    pytest's (anything with ``setattr(obj, name, value)`` that is undone later)."""
    import mini_vllm.engine.input_processor as input_processor
    import mini_vllm.engine.output_processor as output_processor

    monkeypatch.setattr(input_processor, "Request", impl.request.Request)
    monkeypatch.setattr(
        output_processor, "IncrementalDetokenizer", impl.detokenizer.IncrementalDetokenizer
    )
    engine = make_engine(loaded, engine_cls=impl.llm_engine.LLMEngine, **config)
    # LLMEngine.__init__ (no lab) builds the reference EngineCore; the
    # student's class subclasses it and re-opens only step().
    engine.engine_core.__class__ = impl.core.EngineCore
    return engine


FIELDS = (
    "statuses",
    "scheduled",
    "preempted",
    "finished_in_core",
    "new_token_ids",
    "core_finish",
    "text",
    "finish_reason",
    "stop_reason",
    "free_blocks",
)


def first_difference(
    expected: list[StepRecord], got: list[StepRecord], fields=FIELDS
) -> str | None:
    """The first step and field where two traces differ, in words; None if equal."""
    for e, g in zip(expected, got, strict=False):
        for name in fields:
            ev, gv = getattr(e, name), getattr(g, name)
            if ev == gv:
                continue
            where = f"after step {e.step}" if e.step else "after add_request (before step 1)"
            if isinstance(ev, dict) and isinstance(gv, dict):
                k = next(k for k in sorted(set(ev) | set(gv)) if ev.get(k) != gv.get(k))
                return (
                    f"{where}, {name}[{k!r}]: the reference has {ev.get(k, '(absent)')!r}, "
                    f"yours {gv.get(k, '(absent)')!r}"
                )
            return f"{where}, {name}: the reference has {ev!r}, yours {gv!r}"
    if len(expected) != len(got):
        return (
            f"the reference's run took {len(expected) - 1} steps and yours {len(got) - 1} "
            f"(the first {min(len(expected), len(got)) - 1} agree)"
        )
    return None


def status_history(records: list[StepRecord], rid: str) -> list[str]:
    return [rec.statuses[rid] for rec in records]


def as_dicts(records: list[StepRecord]) -> list[dict]:
    return [dataclasses.asdict(r) for r in records]
