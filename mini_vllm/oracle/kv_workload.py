"""KV-cache workloads: a list of manager operations, a driver that records
what every operation did, and trace comparison.

The scheduler traces (``workload.py``) show the KV cache only through the
block ids a scheduler hands out. Phase 02 grades the KV cache itself, so
these workloads call ``KVCacheManager`` directly, the way the scheduler
does, and record after every operation what the manager and its block
pool hold: the returned blocks (or ``None``), the free-block count, the
free queue's order, every block's reference count, which blocks are in
the prefix cache, each request's block table, and the prefix-cache stats.

A *backend* is anything with ``create_kv_cache_manager(**config)``,
``create_requests(...)`` and ``manager_state(manager)``:
``mini_vllm.testing`` and ``mini_vllm.oracle.upstream`` both are.

Operations (JSON lists, so a workload is plain data):

- ``["lookup", r]``: ``get_computed_blocks(r)``; the hit is kept for r's
  next ``allocate``, as the scheduler keeps it;
- ``["allocate", r, n]`` or ``["allocate", r, n, {"lookahead": k,
  "must_fit": true}]``: ``allocate_slots`` for ``n`` new tokens (with r's
  pending hit, if any); on success r's ``num_computed_tokens`` grows by
  the hit tokens and ``n``, as after a scheduled step;
- ``["append", r, k]`` or ``["append", r, [tokens]]``: r samples ``k``
  tokens (or the given ones); its newly full blocks get hashed;
- ``["free", r]``: r finished, ``free(r)``;
- ``["preempt", r]``: ``free(r)``, and r starts over (``num_computed_tokens
  = 0``, one more preemption), as ``Scheduler._preempt_request`` does;
- ``["reset_prefix_cache"]``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

FIRST_FAKE_TOKEN = 1000
FAKE_VOCAB = 30000


@dataclass
class KVWorkload:
    name: str
    # Keyword arguments of create_kv_cache_manager(): block_size, num_blocks,
    # max_model_len, enable_caching, and optionally groups (one entry per
    # KV-cache group: None for full attention, an int for a sliding window).
    config: dict
    # [request id, prompt token ids], created in this order before the ops.
    requests: list
    ops: list

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVWorkload:
        return cls(
            name=d["name"],
            config=dict(d["config"]),
            requests=[[r, list(p)] for r, p in d["requests"]],
            ops=[list(op) for op in d["ops"]],
        )


def sampled_token(req_id: str, index: int) -> int:
    """The token request ``req_id`` samples as its output number ``index``."""
    return FIRST_FAKE_TOKEN + zlib.crc32(f"{req_id}:{index}".encode()) % FAKE_VOCAB


def describe_op(op: list) -> str:
    """An operation in words, as the graders print it."""
    kind = op[0]
    if kind == "lookup":
        return f"get_computed_blocks({op[1]})"
    if kind == "allocate":
        opts = op[3] if len(op) > 3 else {}
        extra = "".join(
            [
                f", num_lookahead_tokens={opts['lookahead']}" if opts.get("lookahead") else "",
                ", full_sequence_must_fit=True" if opts.get("must_fit") else "",
            ]
        )
        return f"allocate_slots({op[1]}, num_new_tokens={op[2]}{extra})"
    if kind == "append":
        what = f"{op[2]} sampled tokens" if isinstance(op[2], int) else f"tokens {op[2]}"
        return f"{op[1]} appends {what}"
    if kind == "free":
        return f"free({op[1]}) (finished)"
    if kind == "preempt":
        return f"free({op[1]}) (preempted: it starts over)"
    if kind == "reset_prefix_cache":
        return "reset_prefix_cache()"
    raise ValueError(f"unknown operation {op!r}")


def walk_free_queue(queue, limit: int) -> list[int] | str:
    """Block ids from the front of the free queue to its back, by following
    ``next_free_block`` from the fake head; then the same walk backwards.
    A broken list (a cycle, a dead end, links that disagree) is described
    in words instead, so a trace never hangs on it."""

    def walk(start, attr, end) -> list[int] | str:
        ids, curr = [], getattr(start, attr)
        while curr is not end:
            if curr is None:
                return f"the links end (None) after {ids} before reaching the other sentinel"
            if len(ids) > limit:
                return f"more than {limit} blocks: the links form a cycle ({ids[:12]}...)"
            ids.append(curr.block_id)
            curr = getattr(curr, attr)
        return ids

    forward = walk(queue.fake_free_list_head, "next_free_block", queue.fake_free_list_tail)
    if isinstance(forward, str):
        return "forward walk: " + forward
    backward = walk(queue.fake_free_list_tail, "prev_free_block", queue.fake_free_list_head)
    if isinstance(backward, str):
        return "backward walk: " + backward
    if backward[::-1] != forward:
        return f"next links give {forward} but prev links give {backward[::-1]}"
    return forward


def pool_state(pool, tables: dict, num_cached_block: dict, stats) -> dict:
    """What the trace records after each operation (see the module docstring)."""
    return {
        "free_blocks": pool.get_num_free_blocks(),
        "free_queue": walk_free_queue(pool.free_block_queue, len(pool.blocks) + 1),
        "ref_cnts": [b.ref_cnt for b in pool.blocks],
        "cached_blocks": [b.block_id for b in pool.blocks if b.block_hash is not None],
        "tables": {r: _ids(blocks) for r, blocks in sorted(tables.items()) if blocks},
        "num_cached_block": dict(sorted(num_cached_block.items())),
        "stats": [
            stats.requests,
            stats.queries,
            stats.hits,
            stats.preempted_requests,
            stats.preempted_queries,
            stats.preempted_hits,
        ],
    }


def groups_state(managers) -> tuple[dict, dict]:
    """Block tables and cached-block counts of several KV-cache groups, as
    one dict each: request -> one entry per group (tables: the group's
    blocks, or [] when it holds none; counts: None when not running)."""
    req_ids = sorted({r for m in managers for r, blocks in m.req_to_blocks.items() if blocks})
    tables = {r: [list(m.req_to_blocks.get(r) or []) for m in managers] for r in req_ids}
    counted = sorted({r for m in managers for r in m.num_cached_block})
    counts = {r: [m.num_cached_block.get(r) for m in managers] for r in counted}
    return tables, counts


def _ids(blocks) -> list:
    """Block ids of one table, or of one table per group."""
    if isinstance(blocks, list) and blocks and isinstance(blocks[0], list):
        return [[b.block_id for b in group] for group in blocks]
    return [b.block_id for b in blocks]


def _group_ids(kv_blocks) -> list:
    """Block ids of a ``KVCacheBlocks``: group 0's list when there is one
    group (the shape Phase 02's traces have), else one list per group."""
    ids = kv_blocks.get_block_ids()
    return list(ids[0]) if len(ids) == 1 else [list(g) for g in ids]


class KVDriver:
    """Applies operations one at a time to a manager and records each; the
    engine of ``run_kv_workload``, and of the workload generator, which
    needs to see every operation's outcome before it draws the next."""

    def __init__(
        self,
        backend,
        config: dict,
        requests: list,
        manager=None,
        make_request: Callable | None = None,
    ) -> None:
        self.backend = backend
        self.manager = manager or backend.create_kv_cache_manager(**config)
        block_size = config["block_size"]
        if make_request is None:

            def make_request(req_id, prompt):
                (request,) = backend.create_requests(
                    1, req_ids=[req_id], prompt_token_ids=[prompt], block_size=block_size
                )
                return request

        self.requests = {r: make_request(r, list(p)) for r, p in requests}
        # request id -> (hit blocks, hit tokens) of its last lookup, kept for
        # its next allocate.
        self.pending: dict[str, tuple] = {}

    def apply(self, op: list) -> dict:
        mgr, kind, args = self.manager, op[0], op[1:]
        result = None
        if kind == "lookup":
            blocks, num_tokens = mgr.get_computed_blocks(self.requests[args[0]])
            self.pending[args[0]] = (blocks, num_tokens)
            result = [_group_ids(blocks), num_tokens]
        elif kind == "allocate":
            request = self.requests[args[0]]
            opts = args[2] if len(args) > 2 else {}
            blocks, hit_tokens = self.pending.pop(args[0], (None, 0))
            new = mgr.allocate_slots(
                request,
                args[1],
                num_new_computed_tokens=hit_tokens,
                new_computed_blocks=blocks,
                num_lookahead_tokens=opts.get("lookahead", 0),
                full_sequence_must_fit=opts.get("must_fit", False),
            )
            if new is not None:
                request.num_computed_tokens += hit_tokens + args[1]
                result = _group_ids(new)
        elif kind == "append":
            request = self.requests[args[0]]
            tokens = (
                args[1]
                if isinstance(args[1], list)
                else [sampled_token(args[0], request.num_output_tokens + i) for i in range(args[1])]
            )
            for token in tokens:
                request.append_output_token_ids(token)
        elif kind in ("free", "preempt"):
            request = self.requests[args[0]]
            mgr.free(request)
            self.pending.pop(args[0], None)
            if kind == "preempt":
                request.num_computed_tokens = 0
                request.num_preemptions += 1
        elif kind == "reset_prefix_cache":
            result = mgr.reset_prefix_cache()
        else:
            raise ValueError(f"unknown operation {op!r}")
        return {"op": op, "result": result, **self.backend.manager_state(mgr)}

    def final(self) -> dict:
        return {
            r: {
                "num_tokens": req.num_tokens,
                "num_computed_tokens": req.num_computed_tokens,
                "block_hashes": [bytes(h).hex() for h in req.block_hashes],
            }
            for r, req in sorted(self.requests.items())
        }


def run_kv_workload(
    backend, workload: KVWorkload, manager=None, make_request: Callable | None = None
) -> dict:
    """Run the operations and return the trace: one record per operation,
    then each request's final token count, computed tokens and block hashes.

    ``manager`` (built by ``backend.create_kv_cache_manager``) and
    ``make_request(req_id, prompt)`` may be given, to run a student's classes.
    """
    driver = KVDriver(backend, workload.config, workload.requests, manager, make_request)
    records = [driver.apply(op) for op in workload.ops]
    return {"ops": records, "final": driver.final()}


FIELD_WORDS = {
    "result": "what the call returned",
    "free_blocks": "number of free blocks (get_num_free_blocks)",
    "free_queue": "free queue, front (evicted first) to back, by block id",
    "ref_cnts": "reference counts, indexed by block id",
    "cached_blocks": "ids of the blocks in the prefix cache (block_hash set)",
    "tables": "block tables (request -> block ids)",
    "num_cached_block": "num_cached_block (request -> leading blocks already cached)",
    "stats": "prefix-cache stats [requests, queries, hits, preempted requests, "
    "preempted queries, preempted hits]",
}


def first_kv_difference(
    expected: dict,
    got: dict,
    labels=("upstream", "mini_vllm"),
    fields: tuple[str, ...] | None = None,
) -> str | None:
    """None if the traces agree, else the first operation and field that
    differ, in words (``expected`` is the upstream or reference side)."""
    a, b = labels
    width = max(len(a), len(b))
    keys = fields or tuple(FIELD_WORDS)
    prev = None
    for i, (e, g) in enumerate(zip(expected["ops"], got["ops"], strict=False)):
        for key in keys:
            if e.get(key) != g.get(key):
                before = (
                    ""
                    if prev is None
                    else (
                        f"\n  before it (both agreed): free queue {prev['free_queue']}, "
                        f"tables {prev['tables']}, cached blocks {prev['cached_blocks']}"
                    )
                )
                return (
                    f"operation {i}, {describe_op(e['op'])}: {FIELD_WORDS[key]} differ.\n"
                    f"  {a:<{width}}: {e.get(key)}\n  {b:<{width}}: {g.get(key)}{before}"
                )
        prev = e
    if len(expected["ops"]) != len(got["ops"]):
        return f"{a} recorded {len(expected['ops'])} operations but {b} {len(got['ops'])}."
    for req_id, e in expected["final"].items():
        g = got["final"].get(req_id)
        if e != g:
            for key, words in [
                ("num_tokens", "token count"),
                ("num_computed_tokens", "computed tokens"),
                ("block_hashes", "block hashes (hex)"),
            ]:
                if g is None or e[key] != g.get(key):
                    return (
                        f"at the end, request {req_id!r}: {words} differ.\n"
                        f"  {a:<{width}}: {e[key]}\n  {b:<{width}}: "
                        f"{None if g is None else g.get(key)}"
                    )
    return None
