"""Workloads, a scheduler driver that records traces, and trace comparison.

A *backend* is anything with ``create_scheduler(**config)``,
``create_requests(...)``, ``ModelRunnerOutput`` and ``RequestStatus`` —
``mini_vllm.testing`` and ``mini_vllm.oracle.upstream`` both are. The
driver runs the loop upstream's EngineCore runs (``schedule()`` -> model ->
``update_from_output()``) with a fake model whose next token depends only on
(request id, output index), so two schedulers that agree see identical
tokens, and a trace records every step as JSON-ready data. With
``num_speculative_tokens`` in the config the driver also plays the drafter
and the rejection sampler: after each step it proposes fake drafts (lengths
from ``RequestSpec.draft_lens``), and the fake model accepts a number of the
scheduled drafts given by ``RequestSpec.accepted``. A request with
``RequestSpec.grammar_ready_step`` carries a structured-output constraint;
the driver holds its grammar's future and completes it at that step (with
``AcceptingGrammar``), so when it may run is decided, not raced. ``Progress``
fails a run in which no request advances for ``NO_PROGRESS_STEPS`` steps in
a row (it could never end), with the scheduler's state.
"""

from __future__ import annotations

import zlib
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field

# Tokens the fake model emits are >= FIRST_FAKE_TOKEN, so they never collide
# with stop tokens chosen below it or with the EOS id.
FIRST_FAKE_TOKEN = 1000
FAKE_VOCAB = 30000
# A scheduler is deterministic: with no request arriving, a step that changes
# nothing is followed by the same step forever. The reference never has one.
NO_PROGRESS_STEPS = 50


@dataclass
class RequestSpec:
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    arrive_step: int = 0
    priority: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    # Output index at which the fake model emits EOS / the first stop token.
    eos_at: int | None = None
    stop_at: int | None = None
    # Step (before schedule()) at which the request is aborted.
    abort_step: int | None = None
    # Speculation only (the config's num_speculative_tokens): after a step in
    # which the request has n output tokens, it is given draft_lens[n % len]
    # drafts (capped at num_speculative_tokens; none if the list is empty);
    # when n output tokens precede a verification, accepted[n % len] of the
    # scheduled drafts are accepted (0 if the list is empty).
    draft_lens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    # Structured outputs only: the request carries a constraint and its
    # grammar "finishes compiling" at this step (before schedule()); it waits
    # in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR until then.
    grammar_ready_step: int | None = None
    # LoRA only (the config's max_loras): the id of the adapter the request
    # runs with (None: the base model).
    lora_id: int | None = None
    # Multimodal only (the config's mm_max_tokens_per_item): the request's
    # images, in prompt order, as [offset, length, identifier, is_embed]
    # (is_embed None or a list of bools); same identifier, same image.
    mm_items: list | None = None


# Left out of a saved workload when empty, so earlier snapshots keep their bytes.
_SPEC_FIELDS = ("draft_lens", "accepted")
_OPTIONAL_FIELDS = ("grammar_ready_step", "lora_id", "mm_items")

# The constraint a structured request of a workload carries (the driver
# stands in for its compiled grammar: AcceptingGrammar).
WORKLOAD_CONSTRAINT = {"regex": "[0-9]+"}


