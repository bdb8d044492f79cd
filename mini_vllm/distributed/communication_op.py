"""The tensor-parallel group's collectives as functions, for the layers to call.

Mirrors upstream ``vllm/distributed/communication_op.py`` at v0.22.1
(``tensor_model_parallel_all_reduce`` :12, ``tensor_model_parallel_all_gather``
:17). Left out: reduce-scatter, gather to one rank, tensor-dict broadcast.
"""

from __future__ import annotations

import torch

from mini_vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum ``input_`` over the tensor-parallel group (itself outside any run)."""
    if not model_parallel_is_initialized():
        return input_
    return get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``input_`` along ``dim`` (itself outside any run)."""
    if not model_parallel_is_initialized():
        return input_
    return get_tp_group().all_gather(input_, dim)
