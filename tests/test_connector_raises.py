"""A KV connector that raises in a worker-side call fails or recomputes its request alone.

Upstream's engine dies when a connector's worker-side call raises. mini_vllm's
runner logs it once a step and goes on. A load (``start_load_kv``, or
``wait_for_layer_load`` inside the forward): it reports the blocks the step's
new requests start from as failed loads (``invalid_block_ids``), and the
scheduler's invalid-block path (vllm/v1/core/sched/scheduler.py:2268) does
the rest, by ``kv_load_failure_policy``: "recompute" gives the tokens of an
engine without a connector, "fail" ends that request with finish_reason
"error" while a request in the same batch finishes. A save (``save_kv_layer``,
``wait_for_save``): the save is lost, the requests' tokens are unchanged, and a
finished request whose blocks ``request_finished`` held for that save is
reported in ``finished_sending`` so they are freed. ``get_finished``: nothing
finishes that step; the finished ids it was given are passed again next step,
and a request waiting for a read (ZmqConnector's decode side) is promoted when
a later call reports it; if the calls keep raising, the scheduler gives the
transfers it awaits up after ``Scheduler.MAX_GET_FINISHED_FAILURES`` steps (a
load as a failed load, a held send as sent). Either way the engine serves the next request and no
block stays allocated. The connectors are ExampleConnector (storage) and ZmqConnector subclasses
loaded through ``kv_connector_module_path``.
"""

from __future__ import annotations

import socket
import threading

import pytest

from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from mini_vllm.distributed.kv_transfer.kv_connector.v1.zmq_connector import ZmqConnector
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams

# The module fixtures (tiny model, reference tokens): keep the module on one xdist worker.
pytestmark = pytest.mark.xdist_group("connector-raises")

BLOCK_SIZE = 8
PROMPT = [(5 * j + 3) % 509 + 3 for j in range(37)]
OTHER = [(7 * j + 1) % 499 + 3 for j in range(21)]
N = 6


def _loads(connector: ExampleConnector) -> bool:
    metadata = connector._get_connector_metadata()
    assert isinstance(metadata, ExampleConnectorMetadata)
    return any(not r.is_store for r in metadata.requests)


class RaisingConnector(ExampleConnector):
    """ExampleConnector whose start_load_kv raises when it has something to load."""

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if _loads(self):
            raise OSError("the storage went away")
        super().start_load_kv(forward_context, **kwargs)


class LayerLoadRaisingConnector(ExampleConnector):
    """ExampleConnector whose wait_for_layer_load raises, in the forward, when
    it has something to load (start_load_kv loaded it)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        if _loads(self):
            raise OSError("the storage went away")


class AsyncSaveConnector(ExampleConnector):
    """ExampleConnector that says its saves are asynchronous: request_finished
    holds every finished request's blocks until get_finished reports it sent,
    which it does for the finished ids it is given."""

    def request_finished(self, request, block_ids):
        return True, None

    def get_finished(self, finished_req_ids):
        return set(finished_req_ids), None


class DeadAsyncSaveConnector(AsyncSaveConnector):
    """Its saves are asynchronous (request_finished holds the blocks) and its
    get_finished raises on every call: no send is ever reported."""

    def get_finished(self, finished_req_ids):
        raise ConnectionError("the connector's worker is gone")


class SaveRaisingConnector(ExampleConnector):
    """ExampleConnector whose save_kv_layer raises (each layer, each step)."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        raise OSError("the storage is full")


class HeldSaveRaisingConnector(SaveRaisingConnector):
    """Its saves raise and are asynchronous: request_finished holds the
    blocks, and get_finished never reports a send (none will complete)."""

    def request_finished(self, request, block_ids):
        return True, None


class HeldWaitForSaveRaisingConnector(HeldSaveRaisingConnector):
    """Its saves are written, but wait_for_save raises (each step)."""

    save_kv_layer = ExampleConnector.save_kv_layer

    def wait_for_save(self) -> None:
        raise OSError("the storage is full")


