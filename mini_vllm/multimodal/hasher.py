"""The hash that names a multimodal item: the encoder cache's key.

Mirrors upstream ``vllm/multimodal/hasher.py`` at v0.22.1
(``MultiModalHasher`` at :50: ``serialize_item`` :52, ``iter_item_to_bytes``
:134, ``hash_kwargs`` :154), called as upstream's processor calls it
(``ProcessorInputs.get_mm_hashes``, vllm/multimodal/processing/inputs.py:25):
``hash_kwargs(model_id=<model path>, image=<the PIL image>)``. Left out: an
image's EXIF ``ImageID`` uuid as a ready-made hash, ``MediaWithBytes``, bf16
tensors, the pickle fallback (an unknown type raises instead), and the
``VLLM_MM_HASHER_ALGORITHM`` switch (blake3, upstream's default, always).

What enters the hash: every keyword's name, then the item itself, flattened
into a stream of byte strings each preceded by its key path (``image.mode``,
``image.data``, ...). A PIL image contributes its mode and its pixels (and
its palette, if it has one), not its file name or format: two images with the
same pixels share a hash, and so share encoder outputs and cached KV blocks.
The same image gets the same hash in mini_vllm and upstream
(tests/upstream/test_mm_hasher_oracle.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from blake3 import blake3
from PIL import Image


class MultiModalHasher:
    @classmethod
    def serialize_item(cls, obj: object) -> Iterable[bytes | memoryview]:
        """The bytes of one leaf value."""
        if isinstance(obj, (bytes, memoryview)):
            return (obj,)
        if isinstance(obj, str):
            return (obj.encode("utf-8"),)
        if isinstance(obj, (int, float)):
            return (np.array(obj).tobytes(),)
        if isinstance(obj, Image.Image):
            data: dict[str, object] = {"mode": obj.mode, "data": np.asarray(obj)}
            if obj.palette is not None:
                data["palette"] = obj.palette.palette
                if obj.palette.rawmode is not None:
                    data["palette_rawmode"] = obj.palette.rawmode
            return cls.iter_item_to_bytes("image", data)
        if isinstance(obj, torch.Tensor):
            return cls.iter_item_to_bytes("tensor", obj.cpu().numpy())
        if isinstance(obj, np.ndarray):
            if obj.ndim == 0:
                arr_data: object = obj.item()
            elif obj.flags.c_contiguous:
                arr_data = obj.view(np.uint8).data
            else:
                arr_data = obj.tobytes()
            return cls.iter_item_to_bytes(
                "ndarray", {"dtype": obj.dtype.str, "shape": obj.shape, "data": arr_data}
            )
        raise TypeError(f"cannot hash a {type(obj).__name__} as a multimodal item")

    @classmethod
    def iter_item_to_bytes(cls, key: str, obj: object) -> Iterable[bytes | memoryview]:
        """``key`` then ``obj``'s bytes; lists, tuples and dicts recurse with
        ``key.index`` / ``key.name``."""
        if obj is None:
            yield key.encode("utf-8")
            return
        if isinstance(obj, (list, tuple)):
            for i, elem in enumerate(obj):
                yield from cls.iter_item_to_bytes(f"{key}.{i}", elem)
        elif isinstance(obj, dict):
            for name, value in obj.items():
                yield from cls.iter_item_to_bytes(f"{key}.{name}", value)
        else:
            yield key.encode("utf-8")
            yield from cls.serialize_item(obj)

    @classmethod
    def hash_kwargs(cls, **kwargs: object) -> str:
        """The blake3 hex digest of every keyword, in name order."""
        hasher = blake3()
        for key, value in sorted(kwargs.items(), key=lambda kv: kv[0]):
            for chunk in cls.iter_item_to_bytes(key, value):
                hasher.update(chunk)
        return hasher.hexdigest()