class AcceptingGrammar:
    """A compiled grammar's stand-in for the scheduler locksteps: accepts
    every token and every draft, never terminates (the fake model's tokens
    follow no grammar). The scheduler only feeds it; the bitmask is compared
    on its own, in tests/upstream/test_structured_output_lockstep.py."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        self.accepted.extend(tokens)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return list(tokens)

    def is_terminated(self) -> bool:
        return False


@dataclass
class Workload:
    name: str
    # Keyword arguments of create_scheduler().
    config: dict
    requests: list[RequestSpec]
    max_steps: int = 20000

    def to_dict(self) -> dict:
        d = asdict(self)
        for r in d["requests"]:
            for key in _SPEC_FIELDS:
                if not r[key]:
                    del r[key]
            for key in _OPTIONAL_FIELDS:
                if r[key] is None:
                    del r[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        return cls(
            name=d["name"],
            config=dict(d["config"]),
            requests=[RequestSpec(**r) for r in d["requests"]],
            max_steps=d.get("max_steps", 20000),
        )


class Stalled(RuntimeError):
    """No request advanced for ``NO_PROGRESS_STEPS`` steps in a row."""


class Progress:
    """Call ``after_step(sched, step)`` after every engine step; it raises
    ``Stalled`` once no request has advanced (computed tokens, tokens,
    status, or which requests the scheduler holds) for ``limit`` steps."""

    def __init__(self, limit: int = NO_PROGRESS_STEPS):
        self.limit = limit
        self.last: tuple = ()
        self.still = 0

    def after_step(self, sched, step: int) -> None:
        reqs = sorted(sched.requests.values(), key=lambda r: r.request_id)
        key = tuple((r.request_id, r.status, r.num_computed_tokens, r.num_tokens) for r in reqs)
        self.still = self.still + 1 if key and key == self.last else 0
        self.last = key
        if self.still < self.limit:
            return
        state = ", ".join(
            f"{r.request_id} {r.status.name} ({r.num_computed_tokens}/{r.num_tokens} tokens "
            "computed)"
            for r in reqs
        )
        raise Stalled(
            f"no request advanced for {self.limit} steps (up to step {step}): {state}; waiting "
            f"{[r.request_id for r in sched.waiting]}, running "
            f"{[r.request_id for r in sched.running]}, "
            f"{sched.kv_cache_manager.block_pool.get_num_free_blocks()} free KV blocks. "
            "Each step must schedule some request, or finish or preempt one."
        )


def fake_token(spec: RequestSpec, index: int, eos_token_id: int) -> int:
    """The fake model's output number ``index`` for this request."""
    if spec.eos_at is not None and index == spec.eos_at:
        return eos_token_id
    if spec.stop_at is not None and index == spec.stop_at and spec.stop_token_ids:
        return spec.stop_token_ids[0]
    return FIRST_FAKE_TOKEN + zlib.crc32(f"{spec.req_id}:{index}".encode()) % FAKE_VOCAB


def draft_tokens(
    spec: RequestSpec, num_output_tokens: int, num_spec_tokens: int, eos: int
) -> list[int]:
    """The fake drafter's guess after a step that left ``num_output_tokens``
    outputs: the fake model's own next tokens (so an accepted draft is what
    the model would have said, EOS and stop tokens included)."""
    if not spec.draft_lens:
        return []
    n = min(spec.draft_lens[num_output_tokens % len(spec.draft_lens)], num_spec_tokens)
    return [fake_token(spec, num_output_tokens + i, eos) for i in range(n)]


def verified_tokens(spec: RequestSpec, num_output_tokens: int, drafts: list[int], eos: int):
    """What the fake model returns for a request whose ``drafts`` were
    verified: the accepted prefix, then the bonus token (all accepted) or a
    recovered token that differs from the first rejected draft."""
    a = spec.accepted[num_output_tokens % len(spec.accepted)] if spec.accepted else 0
    a = min(a, len(drafts))
    token = fake_token(spec, num_output_tokens + a, eos)
    if a < len(drafts) and token == drafts[a]:
        token = FIRST_FAKE_TOKEN + (token + 1 - FIRST_FAKE_TOKEN) % FAKE_VOCAB
    return list(drafts[:a]) + [token]


def _finish_reason(reason) -> str | None:
    return None if reason is None else reason.name.lower()


def _group0(block_ids) -> list | None:
    """Block ids of the one KV-cache group, one list per group when there are
    several (hybrid configs), or None if there are none."""
    if block_ids is None:
        return None
    if len(block_ids) == 1:
        return list(block_ids[0])
    return [list(ids) for ids in block_ids]


def _outputs(result) -> list:
    """EngineCoreOutputs (mini) or {client: EngineCoreOutputs} (upstream) -> list."""
    if isinstance(result, dict):
        outs = [o for eco in result.values() for o in eco.outputs]
    else:
        outs = list(result.outputs)
    return [
        [o.request_id, list(o.new_token_ids), _finish_reason(o.finish_reason), o.stop_reason]
        for o in outs
    ]


def make_request(backend, spec: RequestSpec, arrival_time: float, block_size: int):
    """The backend's Request for ``spec`` (mini_vllm.testing or the upstream adapter)."""
    (request,) = backend.create_requests(
        1,
        max_tokens=spec.max_tokens,
        stop_token_ids=list(spec.stop_token_ids) or None,
        block_size=block_size,
        req_ids=[spec.req_id],
        prompt_token_ids=[spec.prompt_token_ids],
        priorities=[spec.priority],
        arrival_times=[arrival_time],
        min_tokens=spec.min_tokens,
        ignore_eos=spec.ignore_eos,
        structured_outputs=None if spec.grammar_ready_step is None else WORKLOAD_CONSTRAINT,
        **({} if spec.lora_id is None else {"lora_ids": [spec.lora_id]}),
        **({} if spec.mm_items is None else {"mm_items": [spec.mm_items]}),
    )
    return request


