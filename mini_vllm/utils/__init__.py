"""A host buffer paired with a device buffer of the same shape, allocated once.

Mirrors upstream ``vllm/v1/utils.py`` (``CpuGpuBuffer`` :109, ``copy_slice``
:583) at v0.22.1. The persistent batch edits the host side (through a numpy
view, which shares its memory) and copies the rows in use to the device once
a step. Both buffers keep their addresses for the engine's lifetime, which is
what CUDA graphs need. On a CPU-only machine the "device" buffer is a second
CPU tensor, so the copy is still a real step. Left out: bfloat16 buffers
without a numpy view, and ``copy_to_cpu``; see UPSTREAM_PIN.md.
"""

from __future__ import annotations

import torch


class CpuGpuBuffer:
    def __init__(
        self, *size: int, dtype: torch.dtype, device: torch.device, pin_memory: bool
    ) -> None:
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu", pin_memory=pin_memory)
        self.gpu = torch.zeros_like(self.cpu, device=device)
        self.np = self.cpu.numpy()  # shares self.cpu's memory

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows (all when ``n`` is None) to the device."""
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


def copy_slice(from_tensor: torch.Tensor, to_tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Copy the first ``length`` entries of ``from_tensor`` into ``to_tensor``; return them."""
    return to_tensor[:length].copy_(from_tensor[:length], non_blocking=True)
