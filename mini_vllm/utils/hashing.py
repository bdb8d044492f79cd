"""The hash functions prefix caching can chain block hashes with.

Mirrors upstream ``vllm/utils/hashing.py`` at v0.22.1: ``sha256`` (:26),
``sha256_cbor`` (:43), ``get_hash_fn_by_name`` (:82). Left out: the xxhash
variants and ``safe_hash``.

``sha256`` pickles its input, which is fast but only reproducible within one
Python; ``sha256_cbor`` serialises with canonical CBOR first, so the same
tokens give the same bytes in any language (upstream offers it for KV-cache
events read by other processes).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import cbor2


def sha256(input: Any) -> bytes:
    """SHA-256 of the pickled object."""
    return hashlib.sha256(pickle.dumps(input, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(input: Any) -> bytes:
    """SHA-256 of the object's canonical CBOR encoding."""
    return hashlib.sha256(cbor2.dumps(input, canonical=True)).digest()


def get_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], bytes]:
    """The hash function a config names (``"sha256"`` or ``"sha256_cbor"``)."""
    functions = {"sha256": sha256, "sha256_cbor": sha256_cbor}
    if hash_fn_name not in functions:
        raise ValueError(
            f"Unsupported prefix-caching hash function {hash_fn_name!r}; "
            f"mini_vllm has {', '.join(functions)}."
        )
    return functions[hash_fn_name]