class Arrivals:
    """A workload's requests as they arrive: ``admit(step)`` adds the ones
    due by ``step`` and aborts the ones whose abort step it is. A request's
    arrival time is its position in the workload's list (PRIORITY's
    tie-break); ``objects`` maps each admitted id to the backend's Request."""

    def __init__(self, backend, sched, workload: Workload) -> None:
        self.backend, self.sched, self.workload = backend, sched, workload
        self.block_size = workload.config.get("block_size", 16)
        # (position, spec) by arrive_step; the stable sort keeps list order on ties.
        self.pending = deque(sorted(enumerate(workload.requests), key=lambda p: p[1].arrive_step))
        self.objects: dict = {}
        # Structured requests: req_id -> (ready step, the grammar's future),
        # as EngineCore.add_request's grammar_init leaves it.
        self.compiling: dict = {}

    def admit(self, step: int) -> None:
        while self.pending and self.pending[0][1].arrive_step <= step:
            position, spec = self.pending.popleft()
            request = make_request(self.backend, spec, float(position), self.block_size)
            if spec.grammar_ready_step is not None:
                future: Future = Future()
                request.structured_output_request.grammar = future
                self.compiling[spec.req_id] = (spec.grammar_ready_step, future)
            self.sched.add_request(request)
            self.objects[spec.req_id] = request
        for req_id, (ready_step, future) in list(self.compiling.items()):
            if ready_step <= step:
                future.set_result(AcceptingGrammar())
                del self.compiling[req_id]
        aborts = sorted(s.req_id for s in self.workload.requests if s.abort_step == step)
        if aborts:
            self.sched.finish_requests(aborts, self.backend.RequestStatus.FINISHED_ABORTED)


def run_workload(backend, workload: Workload, scheduler=None) -> dict:
    """Run a workload to completion and return its trace.

    ``scheduler`` may be given (built by ``backend.create_scheduler``) to
    run a specific instance, for example a student's.
    """
    sched = scheduler or backend.create_scheduler(**workload.config)
    num_spec_tokens = workload.config.get("num_speculative_tokens")
    eos = backend.EOS_TOKEN_ID
    specs = {s.req_id: s for s in workload.requests}
    structured = any(s.grammar_ready_step is not None for s in workload.requests)
    arrivals = Arrivals(backend, sched, workload)
    objects = arrivals.objects
    steps = []
    step = 0
    progress = Progress()
    while True:
        arrivals.admit(step)
        if not arrivals.pending and not sched.has_requests():
            break
        if step >= workload.max_steps:
            raise RuntimeError(f"workload {workload.name!r} did not finish in {step} steps")

        out = sched.schedule()
        record = describe_scheduler_output(out)
        if structured:
            record["structured"] = [
                bool(out.has_structured_output_requests),
                [r.request_id for r in sched.skipped_waiting],
            ]
        runner_output = _fake_runner_output(backend, sched, out, specs, eos)
        result = sched.update_from_output(out, runner_output)
        record["outputs"] = _outputs(result)
        stats = _spec_stats(result)
        if stats is not None:
            record["spec_stats"] = stats
        if workload.config.get("mm_max_tokens_per_item") is not None:
            record["encoder_cache"] = encoder_cache_state(sched.encoder_cache_manager)
        if workload.config.get("kv_groups") is not None:
            record["prefix_cache"] = _prefix_cache_stats(result)
            record["tables"] = _group_tables(sched)
        if num_spec_tokens is not None:
            # After update_from_output, as upstream's EngineCore.step
            # (vllm/v1/engine/core.py:463-467). Harsher than a real proposer,
            # to test the scheduler's side: requests still mid-prefill get
            # drafts too (the scheduler must drop them), and a request with
            # no draft is left out (its old drafts must not come back).
            drafted = {
                r: draft_tokens(specs[r], len(objects[r].output_token_ids), num_spec_tokens, eos)
                for r in runner_output.req_ids
            }
            drafted = {r: d for r, d in drafted.items() if d}
            sched.update_draft_token_ids(
                backend.DraftTokenIds(list(drafted), list(drafted.values()))
            )
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
    return {"steps": steps, "final": final}


