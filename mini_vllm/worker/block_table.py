"""The block ids of every request in the batch, one row per batch slot, and the
slot of every scheduled token.

Mirrors upstream ``vllm/v1/worker/block_table.py`` (``BlockTable`` :18,
``compute_slot_mapping`` :141, ``MultiGroupBlockTable`` :223) at v0.22.1.

Invariants:
- row ``i`` belongs to the request in batch slot ``i``: its first
  ``num_blocks_per_row[i]`` entries are that request's block ids in order;
  whatever lies past them is stale and never read;
- the table and the slot mapping are allocated once, at their largest shape
  (``max_num_reqs`` rows, ``max_num_batched_tokens`` slots), and edited in
  place, so their device addresses never change;
- the persistent batch edits the host copy; ``commit_block_table`` copies the
  rows in use to the device, and ``compute_slot_mapping`` reads that copy;
- slot of a token at position ``p`` = ``block_ids[p // block_size] *
  block_size + p % block_size``; slots past the step's tokens hold
  ``PAD_SLOT_ID`` (-1), which the cache writes skip.

Upstream computes the slot mapping with a Triton kernel, one program per
request plus one that writes the padding; here it is the same arithmetic in
torch, and the tests compare the two. Left out: splitting a KV block into
smaller kernel blocks, context parallelism, padding the table's width to a
multiple of 128 / block_size; see UPSTREAM_PIN.md.
"""

from __future__ import annotations

import numpy as np
import torch

from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.utils import CpuGpuBuffer

# The slot of a padding token (upstream: vllm/v1/attention/backends/utils.py).
PAD_SLOT_ID = -1


class BlockTable:
    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        pin_memory: bool,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pin_memory = pin_memory
        self.device = device
        # int32 [max_num_reqs, max_num_blocks_per_req]
        self.block_table = CpuGpuBuffer(
            max_num_reqs,
            max_num_blocks_per_req,
            dtype=torch.int32,
            device=device,
            pin_memory=pin_memory,
        )
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)  # [max_num_reqs]
        # int64 [max_num_batched_tokens]
        self.slot_mapping = CpuGpuBuffer(
            max_num_batched_tokens, dtype=torch.int64, device=device, pin_memory=pin_memory
        )

    # BEGIN LAB 05.2: append a request's new blocks to its row
    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        """Add ``block_ids`` after the blocks row ``row_idx`` already holds."""
        # HINT: the row holds num_blocks_per_row[row_idx] blocks: write the new ones right after
        # HINT: them in the host table (self.block_table.np) and count them. No ids, no change.
        if not block_ids:
            return
        start = self.num_blocks_per_row[row_idx]
        self.num_blocks_per_row[row_idx] += len(block_ids)
        self.block_table.np[row_idx, start : start + len(block_ids)] = block_ids

    # END LAB 05.2

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        """Make ``block_ids`` the whole content of row ``row_idx``."""
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        num_blocks = self.num_blocks_per_row[row_idx]
        self.block_table.np[row_idx, :num_blocks] = 0
        self.num_blocks_per_row[row_idx] = 0

    # BEGIN LAB 05.2: copy a row into another (condense moves a request down)
    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src`` into row ``tgt``; ``src`` is left as it was."""
        # HINT: copy the blocks in use (num_blocks_per_row[src] of them) and the count; what
        # HINT: lies past them in tgt is stale and never read.
        num_blocks = self.num_blocks_per_row[src]
        table = self.block_table.np
        table[tgt, :num_blocks] = table[src, :num_blocks]
        self.num_blocks_per_row[tgt] = num_blocks

    # END LAB 05.2

    # BEGIN LAB 05.2: exchange two rows (the decode-first reorder swaps requests)
    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange rows ``src`` and ``tgt``: their blocks and their counts."""
        # HINT: numpy: a[[i, j]] = a[[j, i]] swaps two rows safely (the right side is a copy);
        # HINT: a[i], a[j] = a[j], a[i] does not (a[i] is a view).
        # Fancy indexing on the right makes copies, so both rows swap whole.
        self.num_blocks_per_row[[src, tgt]] = self.num_blocks_per_row[[tgt, src]]
        self.block_table.np[[src, tgt]] = self.block_table.np[[tgt, src]]

    # END LAB 05.2

    # BEGIN LAB 05.2: the KV-cache slot of every scheduled token, then padding
    def compute_slot_mapping(
        self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Fill ``slot_mapping.gpu``: the KV-cache slot of each scheduled token.

        ``query_start_loc`` (int32 [num_reqs + 1]) splits the step's tokens by
        batch row; ``positions`` (int64 [num_tokens]) is each token's position
        in its request. Reads the device table, so commit it first.
        """
        # HINT: token t of batch row r at position p goes to slot
        # HINT: block_table.gpu[r, p // block_size] * block_size + p % block_size (int64);
        # HINT: slots past the step's tokens hold PAD_SLOT_ID. Read self.block_table.gpu (the
        # HINT: committed copy), never .np: rows edited since the last commit are not seen yet.
        num_tokens = positions.shape[0]
        query_lens = query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs]  # [num_reqs]
        rows = torch.arange(num_reqs, device=positions.device)
        # [num_tokens]: the batch row of every token, e.g. lens [2, 3] -> [0, 0, 1, 1, 1]
        req_indices = torch.repeat_interleave(rows, query_lens, output_size=num_tokens)
        block_numbers = self.block_table.gpu[req_indices, positions // self.block_size]
        slots = self.slot_mapping.gpu  # [max_num_batched_tokens]
        slots[:num_tokens] = block_numbers.long() * self.block_size + positions % self.block_size
        slots[num_tokens:] = PAD_SLOT_ID

    # END LAB 05.2

    def commit_block_table(self, num_reqs: int) -> None:
        self.block_table.copy_to_gpu(num_reqs)

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        return self.block_table.gpu[:num_reqs]  # int32 [num_reqs, max_num_blocks_per_req]


class MultiGroupBlockTable:
    """One ``BlockTable`` per KV-cache group; block ids arrive as one list per group.

    A full-attention model has one group, so ``block_ids`` is a 1-tuple; a
    hybrid model (Phase 07) has one entry per group, full-attention and
    sliding-window groups alike. The tuple shape is upstream's, as in
    ``SchedulerOutput``.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        pin_memory: bool,
        device: torch.device,
        block_sizes: list[int],
    ) -> None:
        self.block_tables = [
            BlockTable(
                block_size,
                max_num_reqs,
                cdiv(max_model_len, block_size),
                max_num_batched_tokens,
                pin_memory,
                device,
            )
            for block_size in block_sizes
        ]

    def append_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.append_row(ids, row_idx)

    def add_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.add_row(ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        for table in self.block_tables:
            table.clear_row(row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.swap_row(src, tgt)

    def compute_slot_mapping(
        self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor
    ) -> None:
        for table in self.block_tables:
            table.compute_slot_mapping(num_reqs, query_start_loc, positions)

    def commit_block_table(self, num_reqs: int) -> None:
        for table in self.block_tables:
            table.commit_block_table(num_reqs)

    def __getitem__(self, idx: int) -> BlockTable:
        return self.block_tables[idx]
