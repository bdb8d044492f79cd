"""The persistent batch: one row per running request, kept across steps.

Mirrors upstream ``vllm/v1/worker/gpu_input_batch.py`` (``InputBatch`` :91:
``add_request`` :335, ``remove_request`` :510, ``swap_states`` :566,
``condense`` :683, ``refresh_metadata`` :811, ``make_lora_inputs`` :976) at
v0.22.1.

A request keeps its row from step to step, so a decode step edits a few
numbers instead of rebuilding the batch: the runner appends the tokens it
samples to ``token_ids_cpu`` and ``num_tokens_no_spec``, and the blocks the
scheduler adds to the block table. A step's edits come in a fixed order:
``remove_request`` for every request leaving the batch, ``add_request`` for
every request joining it, ``condense``, (reordering with ``swap_states``),
``refresh_metadata``.

Invariants:
- after ``condense`` the rows ``0 .. num_reqs - 1`` are exactly the batch's
  requests, in ``req_ids`` order, and ``req_id_to_index`` inverts ``req_ids``;
- between a removal and ``condense`` the removed row is a hole (``None`` in
  ``req_ids``); ``add_request`` fills the lowest hole first, and ``condense``
  moves the highest rows down into the holes that are left;
- every per-row array (token ids, counts, block table, sampling parameters)
  moves with its request; rows past ``num_reqs`` hold stale values nobody
  reads;
- all arrays are allocated once, at ``max_num_reqs`` rows.

``CachedRequestState`` (upstream :34) is the model runner's copy of one
request: the batch reads it in ``add_request``, and keeps a reference to its
``output_token_ids`` list, which the runner extends. What is left out
(per-token logprob requests, the thinking budget, speculative decoding,
pooling, prompt embeddings, ...) is listed in UPSTREAM_PIN.md. The
sampling parameters of Phase 06 (penalties, allowed token ids, bad words)
live outside the Lab 05.1 regions; the logits processors hear of every
added, removed and moved row through ``batch_update_builder``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mini_vllm.lora.request import LoRARequest
from mini_vllm.multimodal.inputs import MultiModalFeatureSpec
from mini_vllm.sample.logits_processor import (
    BatchUpdateBuilder,
    LogitsProcessors,
    MoveDirectionality,
)
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.ops.allowed_token_ids import allowed_token_ids_mask
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.utils import copy_slice
from mini_vllm.worker.block_table import MultiGroupBlockTable


@dataclass
class CachedRequestState:
    """The runner's copy of a request, kept from its first step to its end
    (preempted requests included): new requests arrive whole, later steps
    only change ``num_computed_tokens`` and ``block_ids``, and the runner
    appends the tokens it samples to ``output_token_ids``."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None  # only for a random request with a seed
    block_ids: tuple[list[int], ...]  # one list per KV-cache group
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    # Its images, in prompt order (Phase 13): where each goes, and its hash.
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    # A prompt given as embeddings [num_prompt_tokens, hidden], or None.
    prompt_embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device,
        pin_memory: bool,
        vocab_size: int,
        block_sizes: list[int],
        logitsprocs: LogitsProcessors | None = None,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = device
        self.pin_memory = pin_memory
        self.vocab_size = vocab_size

        self._req_ids: list[str | None] = []  # row -> request id; None is a hole
        self.req_id_to_index: dict[str, int] = {}

        # Prompt then output tokens of every row. Never copied to the device whole.
        # int32 [max_num_reqs, max_model_len]
        self.token_ids_cpu_tensor = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        # Counts per row, int32 [max_num_reqs] each (pinned for fast copies where asked).
        self.num_tokens_no_spec_cpu_tensor = torch.zeros(
            max_num_reqs, dtype=torch.int32, pin_memory=pin_memory
        )
        self.num_tokens_no_spec = self.num_tokens_no_spec_cpu_tensor.numpy()
        self.num_prompt_tokens_cpu_tensor = torch.zeros(
            max_num_reqs, dtype=torch.int32, pin_memory=pin_memory
        )
        self.num_prompt_tokens = self.num_prompt_tokens_cpu_tensor.numpy()
        self.num_computed_tokens_cpu_tensor = torch.zeros(
            max_num_reqs, dtype=torch.int32, pin_memory=pin_memory
        )
        self.num_computed_tokens_cpu = self.num_computed_tokens_cpu_tensor.numpy()

        self.block_table = MultiGroupBlockTable(
            max_num_reqs=max_num_reqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            pin_memory=pin_memory,
            device=device,
            block_sizes=block_sizes,
        )

        # Sampling parameters: a host array edited per row, a device copy of
        # the rows in use, and the set of requests that need the feature.
        self.temperature = torch.empty(max_num_reqs, dtype=torch.float32, device=device)
        self.temperature_cpu_tensor = torch.empty(
            max_num_reqs, dtype=torch.float32, pin_memory=pin_memory
        )
        self.temperature_cpu = self.temperature_cpu_tensor.numpy()  # float32 [max_num_reqs]
        self.greedy_reqs: set[str] = set()
        self.random_reqs: set[str] = set()

        self.top_p = torch.empty(max_num_reqs, dtype=torch.float32, device=device)
        self.top_p_cpu_tensor = torch.empty(
            max_num_reqs, dtype=torch.float32, pin_memory=pin_memory
        )
        self.top_p_cpu = self.top_p_cpu_tensor.numpy()  # float32 [max_num_reqs]
        self.top_p_reqs: set[str] = set()

        self.top_k = torch.empty(max_num_reqs, dtype=torch.int32, device=device)
        self.top_k_cpu_tensor = torch.empty(max_num_reqs, dtype=torch.int32, pin_memory=pin_memory)
        self.top_k_cpu = self.top_k_cpu_tensor.numpy()  # int32 [max_num_reqs]; vocab_size = off
        self.top_k_reqs: set[str] = set()

        # Row -> generator, only for rows whose request has its own seed.
        self.generators: dict[int, torch.Generator] = {}
        self.num_logprobs: dict[str, int] = {}  # request id -> top-n it wants
        # Row -> (min_tokens, the row's output token list, stop token ids) while
        # the request is short of min_tokens; upstream keeps this in its
        # MinTokensLogitsProcessor (vllm/v1/sample/logits_processor/builtin.py:167).
        self.min_tokens: dict[int, tuple[int, list[int], set[int]]] = {}

        # Row -> the request's output token list (the same list object the
        # runner's CachedRequestState extends).
        self.req_output_token_ids: list[list[int] | None] = []

        # Penalties, as the other per-row parameters; 0 (1 for repetition) is "off".
        self.frequency_penalties = torch.empty(max_num_reqs, dtype=torch.float32, device=device)
        self.frequency_penalties_cpu_tensor = torch.empty(
            max_num_reqs, dtype=torch.float32, pin_memory=pin_memory
        )
        self.frequency_penalties_cpu = self.frequency_penalties_cpu_tensor.numpy()
        self.frequency_penalties_reqs: set[str] = set()
        self.presence_penalties = torch.empty(max_num_reqs, dtype=torch.float32, device=device)
        self.presence_penalties_cpu_tensor = torch.empty(
            max_num_reqs, dtype=torch.float32, pin_memory=pin_memory
        )
        self.presence_penalties_cpu = self.presence_penalties_cpu_tensor.numpy()
        self.presence_penalties_reqs: set[str] = set()
        self.repetition_penalties = torch.empty(max_num_reqs, dtype=torch.float32, device=device)
        self.repetition_penalties_cpu_tensor = torch.empty(
            max_num_reqs, dtype=torch.float32, pin_memory=pin_memory
        )
        self.repetition_penalties_cpu = self.repetition_penalties_cpu_tensor.numpy()
        self.repetition_penalties_reqs: set[str] = set()
        # Request id -> its allowed token ids / its bad words as token-id lists.
        # Upstream keeps a mask row and a dict by row; mini keys them by request
        # so that nothing of theirs moves with the rows (see UPSTREAM_PIN.md).
        self.allowed_token_ids: dict[str, list[int]] = {}
        self.bad_words_token_ids: dict[str, list[list[int]]] = {}

        # LoRA (upstream :244-247): each row's adapter id (0: none), and per
        # adapter id the requests in the batch that use it and its LoRARequest.
        self.request_lora_mapping = np.zeros(max_num_reqs, dtype=np.int64)
        self.lora_id_to_request_ids: dict[int, set[str]] = {}
        self.lora_id_to_lora_request: dict[int, LoRARequest] = {}

        # The logits processors (min_p, logit_bias, custom ones), fed the
        # step's BatchUpdate by refresh_metadata.
        self.logitsprocs = logitsprocs or LogitsProcessors()
        self.batch_update_builder = BatchUpdateBuilder()
        self.sampling_metadata = self._make_sampling_metadata()

    def per_row_arrays(self) -> tuple[np.ndarray, ...]:
        """The numpy arrays with one value per row: swap_states and condense move them all."""
        return (
            self.num_tokens_no_spec,
            self.num_prompt_tokens,
            self.num_computed_tokens_cpu,
            self.temperature_cpu,
            self.top_p_cpu,
            self.top_k_cpu,
            self.frequency_penalties_cpu,
            self.presence_penalties_cpu,
            self.repetition_penalties_cpu,
            self.request_lora_mapping,
        )

    @property
    def req_ids(self) -> list[str | None]:
        return self._req_ids

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def all_greedy(self) -> bool:
        return not self.random_reqs

    @property
    def no_top_p(self) -> bool:
        return not self.top_p_reqs

    @property
    def no_top_k(self) -> bool:
        return not self.top_k_reqs

    @property
    def all_random(self) -> bool:
        return not self.greedy_reqs

    @property
    def no_penalties(self) -> bool:
        return not (
            self.presence_penalties_reqs
            or self.frequency_penalties_reqs
            or self.repetition_penalties_reqs
        )

    @property
    def max_num_logprobs(self) -> int | None:
        return max(self.num_logprobs.values()) if self.num_logprobs else None

    # ------------------------------------------------------------ add/remove

    def add_request(self, request: CachedRequestState) -> int:
        """Give ``request`` a row (the lowest hole, else a new last row); return it."""
        # BEGIN LAB 05.1: pick the row: the lowest hole, else a new last row
        # HINT: receives the request; leaves req_index, the row it gets: the lowest hole that
        # HINT: remove_request left (self.batch_update_builder.pop_removed() hands it out, or
        # HINT: None), else the first row past the batch (self.num_reqs).
        # HINT: A full batch (req_index >= self.max_num_reqs) raises ValueError.
        req_index = self.batch_update_builder.pop_removed()
        if req_index is None:
            req_index = self.num_reqs
        if req_index >= self.max_num_reqs:
            raise ValueError(f"The batch is full: it holds at most {self.max_num_reqs} requests.")
        # END LAB 05.1
        self.batch_update_builder.batch_changed = True

        req_id = request.req_id
        if req_index == len(self._req_ids):
            self._req_ids.append(req_id)
            self.req_output_token_ids.append(request.output_token_ids)
        else:
            self._req_ids[req_index] = req_id
            self.req_output_token_ids[req_index] = request.output_token_ids
        self.req_id_to_index[req_id] = req_index

        num_prompt_tokens = len(request.prompt_token_ids)
        self.num_prompt_tokens[req_index] = num_prompt_tokens
        self.token_ids_cpu[req_index, :num_prompt_tokens] = request.prompt_token_ids
        end = num_prompt_tokens + len(request.output_token_ids)
        self.token_ids_cpu[req_index, num_prompt_tokens:end] = request.output_token_ids
        self.num_tokens_no_spec[req_index] = request.num_tokens
        self.num_computed_tokens_cpu[req_index] = request.num_computed_tokens
        self.block_table.add_row(request.block_ids, req_index)

        # BEGIN LAB 05.1: the row's sampling parameters and the sets of rows that need them
        # HINT: receives req_id and req_index, the row already holding the request's tokens;
        # HINT: leaves the row's temperature_cpu / top_p_cpu / top_k_cpu set and req_id in the
        # HINT: sets that say which rows need a feature.
        # HINT: Greedy (params.sampling_type_greedy): temperature 0.0 and greedy_reqs; else the
        # HINT: request's temperature and random_reqs. top_p < 1 joins top_p_reqs. A top_k in
        # HINT: 1 .. vocab_size - 1 joins top_k_reqs; any other top_k is stored as vocab_size.
        # HINT: A seeded request's generator is kept by row (self.generators); logprobs by
        # HINT: request id (-1 means the whole vocabulary); min_tokens by row, only while the
        # HINT: request has fewer outputs than min_tokens: (min_tokens, its output token list,
        # HINT: params.all_stop_token_ids).
        params = request.sampling_params
        if params.sampling_type_greedy:
            self.temperature_cpu[req_index] = 0.0  # never divided by
            self.greedy_reqs.add(req_id)
        else:
            self.temperature_cpu[req_index] = params.temperature
            self.random_reqs.add(req_id)
        self.top_p_cpu[req_index] = params.top_p
        if params.top_p < 1:
            self.top_p_reqs.add(req_id)
        top_k = params.top_k
        if 0 < top_k < self.vocab_size:
            self.top_k_reqs.add(req_id)
        else:
            top_k = self.vocab_size  # keeping the whole vocabulary is "off"
        self.top_k_cpu[req_index] = top_k
        if request.generator is not None:
            self.generators[req_index] = request.generator
        if params.logprobs is not None:
            wanted = self.vocab_size if params.logprobs == -1 else params.logprobs
            self.num_logprobs[req_id] = wanted
        if params.min_tokens and len(request.output_token_ids) < params.min_tokens:
            self.min_tokens[req_index] = (
                params.min_tokens,
                request.output_token_ids,
                params.all_stop_token_ids,
            )
        # END LAB 05.1
        self._add_penalties_and_masks(request, req_index)
        self._add_lora(request, req_index)
        self.batch_update_builder.added.append(
            (
                req_index,
                request.sampling_params,
                request.prompt_token_ids,
                request.output_token_ids,
            )
        )
        return req_index

    def _add_penalties_and_masks(self, request: CachedRequestState, req_index: int) -> None:
        """The row's penalties, allowed token ids and bad words, as upstream's add_request."""
        req_id, params = request.req_id, request.sampling_params
        self.frequency_penalties_cpu[req_index] = params.frequency_penalty
        if params.frequency_penalty != 0.0:
            self.frequency_penalties_reqs.add(req_id)
        self.presence_penalties_cpu[req_index] = params.presence_penalty
        if params.presence_penalty != 0.0:
            self.presence_penalties_reqs.add(req_id)
        self.repetition_penalties_cpu[req_index] = params.repetition_penalty
        if params.repetition_penalty != 1.0:
            self.repetition_penalties_reqs.add(req_id)
        if params.allowed_token_ids:
            self.allowed_token_ids[req_id] = params.allowed_token_ids
        if params.bad_words_token_ids:
            self.bad_words_token_ids[req_id] = params.bad_words_token_ids

    # BEGIN LAB 11.3: a new row's adapter
    def _add_lora(self, request: CachedRequestState, req_index: int) -> None:
        """Record the row's adapter id (0 without one), as upstream's add_request (:468-479)."""
        # HINT: a request without an adapter: its row's id is 0. Else its row holds the
        # HINT: adapter's lora_int_id, the request joins lora_id_to_request_ids[id], and
        # HINT: lora_id_to_lora_request[id] keeps its LoRARequest.
        if request.lora_request is None:
            self.request_lora_mapping[req_index] = 0
            return
        lora_id = request.lora_request.lora_int_id
        self.request_lora_mapping[req_index] = lora_id
        self.lora_id_to_request_ids.setdefault(lora_id, set()).add(request.req_id)
        self.lora_id_to_lora_request[lora_id] = request.lora_request

    # END LAB 11.3

    # BEGIN LAB 11.3: a leaving row's adapter
    def _remove_lora(self, req_id: str, req_index: int) -> None:
        """Forget the row's adapter; an adapter no request uses leaves the batch (:531-538)."""
        # HINT: read the row's id (0: nothing to do); take the request out of that id's set,
        # HINT: forget the id in both dicts when no request of the batch uses it any more,
        # HINT: and set the row's id back to 0.
        lora_id = int(self.request_lora_mapping[req_index])
        if lora_id == 0:
            return
        users = self.lora_id_to_request_ids[lora_id]
        users.discard(req_id)
        if not users:
            del self.lora_id_to_request_ids[lora_id]
            del self.lora_id_to_lora_request[lora_id]
        self.request_lora_mapping[req_index] = 0

    # END LAB 11.3

    # BEGIN LAB 11.3: the step's adapter id per sampled token and per scheduled token
    def make_lora_inputs(
        self, num_scheduled_tokens: np.ndarray, num_sampled_tokens: np.ndarray
    ) -> tuple[tuple[int, ...], tuple[int, ...], set[LoRARequest]]:
        """The step's adapter ids: one per sampled token (``prompt_lora_mapping``),
        one per scheduled token (``token_lora_mapping``), and the adapters the
        batch uses. Row i's id is repeated over its tokens, in row order."""
        # HINT: the first num_reqs rows' ids, each repeated by the row's count of sampled
        # HINT: tokens (prompt_lora_mapping) and of scheduled tokens (token_lora_mapping), as
        # HINT: tuples of ints; and the set of the batch's LoRARequests.
        ids = self.request_lora_mapping[: self.num_reqs]
        prompt_lora_mapping = tuple(int(i) for i in ids.repeat(num_sampled_tokens))
        token_lora_mapping = tuple(int(i) for i in ids.repeat(num_scheduled_tokens))
        return prompt_lora_mapping, token_lora_mapping, set(self.lora_id_to_lora_request.values())

    # END LAB 11.3

    def remove_request(self, req_id: str) -> int | None:
        """Leave a hole where ``req_id`` was; return its row (None if absent).

        ``condense`` must follow before the batch is used.
        """
        req_index = self.req_id_to_index.pop(req_id, None)
        if req_index is None:
            return None
        # BEGIN LAB 05.1: leave a hole: forget the row, keep the arrays as they are
        # HINT: receives req_id and req_index, its row (already gone from req_id_to_index);
        # HINT: leaves a hole at req_index: self.batch_update_builder.removed_append(req_index)
        # HINT: so add_request and condense find it, None in self._req_ids and in
        # HINT: self.req_output_token_ids, the block table row cleared, and the request gone
        # HINT: from every set and dict that names it, by id or by row.
        # HINT: Nothing moves: condense closes the holes once the step's additions are done.
        self.batch_update_builder.removed_append(req_index)
        self._req_ids[req_index] = None
        self.req_output_token_ids[req_index] = None
        self.block_table.clear_row(req_index)

        self.greedy_reqs.discard(req_id)
        self.random_reqs.discard(req_id)
        self.top_p_reqs.discard(req_id)
        self.top_k_reqs.discard(req_id)
        self.generators.pop(req_index, None)
        self.num_logprobs.pop(req_id, None)
        self.min_tokens.pop(req_index, None)
        # END LAB 05.1
        for reqs in (
            self.frequency_penalties_reqs,
            self.presence_penalties_reqs,
            self.repetition_penalties_reqs,
        ):
            reqs.discard(req_id)
        self.allowed_token_ids.pop(req_id, None)
        self.bad_words_token_ids.pop(req_id, None)
        self._remove_lora(req_id, req_index)
        return req_index

    # ------------------------------------------------------- moving rows

    def swap_states(self, i1: int, i2: int) -> None:
        """Exchange rows ``i1`` and ``i2`` (both hold requests), every array included."""
        id1, id2 = self._req_ids[i1], self._req_ids[i2]
        if id1 is None or id2 is None:
            raise ValueError(f"swap_states needs two requests; row {i1} or {i2} is a hole.")
        # Only the tokens in use move; the rest of each row is stale anyway.
        n = max(self.num_tokens_no_spec[i1], self.num_tokens_no_spec[i2])
        self._req_ids[i1], self._req_ids[i2] = id2, id1
        self.req_id_to_index[id1], self.req_id_to_index[id2] = i2, i1
        out = self.req_output_token_ids
        out[i1], out[i2] = out[i2], out[i1]
        pair, flipped = [i1, i2], [i2, i1]
        # Fancy indexing on the right copies, so each pair swaps safely.
        self.token_ids_cpu[pair, :n] = self.token_ids_cpu[flipped, :n]
        for array in self.per_row_arrays():
            array[pair] = array[flipped]
        self.block_table.swap_row(i1, i2)
        for by_row in (self.generators, self.min_tokens):
            v1, v2 = by_row.pop(i1, None), by_row.pop(i2, None)
            if v1 is not None:
                by_row[i2] = v1
            if v2 is not None:
                by_row[i1] = v2
        self.batch_update_builder.moved.append((i1, i2, MoveDirectionality.SWAP))
        self.batch_update_builder.batch_changed = True

    def condense(self) -> None:
        """Move the highest rows down into the holes until rows 0 .. num_reqs - 1 are full."""
        num_reqs = self.num_reqs
        empty_req_indices = self.batch_update_builder.removed  # descending
        if not empty_req_indices:
            return  # no removals, or new requests filled every hole
        if num_reqs == 0:
            self._req_ids.clear()
            self.req_output_token_ids.clear()
            return
        # BEGIN LAB 05.1: fill the lowest hole with the highest request, until none is left below
        # HINT: receives num_reqs and empty_req_indices (the holes, highest first; the builder's
        # HINT: peek_removed() / pop_removed() give the lowest); leaves rows 0 .. num_reqs - 1
        # HINT: full, each move made by self._move_row(highest request row, lowest hole).
        # HINT: The highest row in use starts at num_reqs + len(holes) - 1 and skips holes.
        # HINT: Stop when the lowest hole is not below the highest request: what is left are
        # HINT: holes past the batch, cut off after the region.
        last_req_index = num_reqs + len(empty_req_indices) - 1
        while empty_req_indices:
            while last_req_index in empty_req_indices:
                last_req_index -= 1  # the highest row that holds a request
            empty_index = self.batch_update_builder.peek_removed()  # the lowest hole
            if empty_index >= last_req_index:
                break  # the remaining holes all lie past the last request
            self.batch_update_builder.pop_removed()
            self._move_row(last_req_index, empty_index)
            last_req_index -= 1
        # END LAB 05.1
        del self._req_ids[num_reqs:]
        del self.req_output_token_ids[num_reqs:]

    # BEGIN LAB 05.1: move a request, and everything of its row, down into a hole
    def _move_row(self, src: int, tgt: int) -> None:
        """Move the request in row ``src`` to the hole at row ``tgt``."""
        # HINT: Everything that is per row moves: the id (and req_id_to_index), the output list,
        # HINT: the tokens in use (num_tokens_no_spec of them), every array of
        # HINT: self.per_row_arrays(), the block table row (block_table.move_row) and the
        # HINT: generators and min_tokens entries, which are keyed by row. src becomes a hole.
        # HINT: The logits processors hear of the move: append (src, tgt,
        # HINT: MoveDirectionality.UNIDIRECTIONAL) to self.batch_update_builder.moved.
        req_id = self._req_ids[src]
        self._req_ids[tgt], self._req_ids[src] = req_id, None
        out = self.req_output_token_ids
        out[tgt], out[src] = out[src], None
        self.req_id_to_index[req_id] = tgt
        n = self.num_tokens_no_spec[src]
        self.token_ids_cpu[tgt, :n] = self.token_ids_cpu[src, :n]
        for array in self.per_row_arrays():
            array[tgt] = array[src]
        self.block_table.move_row(src, tgt)
        for by_row in (self.generators, self.min_tokens):
            value = by_row.pop(src, None)
            if value is not None:
                by_row[tgt] = value
        self.batch_update_builder.moved.append((src, tgt, MoveDirectionality.UNIDIRECTIONAL))

    # END LAB 05.1

    # ------------------------------------------------------- sampling metadata

    def refresh_metadata(self) -> None:
        """End the step's edits: rebuild ``sampling_metadata`` if the batch changed.

        The min_tokens rows are re-checked every step, as upstream's
        MinTokensLogitsProcessor does, since outputs grow without the batch
        changing. The logits processors hear of every added, removed and
        moved row through one ``BatchUpdate`` (None if nothing changed).
        """
        batch_changed = self.batch_update_builder.batch_changed
        batch_update = self.batch_update_builder.get_and_reset(self.num_reqs)
        batch_changed = batch_changed or batch_update is not None
        for processor in self.logitsprocs.all:
            processor.update_state(batch_update)
        reached = [i for i, (n, out, _) in self.min_tokens.items() if len(out) >= n]
        for index in reached:
            del self.min_tokens[index]
        if batch_changed:
            self.sampling_metadata = self._make_sampling_metadata()
        elif reached:
            self.sampling_metadata.min_tokens_blocked = self._min_tokens_blocked()

    def _min_tokens_blocked(self) -> dict[int, list[int]]:
        return {i: sorted(stop) for i, (_, _, stop) in self.min_tokens.items() if stop}

    def _make_sampling_metadata(self) -> SamplingMetadata:
        num_reqs = self.num_reqs
        temperature = copy_slice(self.temperature_cpu_tensor, self.temperature, num_reqs)
        if not self.no_top_p:
            copy_slice(self.top_p_cpu_tensor, self.top_p, num_reqs)
        if not self.no_top_k:
            copy_slice(self.top_k_cpu_tensor, self.top_k, num_reqs)
        prompt_token_ids = None
        if not self.no_penalties:
            copy_slice(self.frequency_penalties_cpu_tensor, self.frequency_penalties, num_reqs)
            copy_slice(self.presence_penalties_cpu_tensor, self.presence_penalties, num_reqs)
            copy_slice(self.repetition_penalties_cpu_tensor, self.repetition_penalties, num_reqs)
            prompt_token_ids = self._make_prompt_token_ids_cpu_tensor().to(self.device)
        rows = self.req_id_to_index
        bad_words = {rows[r]: words for r, words in self.bad_words_token_ids.items()}
        allowed = {rows[r]: ids for r, ids in self.allowed_token_ids.items()}
        mask = allowed_token_ids_mask(allowed, num_reqs, self.vocab_size)  # bool [B, V] or None
        needs_output_token_ids = not self.no_penalties or bool(bad_words)
        return SamplingMetadata(
            temperature=temperature,  # float32 [num_reqs]
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            top_p=None if self.no_top_p else self.top_p[:num_reqs],  # float32 [num_reqs]
            top_k=None if self.no_top_k else self.top_k[:num_reqs],  # int64 [num_reqs]
            generators=self.generators,
            max_num_logprobs=self.max_num_logprobs,
            no_penalties=self.no_penalties,
            prompt_token_ids=prompt_token_ids,
            frequency_penalties=self.frequency_penalties[:num_reqs],
            presence_penalties=self.presence_penalties[:num_reqs],
            repetition_penalties=self.repetition_penalties[:num_reqs],
            output_token_ids=self.req_output_token_ids if needs_output_token_ids else [],
            allowed_token_ids_mask=None if mask is None else mask.to(self.device),
            bad_words_token_ids=bad_words,
            logitsprocs=self.logitsprocs,
            min_tokens_blocked=self._min_tokens_blocked(),
        )

    def _make_prompt_token_ids_cpu_tensor(self) -> torch.Tensor:
        """int64 [num_reqs, longest prompt]: each row's prompt, padded with vocab_size."""
        num_reqs = self.num_reqs
        width = int(self.num_prompt_tokens[:num_reqs].max())
        prompt = torch.from_numpy(self.token_ids_cpu[:num_reqs, :width]).long()  # [B, width]
        lengths = torch.from_numpy(self.num_prompt_tokens[:num_reqs]).long()  # [B]
        padding = torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)  # bool [B, width]
        return prompt.masked_fill(padding, self.vocab_size)