def _fake_runner_output(backend, sched, out, specs, eos):
    req_ids = list(out.num_scheduled_tokens)
    spec_tokens = getattr(out, "scheduled_spec_decode_tokens", None) or {}
    sampled = []
    for req_id in req_ids:
        request = sched.requests[req_id]
        if request.num_computed_tokens < request.num_tokens:
            sampled.append([])
        elif req_id in spec_tokens:
            sampled.append(
                verified_tokens(specs[req_id], request.num_output_tokens, spec_tokens[req_id], eos)
            )
        else:
            sampled.append([fake_token(specs[req_id], request.num_output_tokens, eos)])
    return backend.ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _spec_stats(result) -> list | None:
    """The step's SpecDecodingStats as [drafts, draft tokens, accepted, per
    position], or None. Upstream puts the stats on one client's outputs."""
    ecos = list(result.values()) if isinstance(result, dict) else [result]
    for eco in ecos:
        stats = eco.scheduler_stats and eco.scheduler_stats.spec_decoding_stats
        if stats:
            return [
                stats.num_drafts,
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
                list(stats.num_accepted_tokens_per_pos),
            ]
    return None


def encoder_cache_state(manager) -> list:
    """An EncoderCacheManager's bookkeeping: [free slots, freeable slots,
    [[identifier, sorted ids of the requests referencing it], ...] sorted,
    the unreferenced identifiers oldest first]."""
    return [
        manager.num_free_slots,
        manager.num_freeable_slots,
        sorted([h, sorted(ids)] for h, ids in manager.cached.items()),
        list(manager.freeable),
    ]


def _group_tables(sched) -> list:
    """Every request holding blocks, with its block table in each KV-cache
    group: [[id, [group 0's block ids, group 1's, ...]], ...] (the
    coordinator's single-type managers, upstream's and mini_vllm's alike;
    kv_workload.groups_state)."""
    from mini_vllm.oracle.kv_workload import groups_state

    tables, _ = groups_state(sched.kv_cache_manager.coordinator.single_type_managers)
    return [[r, [[b.block_id for b in t] for t in ts]] for r, ts in tables.items()]


def _prefix_cache_stats(result) -> list | None:
    """The step's PrefixCacheStats as [requests, queries, hits, preempted
    requests, preempted queries, preempted hits], or None."""
    ecos = list(result.values()) if isinstance(result, dict) else [result]
    for eco in ecos:
        if eco.scheduler_stats is not None:
            s = eco.scheduler_stats.prefix_cache_stats
            return [
                s.requests,
                s.queries,
                s.hits,
                s.preempted_requests,
                s.preempted_queries,
                s.preempted_hits,
            ]
    return None


def describe_scheduler_output(out) -> dict:
    """The parts of a SchedulerOutput that mini_vllm must reproduce exactly
    (``spec_tokens`` only in a step that schedules drafts)."""
    cached = out.scheduled_cached_reqs
    record = {
        "scheduled": [[r, n] for r, n in out.num_scheduled_tokens.items()],
        "new": [
            [d.req_id, _group0(d.block_ids), d.num_computed_tokens] for d in out.scheduled_new_reqs
        ],
        "cached": [
            [r, _group0(b), c, o]
            for r, b, c, o in zip(
                cached.req_ids,
                cached.new_block_ids,
                cached.num_computed_tokens,
                cached.num_output_tokens,
                strict=True,
            )
        ],
        "resumed": sorted(cached.resumed_req_ids),
        "resent_all_tokens": sorted(cached.all_token_ids),
        "preempted": sorted(out.preempted_req_ids or ()),
        "finished": sorted(out.finished_req_ids),
        "common_prefix_blocks": list(out.num_common_prefix_blocks),
    }
    loras = [
        [d.req_id, d.lora_request.lora_name]
        for d in out.scheduled_new_reqs
        if getattr(d, "lora_request", None) is not None
    ]
    if loras:
        record["new_loras"] = loras
    encoder_inputs = getattr(out, "scheduled_encoder_inputs", None)
    if encoder_inputs:
        record["encoder_inputs"] = [[r, list(ids)] for r, ids in encoder_inputs.items()]
    freed = getattr(out, "free_encoder_mm_hashes", None)
    if freed:
        record["freed_mm_hashes"] = list(freed)
    spec_tokens = getattr(out, "scheduled_spec_decode_tokens", None)
    if spec_tokens:
        record["spec_tokens"] = [[r, list(t)] for r, t in spec_tokens.items()]
    return record


