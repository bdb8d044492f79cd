"""Persistent-batch workloads: the edits a model runner makes to an ``InputBatch``.

Runs the same generated workload on mini_vllm's ``InputBatch`` and on the
pinned upstream's (built on a CPU), recording after every operation what a
runner can observe: the order of rows, each request's row and its token
ids, counts, block ids and sampling parameters, the sampling metadata after
``refresh_metadata``, and the slot mapping of a batch of tokens. Used by
tests/upstream/test_input_batch_lockstep.py and Lab 05.1's grader
(phases/05-model-runner-persistent-batch/labs/lab-01-persistent-batch/).

A workload is a list of steps; each step makes its edits in the order
upstream's ``GPUModelRunner._update_states`` (vllm/v1/worker/gpu_model_runner.py:1116)
does: removals (finished requests, whose state is dropped, and preempted
ones, whose state the runner keeps), additions (new requests, and preempted
ones coming back with new blocks), updates of the requests that stayed
(computed-token count, new blocks), ``condense``, swaps (a reordering),
``refresh_metadata``; then the tokens sampled this step are appended the way
``_bookkeeping_sync`` (vllm/v1/worker/gpu_model_runner.py:3512) does, and the
slot mapping of a batch is computed. Rows for swaps and for the slot-mapping
batch are drawn as free integers and resolved against the batch when the step
runs, so the generator only tracks which requests exist and their sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from mini_vllm.kv_cache_interface import cdiv

VOCAB_SIZE = 64
# Where upstream's side lives: its Triton kernel runs compiled on CUDA, and
# under the interpreter (TRITON_INTERPRET=1) on CPU tensors otherwise.
UPSTREAM_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class BatchWorkload:
    config: dict
    steps: list[dict]


# ------------------------------------------------------------------ strategies


def _params():
    return st.fixed_dictionaries(
        {
            "temperature": st.sampled_from([0.0, 0.005, 0.7, 1.0]),
            "top_p": st.sampled_from([1.0, 1.0, 0.5]),
            "top_k": st.sampled_from([0, 0, -1, 3, VOCAB_SIZE, VOCAB_SIZE + 10]),
            "seed": st.sampled_from([None, None, 7, 11]),
            "logprobs": st.sampled_from([None, None, 0, 3, -1]),
            "min_tokens": st.sampled_from([0, 0, 1, 3]),
            "stop_token_ids": st.sampled_from([[], [5], [9, 5]]),
            # Not a sampling parameter: the request's LoRA adapter (None: none).
            "lora_id": st.sampled_from([None, None, 1, 2, 3]),
        }
    )


@st.composite
def batch_workloads(draw, max_steps: int = 8) -> BatchWorkload:
    bs = draw(st.sampled_from([1, 2, 4, 16]), label="block size")
    mml = draw(st.sampled_from([16, 40]), label="max_model_len")
    config = {
        "block_size": bs,
        "max_model_len": mml,
        "max_num_reqs": draw(st.integers(1, 6), label="max_num_reqs"),
        "max_num_batched_tokens": 64,
    }
    max_blocks = cdiv(mml, bs)
    in_batch: dict[str, list[int]] = {}  # id -> [num_tokens, num_blocks]
    paused: dict[str, list[int]] = {}  # preempted, state kept by the runner
    next_id = 0
    steps = []
    for _ in range(draw(st.integers(1, max_steps), label="steps")):
        step: dict = {"remove": [], "add": [], "resume": [], "update": [], "append": []}
        for req_id in list(in_batch):
            how = draw(st.sampled_from(["stay", "stay", "stay", "finish", "preempt"]))
            if how != "stay":
                step["remove"].append((req_id, how))
                sizes = in_batch.pop(req_id)
                if how == "preempt":
                    paused[req_id] = sizes
        room = config["max_num_reqs"] - len(in_batch)
        for req_id in list(paused):
            if room and draw(st.booleans()):
                num_tokens = paused.pop(req_id)[0]
                n_blocks = draw(st.integers(0, cdiv(num_tokens, bs)))
                blocks = draw(st.lists(st.integers(1, 999), min_size=n_blocks, max_size=n_blocks))
                computed = draw(st.integers(0, num_tokens))
                step["resume"].append((req_id, blocks, computed))
                in_batch[req_id] = [num_tokens, n_blocks]
                room -= 1
        for _ in range(draw(st.integers(0, room))):
            req_id = f"r{next_id}"
            next_id += 1
            prompt = draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=mml - 2))
            n_blocks = draw(st.integers(0, cdiv(len(prompt), bs)))
            blocks = draw(st.lists(st.integers(1, 999), min_size=n_blocks, max_size=n_blocks))
            computed = draw(st.integers(0, len(prompt)))
            step["add"].append((req_id, prompt, draw(_params()), blocks, computed))
            in_batch[req_id] = [len(prompt), n_blocks]
        added = {a[0] for a in step["add"]} | {r[0] for r in step["resume"]}
        for req_id, sizes in in_batch.items():
            if req_id in added or not draw(st.booleans()):
                continue
            more = draw(st.integers(0, min(2, max_blocks - sizes[1])))
            blocks = draw(st.lists(st.integers(1, 999), min_size=more, max_size=more))
            sizes[1] += more
            step["update"].append((req_id, draw(st.integers(0, sizes[0])), blocks))
        step["swaps"] = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=3))
        for req_id, sizes in in_batch.items():
            k = draw(st.integers(0, min(3, mml - sizes[0])))
            if k:
                tokens = draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=k, max_size=k))
                step["append"].append((req_id, tokens))
                sizes[0] += k
        # Per row: (query length, first position), resolved against the row's blocks.
        step["slots"] = draw(
            st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=6)
        )
        steps.append(step)
    return BatchWorkload(config, steps)


# ------------------------------------------------------------------ the two sides


def _copy(params: dict) -> dict:
    """A side's own copy of the sampling parameters (SamplingParams may keep,
    and edit, the list it is given); the LoRA id is not one of them."""
    params = {k: v for k, v in params.items() if k != "lora_id"}
    return {**params, "stop_token_ids": list(params["stop_token_ids"])}


class MiniSide:
    """mini_vllm's InputBatch (or ``input_batch_cls``, a subclass such as a
    student's) and the runner's request states."""

    def __init__(self, config: dict, input_batch_cls=None) -> None:
        from mini_vllm.sampling_params import SamplingParams
        from mini_vllm.worker.gpu_input_batch import CachedRequestState, InputBatch

        self._params, self._state = SamplingParams, CachedRequestState
        self.batch = (input_batch_cls or InputBatch)(
            max_num_reqs=config["max_num_reqs"],
            max_model_len=config["max_model_len"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            device=torch.device("cpu"),
            pin_memory=False,
            vocab_size=VOCAB_SIZE,
            block_sizes=[config["block_size"]],
        )

    def new_state(self, req_id, prompt, params, generator, blocks, computed):
        from mini_vllm.testing import lora_request_for

        state = self._state(
            req_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=self._params(**_copy(params)),
            generator=generator,
            block_ids=(list(blocks),),
            num_computed_tokens=computed,
        )
        if params.get("lora_id") is not None:
            state.lora_request = lora_request_for(params["lora_id"])
        return state

    @staticmethod
    def set_blocks(state, blocks) -> None:
        state.block_ids = (list(blocks),)

    @staticmethod
    def extend_blocks(state, blocks) -> None:
        state.block_ids[0].extend(blocks)

    def slot_mapping(self, num_reqs, query_start_loc, positions) -> list[int]:
        self.batch.block_table.commit_block_table(num_reqs)
        self.batch.block_table.compute_slot_mapping(num_reqs, query_start_loc, positions)
        return self.batch.block_table[0].slot_mapping.gpu.tolist()

    def min_tokens(self) -> dict:
        return self.batch.min_tokens


class UpstreamSide:
    """The pinned upstream's InputBatch (with its min_tokens logits processor),
    and its Triton slot-mapping kernel run under the interpreter on CPU."""

    _kernel_module = None

    def __init__(self, config: dict) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
        from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

        from mini_vllm.oracle.upstream import lora_request_for

        self._params, self._state, self._lora = SamplingParams, CachedRequestState, lora_request_for
        # Its constructor reads no config; the device and pinning are what it uses.
        self._min_tokens = MinTokensLogitsProcessor(None, UPSTREAM_DEVICE, False)
        self.batch = InputBatch(
            max_num_reqs=config["max_num_reqs"],
            max_model_len=config["max_model_len"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            device=UPSTREAM_DEVICE,
            pin_memory=False,
            vocab_size=VOCAB_SIZE,
            block_sizes=[config["block_size"]],
            kernel_block_sizes=[config["block_size"]],
            logitsprocs=LogitsProcessors([self._min_tokens]),
        )

    def new_state(self, req_id, prompt, params, generator, blocks, computed):
        return self._state(
            req_id=req_id,
            prompt_token_ids=list(prompt),
            mm_features=[],
            sampling_params=self._params(**_copy(params)),
            generator=generator,
            block_ids=(list(blocks),),
            num_computed_tokens=computed,
            output_token_ids=[],
            lora_request=self._lora(params.get("lora_id")),
        )

    @staticmethod
    def set_blocks(state, blocks) -> None:
        state.block_ids = (list(blocks),)

    @staticmethod
    def extend_blocks(state, blocks) -> None:
        state.block_ids[0].extend(blocks)

    def slot_mapping(self, num_reqs, query_start_loc, positions) -> list[int]:
        kernel = upstream_block_table_module()
        table = self.batch.block_table[0]
        self.batch.block_table.commit_block_table(num_reqs)
        # The reloaded module's method runs the real kernel on this table.
        kernel.BlockTable.compute_slot_mapping(
            table, num_reqs, query_start_loc.to(UPSTREAM_DEVICE), positions.to(UPSTREAM_DEVICE)
        )
        return table.slot_mapping.gpu.tolist()

    def min_tokens(self) -> dict:
        return self._min_tokens.min_toks


def upstream_block_table_module():
    """vllm.v1.worker.block_table reloaded with the real Triton, so that its
    kernel runs (under TRITON_INTERPRET=1 on a CPU). vLLM put placeholders in
    vllm.triton_utils when it found no GPU driver."""
    if UpstreamSide._kernel_module is None:
        import importlib

        import triton
        import triton.language as tl
        import vllm.triton_utils as tu

        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Set TRITON_INTERPRET=1 before importing triton on a CPU.")
        saved = tu.triton, tu.tl
        tu.triton, tu.tl = triton, tl
        try:
            module = importlib.reload(importlib.import_module("vllm.v1.worker.block_table"))
        finally:
            tu.triton, tu.tl = saved
        UpstreamSide._kernel_module = module
    return UpstreamSide._kernel_module


# ------------------------------------------------------------------ running


def _observe(batch) -> dict:
    """What a runner can read from the batch, holes skipped."""
    table = batch.block_table[0]
    rows = {}
    for i, req_id in enumerate(batch.req_ids):
        if req_id is None:
            continue
        n = int(batch.num_tokens_no_spec[i])
        nb = int(table.num_blocks_per_row[i])
        gen = batch.generators.get(i)
        rows[i] = {
            "req_id": req_id,
            "num_prompt_tokens": int(batch.num_prompt_tokens[i]),
            "num_tokens_no_spec": n,
            "num_computed_tokens": int(batch.num_computed_tokens_cpu[i]),
            "token_ids": batch.token_ids_cpu[i, :n].tolist(),
            "output_token_ids": list(batch.req_output_token_ids[i]),
            "block_ids": table.block_table.np[i, :nb].tolist(),
            "temperature": float(batch.temperature_cpu[i]),
            "top_p": float(batch.top_p_cpu[i]),
            "top_k": int(batch.top_k_cpu[i]),
            "generator seed": None if gen is None else gen.initial_seed(),
            "lora id": int(batch.request_lora_mapping[i]),
        }
    return {
        "req_ids": list(batch.req_ids),
        "req_id_to_index": dict(sorted(batch.req_id_to_index.items())),
        "num_reqs": batch.num_reqs,
        "greedy_reqs": sorted(batch.greedy_reqs),
        "random_reqs": sorted(batch.random_reqs),
        "top_p_reqs": sorted(batch.top_p_reqs),
        "top_k_reqs": sorted(batch.top_k_reqs),
        "num_logprobs": dict(sorted(batch.num_logprobs.items())),
        "lora requests": {
            i: [sorted(batch.lora_id_to_request_ids[i]), r.lora_name]
            for i, r in sorted(batch.lora_id_to_lora_request.items())
        },
        "rows": rows,
    }


def _observe_metadata(side) -> dict:
    """The sampling metadata after refresh_metadata (upstream leaves the
    temperature out when every row is greedy, so it is compared otherwise)."""
    batch, meta = side.batch, side.batch.sampling_metadata
    n = batch.num_reqs
    gens = meta.generators
    gens = dict(gens.items()) if isinstance(gens, dict) else dict(enumerate(gens))
    return {
        "all_greedy": meta.all_greedy,
        "temperature": None if meta.all_greedy else meta.temperature[:n].tolist(),
        "top_p": None if meta.top_p is None else meta.top_p.tolist(),
        "top_k": None if meta.top_k is None else meta.top_k.tolist(),
        "max_num_logprobs": meta.max_num_logprobs,
        "generator seeds": {i: g.initial_seed() for i, g in sorted(gens.items()) if g is not None},
        "min_tokens rows": {
            i: (m, sorted(stop)) for i, (m, _, stop) in sorted(side.min_tokens().items())
        },
    }


def _generator(params: dict) -> torch.Generator | None:
    """As upstream's runner: only a random request with a seed gets its own."""
    if params["seed"] is None or params["temperature"] < 1e-5:
        return None
    return torch.Generator().manual_seed(params["seed"])


