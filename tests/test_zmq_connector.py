"""The network connector (ZmqConnector, Phase 15) between two engines, in one process.

Upstream's disaggregated flow (vllm/distributed/kv_transfer/kv_connector/v1/nixl/):
a prefill engine runs the prompt with ``do_remote_decode`` and ``max_tokens=1``,
keeps its blocks and returns where to read them; a decode engine given those
``kv_transfer_params`` reads the blocks over a socket while the request waits
in WAITING_FOR_REMOTE_KVS, then computes only the last prompt token and the
rest. Here on a tiny seeded Llama, two engines in one process talking over
localhost TCP (the process-level pair and proxy: tests/test_disagg.py):
- the decode engine's greedy tokens equal one engine's, and it schedules only
  1 + (max_tokens - 1) tokens: the prompt's KV came over the wire;
- the prefill engine frees the blocks once they are read, or after
  ``kv_lease_duration`` when no reader comes;
- a read from a peer that is not there fails that request alone, by
  ``kv_load_failure_policy`` (recomputed: same tokens; fail: finish_reason
  error while another request finishes), and no block leaks.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams

# The module fixtures (tiny model, reference tokens): keep the module on one xdist worker.
pytestmark = pytest.mark.xdist_group("zmq-connector")

BLOCK_SIZE = 8
PROMPT = [(5 * j + 3) % 509 + 3 for j in range(37)]  # 5 blocks, the last partial
N = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_llama_zmq"), arch="llama"))


def make_llm(path: str, connector: bool = True, **extra) -> LLM:
    kv_transfer_config = None
    if connector:
        policy = extra.pop("kv_load_failure_policy", "fail")
        kv_transfer_config = {
            "kv_connector": "ZmqConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {
                "side_channel_host": "127.0.0.1",
                "side_channel_port": free_port(),
                **extra,
            },
        }
    return LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        attention_backend="torch",
        kv_transfer_config=kv_transfer_config,
    )


def params(max_tokens: int, kv_transfer_params: dict | None = None) -> SamplingParams:
    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def free_blocks(llm: LLM) -> int:
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def prefill(llm: LLM, prompt=PROMPT):
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params(1, {"do_remote_decode": True}))
    return out


class Pump:
    """Steps an engine on a thread while it holds finished requests, as a
    server's busy loop does (the prefill side registers a held request for
    its readers on the step after it finished)."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.llm_engine.engine_core
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while self.core.scheduler.has_requests():
            self.core.step()

    def join(self, timeout: float = 10.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the prefill engine still holds blocks"


@pytest.fixture(scope="module")
def single(tiny_llama):
    llm = make_llm(tiny_llama, connector=False)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params(N))
    return list(out.outputs[0].token_ids)


def test_decode_engine_reads_the_prefill_and_matches_one_engine(tiny_llama, single):
    p_llm, d_llm = make_llm(tiny_llama), make_llm(tiny_llama)
    p_total, d_total = free_blocks(p_llm), free_blocks(d_llm)
    out = prefill(p_llm)
    xfer = out.kv_transfer_params
    p_config = p_llm.llm_engine.vllm_config.kv_transfer_config
    assert xfer["do_remote_prefill"] is True and xfer["do_remote_decode"] is False
    assert xfer["remote_engine_id"] == p_config.engine_id
    assert xfer["remote_request_id"] == out.request_id
    assert xfer["remote_port"] == p_config.kv_connector_extra_config["side_channel_port"]
    assert xfer["remote_num_tokens"] == len(PROMPT)
    assert len(xfer["remote_block_ids"]) == -(-len(PROMPT) // BLOCK_SIZE)
    # The prefill engine holds those blocks for the reader.
    assert p_total - free_blocks(p_llm) == len(xfer["remote_block_ids"])

    pump = Pump(p_llm)
    (dec,) = d_llm.generate([{"prompt_token_ids": PROMPT}], params(N, xfer))
    pump.join()
    assert list(dec.outputs[0].token_ids) == single
    # Only the last prompt token and the N - 1 decodes ran on the decode side.
    assert d_llm.llm_engine.get_stats()["num_scheduled_tokens"] == N
    assert free_blocks(p_llm) == p_total
    assert free_blocks(d_llm) == d_total


def test_prefill_engine_frees_held_blocks_when_no_reader_comes(tiny_llama):
    p_llm = make_llm(tiny_llama, kv_lease_duration=0.5)
    total = free_blocks(p_llm)
    prefill(p_llm)
    assert free_blocks(p_llm) < total
    start = time.monotonic()
    Pump(p_llm).join(timeout=10)
    assert time.monotonic() - start >= 0.4  # held for the lease, then freed
    assert free_blocks(p_llm) == total


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_dead_prefill_peer_fails_only_its_request(tiny_llama, single, policy):
    d_llm = make_llm(tiny_llama, kv_read_timeout=0.3, kv_load_failure_policy=policy)
    total = free_blocks(d_llm)
    # Parameters as a prefill engine returns them, pointing at a port where
    # nobody listens any more.
    dead = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2, 3, 4, 5],
        "remote_engine_id": "gone",
        "remote_request_id": "r0",
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
    }
    other = [7 + j for j in range(20)]
    lost, ok = d_llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": other}],
        [params(N, dead), params(N)],
    )
    assert len(ok.outputs[0].token_ids) == N and ok.outputs[0].finish_reason == "length"
    if policy == "recompute":
        assert list(lost.outputs[0].token_ids) == single
    else:
        assert lost.outputs[0].finish_reason == "error" and not lost.outputs[0].token_ids
    assert free_blocks(d_llm) == total
    # The engine goes on serving.
    (again,) = d_llm.generate([{"prompt_token_ids": PROMPT}], params(N))
    assert list(again.outputs[0].token_ids) == single