FIELD_WORDS = {
    "scheduled": "tokens scheduled per request (in scheduling order)",
    "new": "new requests (id, block ids (per KV-cache group if several), computed tokens)",
    "cached": "cached requests (id, new block ids (per KV-cache group if several), computed "
    "tokens, output tokens)",
    "resumed": "resumed request ids",
    "resent_all_tokens": "requests whose whole token list was resent",
    "preempted": "preempted request ids",
    "finished": "finished request ids reported to the workers",
    "common_prefix_blocks": "number of common prefix blocks",
    "new_loras": "the adapters new requests carry to the runner (id, LoRA name)",
    "spec_tokens": "drafts scheduled for verification (id, draft tokens)",
    "encoder_inputs": "images sent to the encoder (id, indices of its mm_features)",
    "freed_mm_hashes": "encoder outputs evicted from the encoder cache (identifiers)",
    "outputs": "update_from_output results (id, new tokens, finish reason, stop reason)",
    "free_blocks": "free KV blocks after the step",
    "tables": "block tables per KV-cache group (id, each group's block ids; 0 where a window "
    "slid past)",
    "prefix_cache": "prefix-cache stats of the step (requests, queries, hits, and the same for "
    "preempted requests)",
    "encoder_cache": "encoder cache after the step (free slots, freeable slots, [identifier, "
    "requests referencing it], unreferenced identifiers oldest first)",
    "spec_stats": "spec-decode stats (drafts, draft tokens, accepted, accepted per position)",
    "structured": "structured outputs (a structured request samples this step; the requests "
    "skipped while their grammar compiles, in queue order)",
}


def first_difference(
    expected: dict, got: dict, labels=("upstream", "mini_vllm"), field_words=None
) -> str | None:
    """None if the traces agree, else a sentence naming the first step and
    field that differ (``expected`` is the upstream side; ``labels`` name
    the two sides; ``field_words`` the fields compared, FIELD_WORDS unless
    given)."""
    field_words = FIELD_WORDS if field_words is None else field_words
    a, b = labels
    width = max(len(a), len(b))
    for i, (e, g) in enumerate(zip(expected["steps"], got["steps"], strict=False)):
        for key in field_words:
            if e.get(key) != g.get(key):
                return (
                    f"step {i}: {field_words[key]} differ.\n"
                    f"  {a:<{width}}: {e.get(key)}\n  {b:<{width}}: {g.get(key)}"
                )
    ne, ng = len(expected["steps"]), len(got["steps"])
    if ne != ng:
        return f"{a} took {ne} steps but {b} took {ng}."
    for req_id, e in expected["final"].items():
        g = got["final"].get(req_id)
        if e != g:
            return f"final state of request {req_id!r} differs: {a} {e}, {b} {g}."
    if set(expected["final"]) != set(got["final"]):
        return "the two runs saw different request ids."
    return None


def lockstep_difference(expected: dict, got: dict, labels=("upstream", "yours")) -> str | None:
    """None if two scheduler traces agree, else the first step and field that
    differ and, for a per-request field, the first request whose entry differs."""
    diff = first_difference(expected, got, labels=labels)
    if diff is None:
        return None
    for i, (e, g) in enumerate(zip(expected["steps"], got["steps"], strict=False)):
        for key in FIELD_WORDS:
            if e.get(key) == g.get(key):
                continue
            per_e = _by_request(e.get(key))
            per_g = _by_request(g.get(key))
            if per_e is None or per_g is None:
                return diff
            for req_id in list(per_e) + [r for r in per_g if r not in per_e]:
                if per_e.get(req_id) != per_g.get(req_id):
                    return (
                        f"step {i}, request {req_id!r}, field {key!r} "
                        f"({FIELD_WORDS[key]}): {labels[0]} {per_e.get(req_id, '(absent)')}, "
                        f"{labels[1]} {per_g.get(req_id, '(absent)')}.\n{diff}"
                    )
            return diff
    return diff


def _by_request(entries) -> dict | None:
    """{request id: the rest of its entry} for a field listed per request
    ([[id, ...], ...]); None for any other field."""
    if entries is None:
        return {}
    if not isinstance(entries, list) or not all(
        isinstance(x, list) and x and isinstance(x[0], str) for x in entries
    ):
        return None
    return {x[0]: x[1:] for x in entries}
