"""LoRARequest, LoRAConfig and LoRA block hashes against the pinned upstream.

mini_vllm.lora.request.LoRARequest and config.LoRAConfig follow upstream's
rules (vllm/lora/request.py, vllm/config/lora.py): ids start at 1, a path is
required, equality and hashing go by name; max_cpu_loras defaults to
max_loras and may not be smaller. A LoRA request's block hashes carry the
adapter's name as upstream's extra keys do (vllm/v1/core/kv_cache_utils.py:
462, :503): mini_vllm's hashes equal upstream's byte for byte, and differ
between adapters and from the base model's.
"""

from __future__ import annotations

import pytest

import mini_vllm.testing as mini
from mini_vllm.config import LoRAConfig
from mini_vllm.lora.request import LoRARequest

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def upstream():
    from mini_vllm.oracle import upstream as up

    return up


def _raises(fn) -> bool:
    try:
        fn()
    except (ValueError, AssertionError, TypeError):
        return True
    return False


@pytest.mark.parametrize(
    "args",
    [("a", 1, "/p"), ("a", 0, "/p"), ("a", -3, "/p"), ("a", 2, ""), ("b", 7, "/q")],
)
def test_lora_request_accepts_and_refuses_as_upstream(upstream, args):
    assert _raises(lambda: LoRARequest(*args)) == _raises(lambda: upstream.LoRARequest(*args))


def test_lora_request_equality_is_by_name_as_upstream(upstream):
    pairs = [(("a", 1, "/p"), ("a", 2, "/q")), (("a", 1, "/p"), ("b", 1, "/p"))]
    for x, y in pairs:
        ours = LoRARequest(*x) == LoRARequest(*y)
        theirs = upstream.LoRARequest(*x) == upstream.LoRARequest(*y)
        assert ours == theirs, (x, y)
        assert (hash(LoRARequest(*x)) == hash(LoRARequest(*y))) == ours
    assert LoRARequest("a", 3, "/p").adapter_id == upstream.LoRARequest("a", 3, "/p").adapter_id


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_loras": 3},
        {"max_loras": 2, "max_cpu_loras": 5},
        {"max_loras": 4, "max_cpu_loras": 2},
        {"max_loras": 0},
        {"max_lora_rank": 8},
        {"max_lora_rank": 7},
    ],
)
def test_lora_config_defaults_and_limits_as_upstream(upstream, kwargs):
    def ours():
        config = LoRAConfig(**kwargs)
        config.verify()
        return config

    def theirs():
        return upstream.LoRAConfig(**kwargs)

    assert _raises(ours) == _raises(theirs), kwargs
    if not _raises(ours):
        a, b = ours(), theirs()
        assert (a.max_loras, a.max_cpu_loras, a.max_lora_rank) == (
            b.max_loras,
            b.max_cpu_loras,
            b.max_lora_rank,
        )


def _hashes(backend, lora_id, prompt, block_size=4):
    (request,) = backend.create_requests(
        1, block_size=block_size, prompt_token_ids=[prompt], lora_ids=[lora_id]
    )
    return list(request.block_hashes)


@pytest.mark.parametrize("lora_id", [None, 1, 2])
def test_block_hashes_carry_the_adapter_as_upstream(upstream, lora_id):
    prompt = list(range(100, 118))
    ours = _hashes(mini, lora_id, prompt)
    assert len(ours) == 4
    assert ours == _hashes(upstream, lora_id, prompt)


def test_two_adapters_never_share_a_block_hash():
    prompt = list(range(100, 118))
    base, one, two = (_hashes(mini, i, prompt) for i in (None, 1, 2))
    assert not set(base) & set(one) and not set(one) & set(two) and not set(base) & set(two)