class FinishedRaisingConnector(AsyncSaveConnector):
    """Its get_finished raises the first time it is given finished ids."""

    raised = False

    def get_finished(self, finished_req_ids):
        if finished_req_ids and not self.raised:
            self.raised = True
            raise ConnectionError("the peer did not answer")
        return super().get_finished(finished_req_ids)


class RecvRaisingZmqConnector(ZmqConnector):
    """ZmqConnector whose get_finished raises on its first three calls (before
    it looks at its reads, so nothing is lost)."""

    calls = 0

    def get_finished(self, finished_req_ids):
        self.calls += 1
        if self.calls <= 3:
            raise ConnectionError("the peer did not answer")
        return super().get_finished(finished_req_ids)


class DeadGetFinishedZmqConnector(ZmqConnector):
    """ZmqConnector whose get_finished raises on every call: the reads it
    makes are never reported."""

    def get_finished(self, finished_req_ids):
        raise ConnectionError("the connector's worker is gone")


class LateGetFinishedZmqConnector(ZmqConnector):
    """ZmqConnector whose get_finished raises MAX_GET_FINISHED_FAILURES
    times, then waits for its read and reports it: one step after the
    scheduler gave the load up."""

    calls = 0
    reported: set[str] = set()

    def get_finished(self, finished_req_ids):
        self.calls += 1
        if self.calls <= Scheduler.MAX_GET_FINISHED_FAILURES:
            raise ConnectionError("the peer did not answer")
        if self.calls == Scheduler.MAX_GET_FINISHED_FAILURES + 1:
            # The read is done by now (or soon): wait for it, then let the
            # real get_finished take it from the queue and report it.
            item = self.connector_worker._done_recving.get(timeout=10.0)
            self.connector_worker._done_recving.put(item)
        sending, recving = super().get_finished(finished_req_ids)
        self.reported = self.reported | recving
        return sending, recving


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_llama_raises"), arch="llama"))


def make_llm(path: str, storage: str | None, name: str = "ExampleConnector", policy="fail"):
    kv_transfer_config = None
    if storage is not None:
        kv_transfer_config = {
            "kv_connector": name,
            "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"shared_storage_path": storage},
        }
        if name != "ExampleConnector":
            kv_transfer_config["kv_connector_module_path"] = __name__
    return LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        attention_backend="torch",
        kv_transfer_config=kv_transfer_config,
    )


PARAMS = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def fresh(tiny_llama):
    llm = make_llm(tiny_llama, None)
    outs = llm.generate([{"prompt_token_ids": p} for p in (PROMPT, OTHER)], PARAMS)
    return [tokens(o) for o in outs]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("name", ["RaisingConnector", "LayerLoadRaisingConnector"])
def test_a_raising_load_fails_or_recomputes_its_request_alone(
    tiny_llama, fresh, tmp_path, policy, name
):
    """start_load_kv or wait_for_layer_load raising: the request that loads is
    recomputed or fails alone; the other one finishes; no block leaks."""
    storage = str(tmp_path / "kv")
    make_llm(tiny_llama, storage).generate([{"prompt_token_ids": PROMPT}], PARAMS)  # stores it

    llm = make_llm(tiny_llama, storage, name, policy)
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    total = pool.get_num_free_blocks()
    loaded, other = llm.generate([{"prompt_token_ids": p} for p in (PROMPT, OTHER)], PARAMS)
    assert tokens(other) == fresh[1] and other.outputs[0].finish_reason == "length"
    if policy == "recompute":
        assert tokens(loaded) == fresh[0]
    else:
        assert loaded.outputs[0].finish_reason == "error" and not tokens(loaded)
    assert pool.get_num_free_blocks() == total
    # The engine goes on serving.
    (again,) = llm.generate([{"prompt_token_ids": OTHER}], PARAMS)
    assert tokens(again) == fresh[1]


def drain(llm, max_steps: int = 4) -> None:
    """Step the engine while finished requests still hold blocks (generate
    returns when the last output is out, before a send is reported)."""
    core = llm.llm_engine.engine_core
    for _ in range(max_steps):
        if not core.scheduler.has_finished_requests():
            return
        core.step()


