"""Lab 11.3 — the adapter LRU and the persistent batch's LoRA mapping.

Graded: the ``LAB 11.3`` regions of ``labs/phase_11/model_manager.py``
(``LRUCacheLoRAModelManager.add_adapter``, ``activate_adapter``,
``deactivate_adapter``: ``max_cpu_loras`` adapters loaded on the host and
``max_loras`` of them in the layers' slots, each set evicting its least
recently used) and of ``labs/phase_11/gpu_input_batch.py``
(``InputBatch._add_lora``, ``_remove_lora``, ``make_lora_inputs``: each row's
adapter id, moving with the row, and the step's adapter id per token).

Marked ``upstream``:

- the manager: generated operations (add, activate, deactivate, remove on
  adapter ids 1-6, 1-3 slots, up to 3 more loaded than slots) through your
  manager and the pinned upstream's ``LRUCacheLoRAModelManager``
  (vllm/lora/model_manager.py:1163, its LRU caches and slot table, built
  without a model); after every operation the return value, the slot table
  and both LRU orders must be upstream's. Then, on a one-layer model, the
  slot an adapter is activated into must hold its matrices and a freed slot
  zeros (mini_vllm's layers clear it: UPSTREAM_PIN.md, Phase 11);
- the batch: generated runner edits (mini_vllm/oracle/batch_workload.py: add,
  remove, condense, swap, with adapters 1-3 or none per request) through your
  ``InputBatch`` and upstream's (vllm/v1/worker/gpu_input_batch.py:976 for
  ``make_lora_inputs``); after every edit each row's adapter id, the
  adapters' request sets and each step's LoRA inputs must be upstream's. And
  ``make_lora_inputs`` by hand with 0, 1 and 2 sampled tokens a row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from phase11_helpers import (
    apply_op,
    batch_side,
    manager_ops,
    manager_state,
    tiny_model,
    upstream_manager,
    written,
    your_manager,
)

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.batch_workload import (
    UpstreamSide,
    batch_workloads,
    first_batch_difference,
    run_batch_workload,
)

pytestmark = pytest.mark.upstream

LOCKSTEP = lab_settings(80)
BATCH_LOCKSTEP = lab_settings(40)


def manager_difference(impl, max_loras: int, max_cpu: int, ops) -> str | None:
    theirs = upstream_manager(max_loras, max_cpu)
    ours = your_manager(impl, max_loras, max_cpu)
    for i, op in enumerate(ops):
        want = apply_op(theirs, op, upstream=True)
        got = written(apply_op, ours, op, upstream=False)
        before = f"operations before it: {ops[:i]}"
        if got != want:
            return (
                f"operation {i}, {op[0]} adapter {op[1]}: upstream returns {want}, yours {got} "
                f"(True: it changed the cache or slots; False: nothing to do).\n{before}"
            )
        e, g = manager_state(theirs, True), manager_state(ours, False)
        for key in e:
            if e[key] != g[key]:
                return (
                    f"operation {i}, {op[0]} adapter {op[1]}: {key} differs: upstream "
                    f"{e[key]}, yours {g[key]}.\n{before}"
                )
    return None


RULES = (
    "The rules: a loaded adapter is touched (to the end, most recent) by add and by an "
    "activate that puts it in a slot; a new one when max_cpu_loras are loaded first removes "
    "the least recently used (from its slot too); activate takes the first free slot after "
    "evicting the least recently used active adapter when all max_loras are taken."
)


@pytest.mark.points(3)
def test_one_slot_evicts_the_least_recently_used(impl):
    ops = [("add", 1), ("add", 2), ("activate", 1), ("activate", 2), ("activate", 1)]
    diff = manager_difference(impl, 1, 2, ops)
    assert diff is None, f"{diff}\nmax_loras=1, max_cpu_loras=2. {RULES}"


@pytest.mark.points(3)
def test_a_full_host_cache_drops_the_oldest_from_its_slot_too(impl):
    ops = [("activate", 1), ("activate", 2), ("add", 1), ("add", 3), ("activate", 3)]
    diff = manager_difference(impl, 2, 2, ops)
    assert diff is None, f"{diff}\nmax_loras=2, max_cpu_loras=2. {RULES}"


@pytest.mark.points(8)
@pytest.mark.timeout(180)
@LOCKSTEP
@given(case=manager_ops())
def test_manager_lockstep_with_upstream(impl, case):
    max_loras, max_cpu, ops = case
    diff = manager_difference(impl, max_loras, max_cpu, ops)
    assert diff is None, f"{diff}\nmax_loras={max_loras}, max_cpu_loras={max_cpu}. {RULES}"


@pytest.mark.points(3)
def test_activate_fills_the_slot_and_deactivate_clears_it(impl):
    from mini_vllm.lora.lora_model import LoRALayerWeights, LoRAModel

    model = tiny_model(d_in=6, d_out=5)
    manager = your_manager(impl, 2, 3, model=model)
    layer = manager.modules["layer.q_proj"]
    g = torch.Generator().manual_seed(0)
    adapters = {}
    for lora_id, rank in ((1, 2), (2, 4), (3, 3)):
        a, b = torch.randn(rank, 6, generator=g), torch.randn(5, rank, generator=g)
        adapters[lora_id] = (a, b)
        weights = {"layer.q_proj": LoRALayerWeights("layer.q_proj", rank, a, b)}
        written(manager.add_adapter, LoRAModel(lora_id, rank, weights))
    for lora_id in (1, 2, 3):  # 3 evicts 1 (two slots)
        written(manager.activate_adapter, lora_id)
    stacked_a, stacked_b = layer.lora_a_stacked[0], layer.lora_b_stacked[0]
    for slot, lora_id in enumerate(manager.lora_index_to_id):
        a, b = adapters[lora_id]
        r = a.shape[0]
        assert torch.equal(stacked_a[slot, 0, :r], a) and torch.equal(
            stacked_b[slot, 0, :, :r], b
        ), (
            f"slot {slot} holds adapter {lora_id} (lora_index_to_id {manager.lora_index_to_id}) "
            "but not its matrices: activate_adapter must set_lora that slot on every module "
            "with the adapter's weights (_get_lora_layer_weights)."
        )
        assert not stacked_a[slot, 0, r:].any() and not stacked_b[slot, 0, :, r:].any(), (
            f"slot {slot}: past adapter {lora_id}'s rank {r} the stacks must stay zero."
        )
    written(manager.deactivate_adapter, manager.lora_index_to_id[0])
    assert not stacked_a[0].any() and not stacked_b[0].any(), (
        "a deactivated adapter's slot must be cleared (reset_lora on every module)."
    )


def batch_difference(impl, workload) -> str | None:
    expected = run_batch_workload(UpstreamSide, workload)
    try:
        got = written(run_batch_workload, batch_side(impl), workload)
    except Exception as e:  # noqa: BLE001 - told with the workload that raised it
        return f"your InputBatch raised {type(e).__name__}: {e}"
    diff = first_batch_difference(expected, got, labels=("upstream", "yours"))
    return None if diff is None else f"they part ways {diff}"


@pytest.mark.points(6)
@pytest.mark.timeout(240)
@BATCH_LOCKSTEP
@given(workload=batch_workloads())
def test_batch_lockstep_with_upstreams_input_batch(impl, workload):
    diff = batch_difference(impl, workload)
    assert diff is None, (
        f"Your InputBatch and upstream's: {diff}\nThe rules: a row's adapter id (0: none) is "
        "set by add_request and moves with the row; lora_id_to_request_ids[id] holds the batch's "
        "requests of that adapter, and an adapter leaves both dicts with its last request; "
        f"make_lora_inputs repeats each row's id over its tokens.\nconfig: {workload.config}\n"
        f"steps: {workload.steps}"
    )


@pytest.mark.points(3)
def test_make_lora_inputs_repeats_each_rows_id(impl):
    config = {"block_size": 4, "max_model_len": 16, "max_num_reqs": 4, "max_num_batched_tokens": 64}
    sides = [UpstreamSide(config), batch_side(impl)(config)]
    params = {"temperature": 0.0, "stop_token_ids": []}
    for side in sides:
        for req_id, lora_id in (("r0", 2), ("r1", None), ("r2", 1), ("r3", 2)):
            state = side.new_state(req_id, [1, 2, 3], {**params, "lora_id": lora_id}, None, [], 0)
            written(side.batch.add_request, state)
    scheduled = np.array([3, 1, 0, 2], dtype=np.int32)
    sampled = np.array([1, 0, 2, 1], dtype=np.int32)
    want, got = (written(side.batch.make_lora_inputs, scheduled, sampled) for side in sides)
    names = ("prompt_lora_mapping (per sampled token)", "token_lora_mapping (per scheduled token)")
    for name, w, g in zip(names, want[:2], got[:2], strict=True):
        assert [int(i) for i in g] == [int(i) for i in w], (
            f"{name}: upstream {list(map(int, w))}, yours {list(map(int, g))}; rows' adapter "
            f"ids {[2, 0, 1, 2]}, scheduled tokens {scheduled.tolist()}, sampled "
            f"{sampled.tolist()}."
        )
    assert sorted(r.lora_name for r in got[2]) == sorted(r.lora_name for r in want[2]), (
        "the third value is the set of the batch's LoRARequests (one per adapter)."
    )
