"""The adapter a request asks for.

Mirrors upstream ``vllm/lora/request.py`` at v0.22.1 (``LoRARequest`` at
:8). Upstream's is a msgspec Struct; here a plain class with the same
fields mini_vllm uses (name, id, path, base model) and the same rules: the id
is at least 1, the path is not empty, and two requests are equal (and hash
alike) when their names are, since the name is what identifies an adapter
across engines (and what prefix-cache block hashes carry).
Left out: ``tensorizer_config_dict``, ``load_inplace``, ``is_3d_lora_weight``.
"""

from __future__ import annotations


class LoRARequest:
    def __init__(
        self,
        lora_name: str,
        lora_int_id: int,
        lora_path: str = "",
        base_model_name: str | None = None,
    ) -> None:
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {lora_int_id!r}.")
        if lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {lora_int_id}.")
        if not lora_path:
            raise ValueError("lora_path cannot be empty.")
        self.lora_name = lora_name
        self.lora_int_id = lora_int_id
        self.lora_path = str(lora_path)
        self.base_model_name = base_model_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def __repr__(self) -> str:
        return (
            f"LoRARequest(lora_name={self.lora_name!r}, lora_int_id={self.lora_int_id}, "
            f"lora_path={self.lora_path!r})"
        )
