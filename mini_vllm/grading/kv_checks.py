"""Checks the Phase 02 graded suites share: a student's KV cache built from
its parts, against upstream's KV snapshots and against the reference on
generated workloads.

The starters re-open only the methods that hold a lab, so a starter's
``KVCacheManager`` still builds the *reference* ``BlockPool`` in its
constructor. ``build_manager`` swaps in the pool of the modules under grade
(whose constructor, re-opened for Lab 02.2, builds the free queue of the
modules under grade), and ``request_factory`` hashes requests with their
``get_request_block_hasher``. So every class on the path is the student's
where the student wrote it, and the reference's elsewhere.
"""

from __future__ import annotations

import traceback

import pytest

from mini_vllm.core.kv_cache_utils import sha256
from mini_vllm.oracle import kv_snapshots
from mini_vllm.oracle.kv_workload import KVWorkload, first_kv_difference, run_kv_workload
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams

YOURS = "your KV cache"


class Backend:
    """``mini_vllm.oracle.kv_workload``'s backend for the modules under grade."""

    def __init__(self, impl) -> None:
        self.impl = impl

    def create_kv_cache_manager(
        self,
        block_size: int = 16,
        num_blocks: int = 10000,
        max_model_len: int = 8192,
        enable_caching: bool = True,
    ):
        return build_manager(
            self.impl,
            block_size=block_size,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            enable_caching=enable_caching,
        )

    @staticmethod
    def manager_state(manager) -> dict:
        import mini_vllm.testing as mini

        return mini.manager_state(manager)


def build_manager(
    impl,
    block_size: int = 4,
    num_blocks: int = 16,
    max_model_len: int = 64,
    enable_caching: bool = True,
):
    """The KV cache manager of the modules under grade, over their block pool."""
    manager = impl.kv_cache_manager.KVCacheManager(
        num_blocks, block_size, max_model_len, enable_caching=enable_caching
    )
    manager.block_pool = impl.block_pool.BlockPool(num_blocks, enable_caching)
    return manager


def request_factory(impl, block_size: int, max_tokens: int = 1000):
    """``make_request(req_id, prompt)``: a Request hashed by the hasher under grade."""
    hasher = impl.kv_cache_utils.get_request_block_hasher(block_size, sha256)

    def make_request(req_id: str, prompt: list[int]) -> Request:
        return Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens),
            arrival_time=0.0,
            block_hasher=hasher,
        )

    return make_request


def run(impl, workload: KVWorkload) -> dict:
    """The trace of ``workload`` on the KV cache under grade."""
    backend = Backend(impl)
    return run_kv_workload(
        backend,
        workload,
        manager=backend.create_kv_cache_manager(**workload.config),
        make_request=request_factory(impl, workload.config["block_size"]),
    )


def expect_raises(exc: type, call, rule: str) -> None:
    """``call()`` must raise ``exc``; anything else fails with ``rule``."""
    try:
        call()
    except NotImplementedError:  # a RuntimeError: test it before `exc`
        raise
    except exc:
        return
    except Exception as e:  # noqa: BLE001 - turned into a message
        pytest.fail(f"{rule} It raised {type(e).__name__}: {e}.", pytrace=False)
    pytest.fail(f"{rule} It raised nothing.", pytrace=False)


def _raised(e: Exception, what: str) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1]
    return (
        f"{what}: {YOURS} raised {type(e).__name__}: {e} at `{where.line}` (line "
        f"{where.lineno} of {where.filename})."
    )


def snapshot_mismatch(impl, name: str, fields: tuple[str, ...] | None = None) -> str | None:
    """None if the KV cache under grade reproduces the snapshot recorded from
    the pinned upstream (on ``fields``, default all), else what differs first."""
    workload, header, expected = kv_snapshots.load(kv_snapshots.path_of(name))
    try:
        got = run(impl, workload)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - turned into a message
        return _raised(e, f"KV scenario {name!r} (mini_vllm/oracle/kv_scenarios.py)")
    upstream = f"upstream vLLM {header['vllm_version']}"
    diff = first_kv_difference(expected, got, labels=(upstream, YOURS), fields=fields)
    if diff is None:
        return None
    return (
        f"KV scenario {name!r} (config {workload.config}), as recorded from {upstream}'s "
        f"KVCacheManager, against {YOURS}:\n{diff}\n"
        f"The scenario's story is in mini_vllm/oracle/kv_scenarios.py; the recording is "
        f"tests/snapshots/kv_cache/{name}.json."
    )


def reference_mismatch(impl, workload: KVWorkload) -> str | None:
    """None if the KV cache under grade and the reference produce the same
    trace on ``workload`` (the reference equals upstream operation for
    operation: tests/upstream/test_kv_lockstep.py)."""
    import mini_vllm.testing as mini

    expected = run_kv_workload(mini, workload)
    try:
        got = run(impl, workload)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - turned into a message
        return (
            _raised(e, "on the generated workload below")
            + f"\nconfig: {workload.config}\nrequests: {workload.requests}\nops: {workload.ops}"
        )
    diff = first_kv_difference(expected, got, labels=("reference", YOURS))
    if diff is None:
        return None
    return (
        f"{diff}\nconfig: {workload.config}\nrequests (id, prompt): {workload.requests}\n"
        f"operations: {workload.ops}"
    )