def run_batch_workload(side_cls, workload: BatchWorkload) -> list[tuple[str, dict]]:
    """Run ``workload`` on a fresh side; return (operation, observation) pairs."""
    side = side_cls(workload.config)
    batch = side.batch
    bs = workload.config["block_size"]
    states: dict = {}
    trace: list[tuple[str, dict]] = []

    def record(op: str, extra: dict | None = None) -> None:
        trace.append((op, {**_observe(batch), **(extra or {})}))

    for s, step in enumerate(workload.steps):
        for req_id, how in step["remove"]:
            batch.remove_request(req_id)
            if how == "finish":
                del states[req_id]
            record(f"step {s}: remove_request({req_id!r}) ({how})")
        for req_id, prompt, params, blocks, computed in step["add"]:
            state = side.new_state(req_id, prompt, params, _generator(params), blocks, computed)
            states[req_id] = state
            batch.add_request(state)
            record(f"step {s}: add_request({req_id!r}, prompt {prompt}, {params})")
        for req_id, blocks, computed in step["resume"]:
            state = states[req_id]
            side.set_blocks(state, blocks)
            state.num_computed_tokens = computed
            batch.add_request(state)
            record(f"step {s}: add_request({req_id!r}) resumed, blocks {blocks}")
        for req_id, computed, blocks in step["update"]:
            state, index = states[req_id], batch.req_id_to_index[req_id]
            state.num_computed_tokens = computed
            batch.num_computed_tokens_cpu[index] = computed
            if blocks:
                side.extend_blocks(state, blocks)
                batch.block_table.append_row((blocks,), index)
            record(f"step {s}: update {req_id!r}: computed {computed}, new blocks {blocks}")
        batch.condense()
        record(f"step {s}: condense()")
        for a, b in step["swaps"]:
            n = batch.num_reqs
            if n >= 2 and a % n != b % n:
                batch.swap_states(a % n, b % n)
                record(f"step {s}: swap_states({a % n}, {b % n})")
        batch.refresh_metadata()
        record(f"step {s}: refresh_metadata()", {"metadata": _observe_metadata(side)})
        for req_id, tokens in step["append"]:
            index = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens_no_spec[index])
            batch.token_ids_cpu[index, start : start + len(tokens)] = tokens
            batch.num_tokens_no_spec[index] = start + len(tokens)
            states[req_id].output_token_ids.extend(tokens)
            record(f"step {s}: sample {req_id!r}: {tokens}")
        num_reqs = batch.num_reqs
        qsl, positions = [0], []
        for i in range(num_reqs):
            q_draw, p_draw = step["slots"][i] if i < len(step["slots"]) else (0, 0)
            room = int(batch.block_table[0].num_blocks_per_row[i]) * bs
            q = q_draw % (min(room, 4) + 1)
            first = p_draw % (room - q + 1)
            positions.extend(range(first, first + q))
            qsl.append(len(positions))
        slots = side.slot_mapping(
            num_reqs,
            torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(positions, dtype=torch.int64),
        )
        record(f"step {s}: compute_slot_mapping(positions {positions})", {"slot_mapping": slots})
        sampled = np.ones(num_reqs, dtype=np.int32)
        prompt_map, token_map, active = batch.make_lora_inputs(np.diff(qsl), sampled)
        lora_inputs = [list(prompt_map), list(token_map), sorted(r.lora_name for r in active)]
        record(f"step {s}: make_lora_inputs({np.diff(qsl).tolist()})", {"lora": lora_inputs})
    return trace