@pytest.mark.parametrize(
    "name",
    [
        "SaveRaisingConnector",
        "HeldSaveRaisingConnector",
        "HeldWaitForSaveRaisingConnector",
        "FinishedRaisingConnector",
    ],
)
def test_a_raising_save_or_get_finished_loses_nothing_but_the_save(
    tiny_llama, fresh, tmp_path, caplog, name
):
    """save_kv_layer / wait_for_save raising: the requests go on with their
    tokens, the error is logged once a step, and the blocks request_finished
    held for a send that will never end are freed. get_finished raising: the
    finished ids it was given are passed again next step, so their sends are
    reported and their blocks freed."""
    llm = make_llm(tiny_llama, str(tmp_path / "kv"), name)
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    total = pool.get_num_free_blocks()
    with caplog.at_level("ERROR", logger="mini_vllm.worker.gpu_model_runner"):
        outs = llm.generate([{"prompt_token_ids": p} for p in (PROMPT, OTHER)], PARAMS)
        drain(llm)
    assert [tokens(o) for o in outs] == fresh
    raised = [r for r in caplog.records if "KV connector" in r.getMessage()]
    steps = llm.llm_engine.engine_core.num_steps
    assert 1 <= len(raised) <= steps
    assert pool.get_num_free_blocks() == total
    # The engine goes on serving.
    (again,) = llm.generate([{"prompt_token_ids": OTHER}], PARAMS)
    drain(llm)
    assert tokens(again) == fresh[1]
    assert pool.get_num_free_blocks() == total


def test_a_get_finished_that_always_raises_frees_the_blocks_held_for_sends(
    tiny_llama, fresh, tmp_path
):
    """Finished requests whose blocks request_finished holds for a send that
    get_finished never reports: after MAX_GET_FINISHED_FAILURES steps the
    scheduler gives the sends up and frees the blocks; the tokens are one
    engine's and the engine serves on."""
    llm = make_llm(tiny_llama, str(tmp_path / "kv"), "DeadAsyncSaveConnector")
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    total = pool.get_num_free_blocks()
    outs = llm.generate([{"prompt_token_ids": p} for p in (PROMPT, OTHER)], PARAMS)
    assert [tokens(o) for o in outs] == fresh
    drain(llm, max_steps=100)
    assert pool.get_num_free_blocks() == total, "blocks held for a send never reported"
    (again,) = llm.generate([{"prompt_token_ids": OTHER}], PARAMS)
    drain(llm, max_steps=100)
    assert tokens(again) == fresh[1]
    assert pool.get_num_free_blocks() == total


def zmq_llm(path: str, name: str, policy: str = "fail") -> LLM:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    extra = {"side_channel_host": "127.0.0.1", "side_channel_port": port}
    kv_transfer_config = {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": extra,
    }
    if name != "ZmqConnector":
        kv_transfer_config["kv_connector_module_path"] = __name__
    return LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        attention_backend="torch",
        kv_transfer_config=kv_transfer_config,
    )


def test_a_raising_get_finished_leaves_a_receiving_request_waiting_for_the_next_step(
    tiny_llama, fresh
):
    """The decode side of a ZmqConnector pair: its get_finished raises three
    times while the request is in WAITING_FOR_REMOTE_KVS; the request is
    promoted once a later call reports the read, with one engine's tokens,
    and no block leaks on either side."""
    p_llm = zmq_llm(tiny_llama, "ZmqConnector")
    d_llm = zmq_llm(tiny_llama, "RecvRaisingZmqConnector")
    d_pool = d_llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    d_total = d_pool.get_num_free_blocks()
    first = SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
    )
    (out,) = p_llm.generate([{"prompt_token_ids": PROMPT}], first)
    p_core = p_llm.llm_engine.engine_core

    def pump() -> None:  # the prefill engine steps until the read frees its blocks
        while p_core.scheduler.has_requests():
            p_core.step()

    pump_thread = threading.Thread(target=pump, daemon=True)
    pump_thread.start()
    decode = SamplingParams(
        max_tokens=N,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"kv_transfer_params": out.kv_transfer_params},
    )
    (dec,) = d_llm.generate([{"prompt_token_ids": PROMPT}], decode)
    pump_thread.join(10.0)
    assert not pump_thread.is_alive(), "the prefill engine still holds blocks"
    assert tokens(dec) == fresh[0]
    assert d_llm.llm_engine.engine_core.model_runner.kv_connector.calls > 3
    assert d_llm.llm_engine.get_stats()["num_scheduled_tokens"] == N  # it did read
    assert d_pool.get_num_free_blocks() == d_total


