"""Names of dtypes, as the configs spell them, and the torch dtypes they mean.

Mirrors upstream ``vllm/utils/torch_utils.py`` at v0.22.1 (the
``STR_DTYPE_TO_TORCH_DTYPE`` table and ``kv_cache_dtype_str_to_dtype`` at
:396), cut down to the KV-cache dtypes mini_vllm has. One difference:
upstream allocates an fp8 KV cache as ``torch.uint8`` and views it as fp8
inside its kernels; mini_vllm allocates ``torch.float8_e4m3fn`` directly.
Both take one byte a value, so the sizing is the same.
"""

from __future__ import annotations

import torch

STR_DTYPE_TO_TORCH_DTYPE = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}

# ``kv_cache_dtype`` values mini_vllm accepts (upstream's CacheDType has more).
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype.startswith("fp8")


def kv_cache_dtype_str_to_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype: the model's for "auto", else the one named."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype]