def first_batch_difference(
    expected: list[tuple[str, dict]], got: list[tuple[str, dict]], labels=("upstream", "mini_vllm")
) -> str | None:
    """None if the traces agree, else the first operation and field that differ."""
    a, b = labels
    for (op, e), (_, g) in zip(expected, got, strict=True):
        for key in e:
            if key == "rows" and e[key] != g.get(key):
                for row in sorted(set(e[key]) | set(g.get(key, {}))):
                    er, gr = e[key].get(row, {}), g[key].get(row, {})
                    for field in er or gr:
                        if er.get(field) != gr.get(field):
                            return (
                                f"after {op}: row {row} ({er.get('req_id') or gr.get('req_id')})"
                                f", field {field!r} differs.\n  {a}: {er.get(field)}\n"
                                f"  {b}: {gr.get(field)}"
                            )
            elif isinstance(e[key], dict) and e[key] != g.get(key):
                for field in e[key]:
                    if e[key][field] != g[key].get(field):
                        return (
                            f"after {op}: {key} field {field!r} differs.\n"
                            f"  {a}: {e[key][field]}\n  {b}: {g[key].get(field)}"
                        )
            elif e[key] != g.get(key):
                return f"after {op}: {key!r} differs.\n  {a}: {e[key]}\n  {b}: {g.get(key)}"
    return None
