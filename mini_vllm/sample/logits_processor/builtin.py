"""The built-in logits processors: min_p, logit_bias and min_tokens.

Mirrors upstream ``vllm/v1/sample/logits_processor/builtin.py`` at v0.22.1:
``MinPLogitsProcessor`` :22, ``LogitBiasLogitsProcessor`` :118,
``MinTokensLogitsProcessor`` :167 and ``process_dict_updates`` :294.

Per-row state and how it follows the batch (see interface.py):
- min_p keeps a dense float32 array, one slot per possible row (0 = off),
  and a count of rows with min_p > 0; when the count is 0 it does nothing.
  ``apply`` turns the logits into probabilities and masks every token whose
  probability is below ``min_p * (the row's largest probability)``. It is
  argmax-invariant, so the sampler runs it after temperature, when some row
  samples at random: min_p sees the temperature-scaled distribution.
- logit_bias and min_tokens keep sparse dicts row -> state, updated by
  ``process_dict_updates``: an added row gets a new state (or loses a stale
  one), a removed row loses its state, a moved row carries it (a SWAP
  carries both ways, a one-way move drops what the destination held).
- logit_bias adds each row's ``{token id: bias}`` to its logits.
- min_tokens sets every id in ``all_stop_token_ids`` (EOS included, even
  with ``ignore_eos``) to -inf while the row's output is shorter than
  ``min_tokens``; it watches the live output list and forgets a row as soon
  as it is long enough, on every ``update_state``, changed batch or not.

Left out (see UPSTREAM_PIN.md): ``apply_with_spec_decode`` (speculative
decoding) and pinned host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from mini_vllm.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

if TYPE_CHECKING:
    from mini_vllm.config import VllmConfig

T = TypeVar("T")


class MinPLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.device = torch.device(device)
        self.min_p_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.float32)  # [max_num_reqs]
        self.min_p_cpu = self.min_p_cpu_tensor.numpy()  # the same memory, for cheap row edits
        self.min_p_count = 0  # rows whose min_p is not 0
        self.min_p = self.min_p_cpu_tensor[:0]  # float32 [batch_size, 1] once set, on device

    def is_argmax_invariant(self) -> bool:
        return True  # the largest probability always passes its own threshold

    def get_min_p_by_index(self, index: int) -> float:
        return float(self.min_p_cpu[index])

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        needs_update = False
        for index, params, _, _ in batch_update.added:
            old, new = self.min_p_cpu[index], params.min_p
            if old != new:
                needs_update = True
                self.min_p_cpu[index] = new
                self.min_p_count += bool(new) - bool(old)
        # BEGIN LAB 06.3: min_p's dense row array through removals and moves
        # HINT: receives batch_update (its added rows already written) and needs_update; leaves
        # HINT: needs_update True if the rows 0 .. batch_size - 1 of self.min_p_cpu changed, and
        # HINT: self.min_p_cpu / self.min_p_count following the batch: a removed row's slot is
        # HINT: 0; a SWAP exchanges a's and b's values; an UNIDIRECTIONAL move puts a's value
        # HINT: in b and leaves a at 0, and b's old value is gone for good (count it out).
        # HINT: self.min_p_count is the number of rows whose min_p is not 0. With it at 0
        # HINT: every slot is 0 already: removals and moves change nothing (upstream skips them).
        # HINT: Upstream marks any step with removals as changed, even if the slots were 0.
        if self.min_p_count:
            if batch_update.removed:
                needs_update = True
            for index in batch_update.removed:
                if self.min_p_cpu[index]:
                    self.min_p_cpu[index] = 0
                    self.min_p_count -= 1
            for a, b, direction in batch_update.moved:
                min_p_a, min_p_b = self.min_p_cpu[a], self.min_p_cpu[b]
                if min_p_a != min_p_b:
                    needs_update = True
                    self.min_p_cpu[b] = min_p_a
                    if direction == MoveDirectionality.SWAP:
                        self.min_p_cpu[a] = min_p_b
                if direction == MoveDirectionality.UNIDIRECTIONAL:
                    # a is left empty and b's old value is gone.
                    if min_p_a:
                        self.min_p_cpu[a] = 0
                    if min_p_b:
                        self.min_p_count -= 1
        # END LAB 06.3
        size = batch_update.batch_size
        if self.min_p_count and (needs_update or self.min_p.shape[0] != size):
            # On a CPU this is a view of the array, on a GPU a copy.
            self.min_p = self.min_p_cpu_tensor[:size].to(self.device).unsqueeze(1)  # [B, 1]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.min_p_count:
            return logits
        # BEGIN LAB 06.2: min_p: drop what is less likely than min_p times the row's best
        # HINT: receives logits float32 [B, V] (already divided by the temperature) and
        # HINT: self.min_p, float32 [B, 1] (0 for rows without min_p); leaves every token whose
        # HINT: probability (softmax of the row) is strictly below min_p * the row's largest
        # HINT: probability set to -inf, in place. A token exactly at the threshold stays.
        probs = logits.softmax(dim=-1)  # float32 [B, V]
        threshold = probs.amax(dim=-1, keepdim=True).mul_(self.min_p)  # float32 [B, 1]
        logits.masked_fill_(probs < threshold, float("-inf"))
        # END LAB 06.2
        return logits


class LogitBiasLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.device = torch.device(device)
        self.biases: dict[int, dict[int, float]] = {}  # row -> {token id: bias}
        self.bias_tensor = torch.tensor((), dtype=torch.float32)  # float32 [N]
        # (rows, token ids) of the N biased logits, int64 [N] each
        self.logits_slice = (self._device_tensor([]), self._device_tensor([]))

    def is_argmax_invariant(self) -> bool:
        return False  # a bias can make another token the largest

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not process_dict_updates(
            self.biases, batch_update, lambda params, _, __: params.logit_bias or None
        ):
            return
        rows, token_ids, biases = [], [], []
        for row, bias in self.biases.items():
            rows += [row] * len(bias)
            token_ids += bias.keys()
            biases += bias.values()
        self.bias_tensor = torch.tensor(biases, dtype=torch.float32).to(self.device)  # [N]
        self.logits_slice = (self._device_tensor(rows), self._device_tensor(token_ids))

    def _device_tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64).to(self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Add each biased row's ``{token id: bias}`` to its logits, in place."""
        # BEGIN LAB 06.1: add each row's biases to its logits, in place
        # HINT: receives logits float32 [B, V]; leaves each biased logit raised by its bias.
        # HINT: update_state already laid the biases out flat: self.logits_slice is (rows, token
        # HINT: ids), int64 [N] each, and self.bias_tensor float32 [N] in the same order; with no
        # HINT: biased row (self.biases empty) the logits stay as they are.
        if self.biases:
            logits[self.logits_slice] += self.bias_tensor
        # END LAB 06.1
        return logits


class MinTokensLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.device = torch.device(device)
        # row -> (min_tokens, live output token ids, stop token ids)
        self.min_toks: dict[int, tuple[int, Sequence[int], set[int]]] = {}
        # (rows, stop token ids) to set to -inf, int64 [N] each
        self.logits_slice = (self._device_tensor([]), self._device_tensor([]))
        self.neg_inf_tensor = torch.tensor(float("-inf"), dtype=torch.float32, device=self.device)

    def is_argmax_invariant(self) -> bool:
        return False  # blocking a stop token can change the greedy pick

    @staticmethod
    def add_request(
        params: Any, _: list[int] | None, output_tok_ids: list[int]
    ) -> tuple[int, Sequence[int], set[int]] | None:
        min_tokens = params.min_tokens
        if not min_tokens or len(output_tok_ids) >= min_tokens:
            return None
        return min_tokens, output_tok_ids, params.all_stop_token_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        needs_update = process_dict_updates(self.min_toks, batch_update, self.add_request)
        done = [row for row, (n, output, _) in self.min_toks.items() if len(output) >= n]
        for row in done:
            del self.min_toks[row]
        if not (needs_update or done):
            return
        rows, token_ids = [], []
        for row, (_, _, stop_token_ids) in self.min_toks.items():
            rows += [row] * len(stop_token_ids)
            token_ids += stop_token_ids
        self.logits_slice = (self._device_tensor(rows), self._device_tensor(token_ids))

    def _device_tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64).to(self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_toks:
            logits.index_put_(self.logits_slice, self.neg_inf_tensor)
        return logits


# BEGIN LAB 06.3: carry a row -> state dict through one BatchUpdate
def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[Any, list[int] | None, list[int]], T | None],
) -> bool:
    """Carry a sparse row -> state dict through one batch update; True if it changed.

    ``new_state(params, prompt ids, output ids)`` gives an added row's state,
    or None if the row needs none.
    """
    # HINT: No update (None) changes nothing: return False. Otherwise, in upstream's order:
    # HINT: 1. added (row, params, prompt ids, output ids): the row gets new_state(...); if
    # HINT: that is None the row keeps NO entry (an older request's entry there must go).
    # HINT: 2. removed rows lose their entry. 3. moved (a, b, direction), in list order: a's
    # HINT: entry goes to b; a SWAP also brings b's entry to a; an UNIDIRECTIONAL move leaves a
    # HINT: with nothing and drops what b held.
    # HINT: Return True exactly when some entry was set, dropped or moved (the processors
    # HINT: rebuild their tensors only then). Once the dict is empty, removals and moves
    # HINT: cannot change it: upstream returns there.
    if not batch_update:
        return False
    updated = False
    for index, params, prompt_tok_ids, output_tok_ids in batch_update.added:
        state = new_state(params, prompt_tok_ids, output_tok_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True  # the row's previous request had a state
    if not req_entries:
        return updated
    for index in batch_update.removed:
        if req_entries.pop(index, None) is not None:
            updated = True
    for a, b, direction in batch_update.moved:
        entry_a = req_entries.pop(a, None)
        entry_b = req_entries.pop(b, None)
        if entry_a is not None:
            req_entries[b] = entry_a
            updated = True
        if entry_b is not None:
            updated = True
            if direction == MoveDirectionality.SWAP:
                req_entries[a] = entry_b
    return updated


# END LAB 06.3