def run_bounded(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]], max_steps=100):
    """Add the requests and step the engine until they end or max_steps
    steps have run; the finished outputs by request id."""
    engine = llm.llm_engine
    for req_id, (prompt, params) in requests.items():
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return finished


def prefill_remotely(path: str) -> tuple[SamplingParams, threading.Thread]:
    """Prefill PROMPT on a ZmqConnector prefill engine; the decode side's
    SamplingParams, and the thread that steps the prefill engine until a
    read frees its blocks."""
    p_llm = zmq_llm(path, "ZmqConnector")
    first = SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
    )
    (out,) = p_llm.generate([{"prompt_token_ids": PROMPT}], first)
    p_core = p_llm.llm_engine.engine_core

    def pump() -> None:
        while p_core.scheduler.has_requests():
            p_core.step()

    pump_thread = threading.Thread(target=pump, daemon=True)
    pump_thread.start()
    decode = SamplingParams(
        max_tokens=N,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"kv_transfer_params": out.kv_transfer_params},
    )
    return decode, pump_thread


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("name", ["DeadGetFinishedZmqConnector", "LateGetFinishedZmqConnector"])
def test_a_get_finished_that_keeps_raising_ends_the_waiting_load(
    tiny_llama, fresh, caplog, policy, name
):
    """The decode side of a ZmqConnector pair whose get_finished raises on
    every step (or recovers one step too late, and reports the read then):
    the request waiting for its read is given up after
    MAX_GET_FINISHED_FAILURES steps, as a failed load. "recompute": it runs
    again from its prompt, with one engine's tokens; "fail": it ends with
    "error" alone. A late report is dropped. The other request finishes, no
    block leaks, and the engine serves on."""
    d_llm = zmq_llm(tiny_llama, name, policy)
    d_pool = d_llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    d_total = d_pool.get_num_free_blocks()
    decode, pump_thread = prefill_remotely(tiny_llama)
    with caplog.at_level("ERROR", logger="mini_vllm.core.sched.scheduler"):
        outs = run_bounded(d_llm, {"remote": (PROMPT, decode), "local": (OTHER, PARAMS)})
    assert set(outs) == {"remote", "local"}, (
        f"after 100 steps, {sorted({'remote', 'local'} - set(outs))} still unfinished: "
        "a load whose get_finished keeps raising must end"
    )
    assert tokens(outs["local"]) == fresh[1]
    assert outs["local"].outputs[0].finish_reason == "length"
    if policy == "recompute":
        assert tokens(outs["remote"]) == fresh[0]
        assert outs["remote"].outputs[0].finish_reason == "length"
    else:
        assert outs["remote"].outputs[0].finish_reason == "error"
        assert not tokens(outs["remote"])
    assert any("remote" in r.getMessage() for r in caplog.records)
    assert d_pool.get_num_free_blocks() == d_total
    pump_thread.join(10.0)
    assert not pump_thread.is_alive(), "the prefill engine still holds blocks"
    # The engine goes on serving.
    again = run_bounded(d_llm, {"again": (OTHER, PARAMS)})
    assert tokens(again["again"]) == fresh[1]
    assert d_pool.get_num_free_blocks() == d_total
    if name == "LateGetFinishedZmqConnector":
        connector = d_llm.llm_engine.engine_core.model_runner.kv_connector
        assert connector.reported == {"remote"}, "the late report never came"
