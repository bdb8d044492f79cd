"""Turns a SchedulerOutput into one forward pass and one sampled token per request.

Mirrors upstream ``vllm/v1/worker/gpu_model_runner.py`` (``GPUModelRunner``
:415: ``_may_reorder_batch`` :1054, ``_update_states`` :1116,
``_prepare_inputs`` :1863, ``_calc_spec_decode_metadata`` :2713, ``_sample``
:3481, ``_bookkeeping_sync`` :3512, ``execute_model`` :3955,
``take_draft_token_ids`` :4637, ``propose_draft_token_ids`` :4750;
multimodal: ``_execute_mm_encoder`` :2860, ``_gather_mm_embeddings`` :3071;
CUDA graphs: ``capture_model`` :6373) at v0.22.1.
CUDA graphs (Phase 18): on CUDA, with the Triton backend and not
``enforce_eager``, the decode-only steps run from FULL graphs captured at
start-up, one per capture size, padded to it (``CudagraphDispatcher``);
every other step runs eagerly. Graphs are off with LoRA, speculation, a KV
connector, a multimodal model, prompt embeddings or several KV-cache groups.
Left out: piecewise graphs, graphs of mixed batches, async scheduling and async
output copies, draft-model and EAGLE speculation, multimodal modalities
other than images and the encoder-cache connector, pooling,
prompt logprobs, pipeline parallelism; see UPSTREAM_PIN.md.

One step:

1. ``_update_states`` applies the SchedulerOutput's deltas to the runner's
   copy of every request (``requests``, ``CachedRequestState``) and to the
   persistent batch (``input_batch``, mini_vllm/worker/gpu_input_batch.py):
   finished and unscheduled requests leave the batch, new requests join it
   whole, running ones get their computed count and new blocks, resumed
   ones get a new block table and join again; then ``condense``, the
   decode-first reorder if the attention backend asks for it, and
   ``refresh_metadata``. The runner reads nothing but the SchedulerOutput:
   the tokens it samples it appends itself, so the scheduler never resends
   them.
2. ``_prepare_inputs`` lays out the step's tokens in batch-row order in
   buffers allocated once at their largest size (input ids, positions,
   query_start_loc, seq_lens, and the batch's block table and slot mapping).
3. The model runs; every row's last token gives logits, and the sampler
   draws one token per row from ``input_batch.sampling_metadata``. A
   multimodal model first encodes the images the scheduler scheduled
   (``scheduled_encoder_inputs``) into ``encoder_cache``, and runs on
   embeddings: the step's token embeddings with the encoder rows its chunks
   cover written over their placeholder positions.
4. ``_bookkeeping_sync`` throws away the tokens of rows still mid-prefill
   and appends the others to the batch and to the request states.

With n-gram speculation (``VllmConfig.speculative_config``) a decoding row
also carries the drafts the scheduler scheduled for it: they are written
after its real tokens in ``token_ids_cpu``, so they go through the forward
like any other token; the logits at the row's last ``1 + drafts`` positions
are kept (``SpecDecodeMetadata``), the ``RejectionSampler`` keeps the
accepted drafts plus one token of the target's own, and after bookkeeping
the ``NgramProposer`` drafts the next step's guesses from each row's tokens
(``take_draft_token_ids`` hands them to the engine). The KV written for
rejected drafts is simply overwritten next step: the scheduler has rolled
``num_computed_tokens`` back before it.

Invariant: between steps, for every request in the batch, row ``i`` of
``token_ids_cpu`` holds its prompt then its output tokens
(``num_tokens_no_spec[i]`` of them) and equals its ``CachedRequestState``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from mini_vllm.attention.backend import AttentionMetadata
from mini_vllm.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
from mini_vllm.compilation.cuda_graph import CUDAGraphWrapper
from mini_vllm.compilation.decorators import enable_torch_compile
from mini_vllm.config import CUDAGraphMode, VllmConfig
from mini_vllm.core.sched.output import GrammarOutput, SchedulerOutput
from mini_vllm.cudagraph_dispatcher import CudagraphDispatcher
from mini_vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from mini_vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from mini_vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context
from mini_vllm.kv_cache_interface import KVCacheConfig
from mini_vllm.lora.model_manager import LRUCacheLoRAModelManager
from mini_vllm.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    DraftTokenIds,
    KVConnectorOutput,
    ModelRunnerOutput,
)
from mini_vllm.sample.logits_processor import (
    LogitBiasLogitsProcessor,
    LogitsProcessors,
    MinPLogitsProcessor,
)
from mini_vllm.sample.rejection_sampler import RejectionSampler
from mini_vllm.sample.sampler import Sampler, SamplerOutput
from mini_vllm.spec_decode.metadata import SpecDecodeMetadata
from mini_vllm.spec_decode.ngram_proposer import NgramProposer
from mini_vllm.structured_output.utils import apply_grammar_bitmask
from mini_vllm.utils import CpuGpuBuffer
from mini_vllm.worker.block_table import PAD_SLOT_ID
from mini_vllm.worker.gpu_input_batch import CachedRequestState, InputBatch

logger = logging.getLogger(__name__)


@dataclass
class PreparedInputs:
    """One step's model inputs (``_prepare_inputs``), views into the runner's
    buffers; num_tokens is the step's number of scheduled tokens."""

    input_ids: torch.Tensor  # int32 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    # One metadata, or one per layer name when the model has several KV-cache groups.
    attn_metadata: AttentionMetadata | dict[str, AttentionMetadata]
    logits_indices: torch.Tensor  # int32 [num_reqs]: each row's last token
    # bool [num_reqs]: rows whose sampled token is thrown away (still mid-prefill)
    discard_request_mask: np.ndarray
    # Where the drafts' logits rows are, when this step verifies drafts.
    spec_decode_metadata: SpecDecodeMetadata | None = None


def reorder_threshold_of(model: torch.nn.Module) -> int | None:
    """The smallest ``reorder_batch_threshold`` the model's attention layers ask
    for (None: no reordering), as upstream's ``calculate_reorder_batch_threshold``."""
    wanted = [
        layer.impl.reorder_batch_threshold
        for layer in model.attention_layers()
        if layer.impl is not None and layer.impl.reorder_batch_threshold is not None
    ]
    return min(wanted) if wanted else None


class GPUModelRunner:
    def __init__(
        self,
        vllm_config: VllmConfig,
        model: torch.nn.Module,
        device: torch.device,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        """``kv_cache_config``: the model's KV-cache groups, one block table
        each; None: one full-attention group of ``cache_config.block_size``."""
        self.model = model
        self.kv_cache_config = kv_cache_config
        self.device = torch.device(device)
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        # A multimodal model keeps its vocabulary in its text config.
        self.vocab_size = (getattr(model.config, "text_config", None) or model.config).vocab_size
        self.reorder_batch_threshold = reorder_threshold_of(model)

        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            device=self.device,
            pin_memory=False,
            vocab_size=self.vocab_size,
            block_sizes=[self.block_size]
            if kv_cache_config is None
            else [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups],
            logitsprocs=build_logitsprocs(vllm_config, self.device),
        )
        self.sampler = Sampler(vllm_config.model_config.logprobs_mode)
        # The worker half of the KV connector (Phase 15), given the paged KV
        # tensors it loads into and saves from (upstream: the worker builds it
        # in ensure_kv_transfer_initialized, then register_kv_caches).
        self.kv_connector: KVConnectorBase_V1 | None = None
        # mini only (a connector call that raised): finished ids get_finished
        # has not taken yet, and requests whose save was lost.
        self._kv_finished_req_ids: set[str] = set()
        self._kv_saves_lost: set[str] = set()
        if vllm_config.kv_transfer_config is not None:
            self.kv_connector = KVConnectorFactory.create_connector(
                vllm_config, KVConnectorRole.WORKER, kv_cache_config
            )
            self.kv_connector.register_kv_caches(
                {layer.layer_name: layer.kv_cache for layer in model.attention_layers()}
            )
        # LoRA (Phase 11): the adaptable layers wrapped, adapters in slots
        # (upstream's LoRAModelRunnerMixin.load_lora_model).
        self.lora_manager: LRUCacheLoRAModelManager | None = None
        if vllm_config.lora_config is not None:
            self.lora_manager = LRUCacheLoRAModelManager(
                model, vllm_config.lora_config, next(model.parameters()).dtype, self.device
            )
        # torch.compile (Phase 18): the decorated model classes compile on
        # their first call when the mode asks for it (LoRA turned it off).
        enable_torch_compile(model, vllm_config.compilation_config)
        # N-gram speculation: the proposer drafts after each step, the
        # rejection sampler verifies the drafts the next step.
        spec = vllm_config.speculative_config
        self.drafter: NgramProposer | None = None
        if spec is not None:
            self.drafter = NgramProposer(
                spec.prompt_lookup_min,
                spec.prompt_lookup_max,
                spec.num_speculative_tokens,
                self.max_model_len,
            )
            self.rejection_sampler = RejectionSampler(self.sampler)
        self._draft_token_ids: list[list[int]] | None = None

        # Buffers at their largest size, reused every step (their device
        # addresses never change, which CUDA graphs will need).
        def buffer(*size: int, dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(*size, dtype=dtype, device=self.device, pin_memory=False)

        self.input_ids = buffer(self.max_num_tokens, dtype=torch.int32)
        self.positions = buffer(self.max_num_tokens, dtype=torch.int64)
        self.query_start_loc = buffer(self.max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = buffer(self.max_num_reqs, dtype=torch.int32)
        # [0, 1, 2, ...], never written: the source of every per-step arange.
        self.arange_np = np.arange(max(self.max_num_reqs + 1, self.max_num_tokens), dtype=np.int64)

        # Seconds spent in the model forward + sampling, for the bench's
        # "time outside the model" figure.
        self.forward_time = 0.0

        # A multimodal model (Phase 13): the encoder's outputs, one tensor
        # [num_embeds, hidden] per item hash, kept from the step that encodes
        # an item until the scheduler frees it (upstream's encoder_cache,
        # gpu_model_runner.py:528), and the seconds spent encoding.
        self.supports_mm_inputs = hasattr(model, "embed_multimodal")
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.encoder_time = 0.0

        # CUDA graphs (Phase 18): which graph a step replays, if any.
        self.vllm_config = vllm_config
        self.cudagraph_dispatcher = CudagraphDispatcher(vllm_config)
        self.capture_model()

        # Phase 19 (vLLM v0's swapping, not upstream v1): a CPU swap space of
        # cache_config.num_cpu_blocks blocks, one tensor per attention layer,
        # made on the first swap; the seconds spent copying blocks.
        self.num_cpu_blocks = vllm_config.cache_config.num_cpu_blocks or 0
        self.cpu_kv_caches: list[torch.Tensor] | None = None
        self.swap_time = 0.0

    # ---------------------------------------------------------------- states

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the step's deltas to ``requests`` and to ``input_batch``."""
        batch = self.input_batch
        cached = scheduler_output.scheduled_cached_reqs
        # Encoder outputs the scheduler no longer needs (gpu_model_runner.py:1148).
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        # BEGIN LAB 05.3: who leaves the batch: finished requests, and those not scheduled now
        # HINT: receives the step's scheduler_output; leaves in the batch only the requests
        # HINT: scheduled this step that were there before: every other req_id's row is a hole
        # HINT: (batch.remove_request).
        # HINT: A finished request is also forgotten (self.requests); an unscheduled one
        # HINT: (preempted, or left out of this step) keeps its state for when it comes back.
        # HINT: A resumed request (cached.resumed_req_ids) is re-added below, so it leaves too.
        # Finished: forget the request. An id both finished and scheduled
        # again (aborted, then resubmitted) is treated as a new request.
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)

        # Unscheduled (preempted, or left out of this step): leave the batch,
        # keep the state for when they come back. A resumed request is
        # re-added below, so it leaves the batch too if it is still there.
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        for req_id in batch.req_id_to_index.keys() - (scheduled - cached.resumed_req_ids):
            batch.remove_request(req_id)
        # END LAB 05.3

        reqs_to_add: list[CachedRequestState] = []
        # BEGIN LAB 05.3: a new request: the runner's own state, joining the batch whole
        # HINT: receives scheduler_output.scheduled_new_reqs; leaves a CachedRequestState
        # HINT: state for each in self.requests and in reqs_to_add.
        # HINT: Copy the block id lists (the runner extends them in later steps), start with no
        # HINT: output tokens, and give a random request (not params.sampling_type_greedy) with
        # HINT: a seed its own torch.Generator on self.device, seeded with it.
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.sampling_type_greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=params,
                generator=generator,
                # The runner's own lists: it extends them in later steps.
                block_ids=tuple(list(group) for group in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
            )
            self.requests[new.req_id] = state
            reqs_to_add.append(state)
        # END LAB 05.3

        # BEGIN LAB 05.3: a running or resumed request: apply the step's deltas
        # HINT: receives cached (parallel lists by i: req_ids, num_computed_tokens,
        # HINT: new_block_ids, each a tuple of lists per group or None) and reqs_to_add; leaves
        # HINT: each request's state updated, and the ones not in the batch in reqs_to_add.
        # HINT: The state always takes the new num_computed_tokens. Its block ids: a resumed
        # HINT: request's are replaced by the new ones (its old blocks were freed); a running
        # HINT: one's are extended. A request still in the batch (batch.req_id_to_index) gets
        # HINT: its row edited in place: num_computed_tokens_cpu and
        # HINT: batch.block_table.append_row; the others join again with their whole state.
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            req_index = batch.req_id_to_index.get(req_id)
            state.num_computed_tokens = num_computed_tokens
            if req_id in cached.resumed_req_ids:
                # Its blocks were freed at preemption: the new ones replace them.
                if new_block_ids is None:
                    raise ValueError(f"Resumed request {req_id!r} came without block ids.")
                state.block_ids = tuple(list(ids) for ids in new_block_ids)
            elif new_block_ids is not None:
                for ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                    ids.extend(new_ids)
            if req_index is None:
                # Resumed, or back after a step without it. Its output tokens
                # are the ones this runner sampled (synchronous scheduling:
                # upstream reloads them from all_token_ids only under async
                # scheduling, gpu_model_runner.py:1380).
                reqs_to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[req_index] = num_computed_tokens
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, req_index)
        # END LAB 05.3

        # Output tokens the scheduler threw away (their step read KV that
        # failed to load, Phase 15): drop them here too
        # (mirrors vllm/v1/worker/gpu_model_runner.py:1347-1356).
        for cached_id, num_output_tokens in zip(
            cached.req_ids, cached.num_output_tokens, strict=True
        ):
            kept = self.requests[cached_id].output_token_ids
            if num_output_tokens < len(kept):
                del kept[num_output_tokens:]
                row = batch.req_id_to_index.get(cached_id)
                if row is not None:
                    batch.num_tokens_no_spec[row] = batch.num_prompt_tokens[row] + num_output_tokens

        # The adapter a new request runs with (LoRA, Phase 11), and its images (Phase 13).
        for new_req in scheduler_output.scheduled_new_reqs:
            self.requests[new_req.req_id].lora_request = new_req.lora_request
            self.requests[new_req.req_id].mm_features = list(new_req.mm_features)
            self.requests[new_req.req_id].prompt_embeds = new_req.prompt_embeds
        # New and returning requests fill the lowest holes first.
        for state in reqs_to_add:
            batch.add_request(state)
        batch.condense()
        self._may_reorder_batch(scheduler_output)
        self._write_spec_token_ids(scheduler_output)
        batch.refresh_metadata()

    # BEGIN LAB 08.4: the scheduled drafts go right after each row's real tokens
    def _write_spec_token_ids(self, scheduler_output: SchedulerOutput) -> None:
        """Put each row's scheduled drafts right after its real tokens in
        ``token_ids_cpu`` (``num_tokens_no_spec`` does not count them), as
        upstream's ``InputBatch.update_req_spec_token_ids``. Done once the
        rows are final: condense and reorder move only the real tokens."""
        # HINT: scheduler_output.scheduled_spec_decode_tokens: req_id -> its drafts;
        # HINT: self.input_batch.req_id_to_index gives the row.
        batch = self.input_batch
        for req_id, draft_ids in scheduler_output.scheduled_spec_decode_tokens.items():
            req_index = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens_no_spec[req_index])
            batch.token_ids_cpu[req_index, start : start + len(draft_ids)] = draft_ids

    # END LAB 08.4

    def _may_reorder_batch(self, scheduler_output: SchedulerOutput) -> None:
        """Decodes first, if the attention backend asks for it."""
        if self.reorder_batch_threshold is not None:
            reorder_batch_to_split_decodes_and_prefills(
                self.input_batch, scheduler_output, decode_threshold=self.reorder_batch_threshold
            )

    # ---------------------------------------------------------------- inputs

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput, num_scheduled_tokens: np.ndarray
    ) -> PreparedInputs:
        """The step's flat batch: each row's scheduled tokens, row after row.

        ``num_scheduled_tokens`` (int32 [num_reqs]) is in batch-row order.
        """
        batch = self.input_batch
        num_reqs = batch.num_reqs
        total = scheduler_output.total_num_scheduled_tokens
        block_table = self.prepare_block_table(num_reqs)
        cu_num_tokens = self.prepare_input_ids_and_positions(num_scheduled_tokens)

        # query_start_loc: [0, q0, q0+q1, ...]; padded past num_reqs with the
        # total, so it never decreases.
        qsl = self.query_start_loc
        qsl.np[0] = 0
        qsl.np[1 : num_reqs + 1] = cu_num_tokens
        qsl.np[num_reqs + 1 :] = total
        qsl.copy_to_gpu()
        query_start_loc = qsl.gpu[: num_reqs + 1]
        # seq_lens: tokens in the KV cache once this step has run.
        seq_lens_np = self.seq_lens.np[:num_reqs]
        np.add(batch.num_computed_tokens_cpu[:num_reqs], num_scheduled_tokens, out=seq_lens_np)
        self.seq_lens.np[num_reqs:] = 0
        seq_lens = self.seq_lens.copy_to_gpu()[:num_reqs]

        spec_decode_metadata = None
        logits_indices = query_start_loc[1:] - 1  # every row samples from its last token
        if scheduler_output.scheduled_spec_decode_tokens:
            spec = scheduler_output.scheduled_spec_decode_tokens
            num_draft_tokens = np.array(
                [len(spec.get(req_id, ())) for req_id in batch.req_ids], dtype=np.int32
            )  # [num_reqs]
            spec_decode_metadata = self._calc_spec_decode_metadata(num_draft_tokens, cu_num_tokens)
            logits_indices = spec_decode_metadata.logits_indices

        slot_mapping = self.prepare_slot_mapping(num_reqs, query_start_loc, total)
        attn_metadata = AttentionMetadata(
            num_actual_tokens=total,
            max_query_len=int(num_scheduled_tokens.max()),
            query_start_loc=query_start_loc,
            max_seq_len=int(seq_lens_np.max()),
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
        )
        if self.kv_cache_config is not None and len(self.kv_cache_config.kv_cache_groups) > 1:
            attn_metadata = self._metadata_per_layer(attn_metadata, num_reqs, total)
        return PreparedInputs(
            input_ids=self.input_ids.gpu[:total],
            positions=self.positions.gpu[:total],
            attn_metadata=attn_metadata,
            # Every row samples from its last token (gpu_model_runner.py:2135),
            # or from its last 1 + drafts tokens when verifying drafts ...
            logits_indices=logits_indices,
            # ... and a row whose prompt is not done throws its token away.
            discard_request_mask=seq_lens_np < batch.num_tokens_no_spec[:num_reqs],
            spec_decode_metadata=spec_decode_metadata,
        )

    # ------------------------------------------------------------ multimodal

    def _execute_mm_encoder(self, scheduler_output: SchedulerOutput) -> list[torch.Tensor]:
        """Encode the items the scheduler scheduled this step, all in one batch,
        and keep each output in ``encoder_cache`` under the item's hash
        (mirrors gpu_model_runner.py:2817 ``_batch_mm_inputs_from_scheduler``
        and :2860 ``_execute_mm_encoder``; every item here is an image)."""
        mm_hashes: list[str] = []
        pixel_values: list[torch.Tensor] = []
        for req_id, encoder_input_ids in scheduler_output.scheduled_encoder_inputs.items():
            req_state = self.requests[req_id]
            for mm_input_id in encoder_input_ids:
                mm_feature = req_state.mm_features[mm_input_id]
                if mm_feature.data is None:
                    continue
                mm_hashes.append(mm_feature.identifier)
                pixel_values.append(mm_feature.data["pixel_values"])
        if not pixel_values:
            return []
        start = time.perf_counter()
        batch = torch.stack(pixel_values).to(self.device)  # [items, C, H, W]
        encoder_outputs = self.model.embed_multimodal(pixel_values=batch)
        if len(encoder_outputs) != len(mm_hashes):
            raise RuntimeError(
                f"the encoder returned {len(encoder_outputs)} outputs for {len(mm_hashes)} items"
            )
        for mm_hash, output in zip(mm_hashes, encoder_outputs, strict=True):
            self.encoder_cache[mm_hash] = output
        self.encoder_time += time.perf_counter() - start
        return encoder_outputs

    # BEGIN LAB 13.3: the encoder rows this step's tokens need, and where they go
    # mirrors vllm/v1/worker/gpu_model_runner.py:3071-3140
    def _gather_mm_embeddings(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The encoder rows this step's tokens need, in batch order, and the
        mask of the step's token positions they go to (bool [num_tokens]).

        A request's chunk covers prompt positions ``[computed, computed +
        scheduled)``; an image covers ``[offset, offset + length)``. Where they
        overlap, those rows of the image's encoder output are taken: a chunk
        that cuts through an image takes only its part, and the next chunk
        the rest (read from the encoder cache, not encoded again)."""
        # HINT: requests in batch order (self.input_batch.req_ids); each one's tokens
        # HINT: follow the previous one's in the step. self.requests[req_id] has
        # HINT: num_computed_tokens and mm_features; self.encoder_cache[identifier] is an
        # HINT: image's output [num_embeds, hidden]. With an is_embed mask, only its True
        # HINT: positions take rows: PlaceholderRange.get_embeds_indices_in_range maps a
        # HINT: placeholder range to output rows.
        total = scheduler_output.total_num_scheduled_tokens
        mm_embeds: list[torch.Tensor] = []
        is_mm_embed = torch.zeros(total, dtype=torch.bool)
        req_start_idx = 0  # where this request's tokens start in the step
        for req_id in self.input_batch.req_ids:
            num_scheduled_tokens = scheduler_output.num_scheduled_tokens[req_id]
            req_state = self.requests[req_id]
            num_computed_tokens = req_state.num_computed_tokens
            for mm_feature in req_state.mm_features:
                pos_info = mm_feature.mm_position
                start_pos, num_encoder_tokens = pos_info.offset, pos_info.length
                if start_pos >= num_computed_tokens + num_scheduled_tokens:
                    break  # this image, and every later one, comes in a later step
                if start_pos + num_encoder_tokens <= num_computed_tokens:
                    continue  # already in the KV cache
                # The overlap, relative to the image's first placeholder.
                start_idx = max(num_computed_tokens - start_pos, 0)
                end_idx = min(
                    num_computed_tokens - start_pos + num_scheduled_tokens, num_encoder_tokens
                )
                embeds_start, embeds_end = pos_info.get_embeds_indices_in_range(start_idx, end_idx)
                if embeds_start == embeds_end:
                    continue
                encoder_output = self.encoder_cache.get(mm_feature.identifier)
                if encoder_output is None:
                    raise RuntimeError(f"Encoder cache miss for {mm_feature.identifier}.")
                # This request's first placeholder position, in the step's tokens.
                req_start_pos = req_start_idx + start_pos - num_computed_tokens
                if pos_info.is_embed is None:
                    is_mm_embed[req_start_pos + start_idx : req_start_pos + end_idx] = True
                else:
                    is_mm_embed[req_start_pos + start_idx : req_start_pos + end_idx] |= (
                        pos_info.is_embed[start_idx:end_idx]
                    )
                mm_embeds.append(encoder_output[embeds_start:embeds_end])
            req_start_idx += num_scheduled_tokens
        return mm_embeds, is_mm_embed

    # END LAB 13.3

    # BEGIN LAB 08.4: which logits rows verify which drafts
    def _calc_spec_decode_metadata(
        self, num_draft_tokens: np.ndarray, cu_num_scheduled_tokens: np.ndarray
    ) -> SpecDecodeMetadata:
        """Which logits rows verify which drafts. A row with d drafts keeps
        the logits of its last d + 1 tokens: d "target" rows (the model's
        opinion at each draft's position) and one "bonus" row after them.

        Drafts [3, 0, 2] with cumulative scheduled tokens [4, 104, 107] give
        logits_indices [0, 1, 2, 3, 103, 104, 105, 106], target rows
        [0, 1, 2, 5, 6] and bonus rows [3, 4, 7] (of the kept logits).
        """
        # HINT: num_draft_tokens: int32 [num_reqs], in batch-row order; cu_num_scheduled_tokens:
        # HINT: the running total of each row's scheduled tokens (its drafts included).
        # HINT: a row with d drafts keeps the logits of its LAST d + 1 scheduled tokens.
        # HINT: cumulative counts have no leading zero; self.arange_np is 0, 1, 2, ...
        # HINT: the draft ids are read back from self.input_ids.gpu: a draft is the input
        # HINT: token right after its target position. Every index tensor int32, on self.device.
        num_sampled_tokens = num_draft_tokens + 1  # [num_reqs]
        cu_num_sampled_tokens = np.cumsum(num_sampled_tokens, dtype=np.int32)  # [num_reqs]
        cu_num_draft_tokens = np.cumsum(num_draft_tokens, dtype=np.int32)  # [num_reqs]
        # Each kept position's offset inside its own row's block of kept rows.
        sampled_offsets = self.arange_np[: cu_num_sampled_tokens[-1]] - np.repeat(
            cu_num_sampled_tokens - num_sampled_tokens, num_sampled_tokens
        )  # [num_logits]
        logits_indices = (
            np.repeat(cu_num_scheduled_tokens - num_sampled_tokens, num_sampled_tokens)
            + sampled_offsets
        )  # [num_logits]
        draft_offsets = self.arange_np[: cu_num_draft_tokens[-1]] - np.repeat(
            cu_num_draft_tokens - num_draft_tokens, num_draft_tokens
        )  # [num_drafts]
        target_logits_indices = (
            np.repeat(cu_num_sampled_tokens - num_sampled_tokens, num_draft_tokens) + draft_offsets
        )  # [num_drafts]
        bonus_logits_indices = cu_num_sampled_tokens - 1  # [num_reqs]
        # The drafts are the input tokens right after each target position.
        input_ids = self.input_ids.gpu
        draft_positions = torch.from_numpy(logits_indices[target_logits_indices] + 1)
        draft_token_ids = input_ids[draft_positions.to(self.device)]

        def to_device(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a.astype(np.int32)).to(self.device)

        return SpecDecodeMetadata(
            draft_token_ids=draft_token_ids.to(torch.int32),  # [num_drafts]
            num_draft_tokens=num_draft_tokens.tolist(),
            cu_num_draft_tokens=to_device(cu_num_draft_tokens),
            cu_num_sampled_tokens=to_device(cu_num_sampled_tokens),
            target_logits_indices=to_device(target_logits_indices),
            bonus_logits_indices=to_device(bonus_logits_indices),
            logits_indices=to_device(logits_indices),
        )

    # END LAB 08.4

    def prepare_input_ids_and_positions(self, num_scheduled_tokens: np.ndarray) -> np.ndarray:
        """Fill ``positions`` and ``input_ids`` for the step's tokens, in batch
        order; return the running total of tokens per row ([num_reqs])."""
        batch = self.input_batch
        num_reqs = len(num_scheduled_tokens)
        # The batch row of every token: [2, 3] -> [0, 0, 1, 1, 1].
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)
        # [2, 3] -> [2, 5]; each token's offset in its row's chunk: [0, 1, 0, 1, 2].
        cu_num_tokens = np.cumsum(num_scheduled_tokens)
        total = int(cu_num_tokens[-1])
        offsets = self.arange_np[:total] - np.repeat(
            cu_num_tokens - num_scheduled_tokens, num_scheduled_tokens
        )
        positions_np = self.positions.np[:total]
        np.add(batch.num_computed_tokens_cpu[req_indices], offsets, out=positions_np)
        # Token (row r, position p) sits at r * max_model_len + p of the
        # flattened token table: one gather fetches them all.
        token_indices = torch.from_numpy(positions_np + req_indices * self.max_model_len)
        torch.index_select(
            batch.token_ids_cpu_tensor.flatten(),
            0,
            token_indices,
            out=self.input_ids.cpu[:total],
        )
        self.input_ids.copy_to_gpu(total)
        self.positions.copy_to_gpu(total)
        return cu_num_tokens

    def _metadata_per_layer(
        self, group0: AttentionMetadata, num_reqs: int, num_tokens: int
    ) -> dict[str, AttentionMetadata]:
        """Several KV-cache groups: each group's metadata is group 0's with its
        own block table and slot mapping (both already committed and computed
        for every group), handed to each layer by name, as upstream's forward
        context does."""
        per_layer = {}
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            table = self.input_batch.block_table[g]
            metadata = dataclasses.replace(
                group0,
                block_table=table.get_device_tensor(num_reqs),
                slot_mapping=table.slot_mapping.gpu[:num_tokens],
            )
            per_layer.update(dict.fromkeys(group.layer_names, metadata))
        return per_layer

    def prepare_block_table(self, num_reqs: int) -> torch.Tensor:
        """Copy the rows in use of the batch's block table to the device; return
        them: int32 [num_reqs, max_num_blocks_per_req], zero past each row's blocks."""
        block_table = self.input_batch.block_table
        block_table.commit_block_table(num_reqs)
        return block_table[0].get_device_tensor(num_reqs)

    def prepare_slot_mapping(
        self, num_reqs: int, query_start_loc: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        """The KV-cache slot of each new token (int64 [num_tokens]), from the
        committed block table (``BlockTable.compute_slot_mapping``)."""
        block_table = self.input_batch.block_table
        block_table.compute_slot_mapping(num_reqs, query_start_loc, self.positions.gpu[:num_tokens])
        return block_table[0].slot_mapping.gpu[:num_tokens]

    # --------------------------------------------------------------- sampling

    def _sample(
        self,
        logits: torch.Tensor,
        discard_request_mask: np.ndarray,
        spec_decode_metadata: SpecDecodeMetadata | None = None,
    ) -> SamplerOutput:
        """One token per row, from the batch's sampling metadata; with drafts,
        the rejection sampler's accepted drafts and one more token per row.

        A discarded row (still mid-prefill) draws too, so its generator must
        be put back: upstream rewinds the CUDA generator's offset
        (gpu_model_runner.py:3539); a CPU generator has no offset, so its
        state is saved before the draw and restored after it. A seeded row's
        tokens therefore do not depend on the steps it spent mid-prefill.
        """
        generators = self.input_batch.generators
        saved = {
            int(i): generators[int(i)].get_state()
            for i in np.flatnonzero(discard_request_mask)
            if int(i) in generators
        }
        if spec_decode_metadata is None:
            sampler_output = self.sampler(logits, self.input_batch.sampling_metadata)
        else:
            sampler_output = self.rejection_sampler(
                spec_decode_metadata, None, logits, self.input_batch.sampling_metadata
            )
        for i, state in saved.items():
            generators[i].set_state(state)
        return sampler_output

    def _bookkeeping_sync(
        self, sampler_output: SamplerOutput, discard_request_mask: np.ndarray
    ) -> tuple[list[list[int]], list | None]:
        """Keep the sampled tokens of the rows that finished their prompt:
        append them to the batch's token table and to the request states.
        Return (tokens per row, logprobs per row or None)."""
        batch = self.input_batch
        token_ids = sampler_output.sampled_token_ids
        if token_ids.dim() == 1:  # [num_reqs]: one token a row
            valid_sampled_token_ids = [[t] for t in token_ids.tolist()]
        else:  # [num_reqs, max_spec_len + 1]: the rejection sampler's layout
            valid_sampled_token_ids = RejectionSampler.parse_output(token_ids, self.vocab_size)
        for i in np.flatnonzero(discard_request_mask):
            valid_sampled_token_ids[i].clear()

        logprobs_lists = None
        if sampler_output.logprobs is not None:
            logprobs_lists = [None] * len(valid_sampled_token_ids)
        req_ids = batch.req_ids
        for req_idx, sampled_ids in enumerate(valid_sampled_token_ids):
            if not sampled_ids:
                continue
            start = int(batch.num_tokens_no_spec[req_idx])
            end = start + len(sampled_ids)
            batch.token_ids_cpu[req_idx, start:end] = sampled_ids
            batch.num_tokens_no_spec[req_idx] = end
            req_id = req_ids[req_idx]
            self.requests[req_id].output_token_ids.extend(sampled_ids)
            num_logprobs = batch.num_logprobs.get(req_id)
            if logprobs_lists is not None and num_logprobs is not None:
                # The sampler gathers the batch's largest top-n; each request
                # keeps its sampled token and its own top-n (upstream trims
                # the same way, logprobs.py:189).
                # One entry a token: the rejection sampler gives one per
                # output position, the kept tokens first.
                entries = sampler_output.logprobs[req_idx]
                entries = [entries] if token_ids.dim() == 1 else entries[: len(sampled_ids)]
                keep = num_logprobs + 1
                logprobs_lists[req_idx] = [
                    (ids[:keep], vals[:keep], rank) for ids, vals, rank in entries
                ]
        return valid_sampled_token_ids, logprobs_lists

    # --------------------------------------------------------------- execute

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """Run the step's batch and sample it. ``grammar_output``: the
        structured requests' bitmask, applied to the logits before sampling
        (upstream applies it in ``sample_tokens``, gpu_model_runner.py:4358)."""
        self._swap_blocks(scheduler_output)
        self._update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            if self.kv_connector is not None:
                # Transfers still report when nothing runs (upstream's
                # kv_connector_no_forward, kv_connector_model_runner_mixin.py:38).
                with (
                    set_forward_context(None, self.kv_connector),
                    self._kv_connector_output(scheduler_output, wait_for_save=False) as out,
                ):
                    pass
                if not out.is_empty():
                    return ModelRunnerOutput([], {}, kv_connector_output=out)
            return EMPTY_MODEL_RUNNER_OUTPUT
        req_ids = list(self.input_batch.req_ids)
        num_scheduled_tokens = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32
        )
        inputs = self._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if self.lora_manager is not None:
            self.set_active_loras(num_scheduled_tokens)

        # A decode-only step may replay a graph, padded to its size.
        uniform_decode = scheduler_output.total_num_scheduled_tokens == len(req_ids)
        cudagraph_mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(
            scheduler_output.total_num_scheduled_tokens, uniform_decode=uniform_decode
        )
        num_input_tokens = batch_descriptor.num_tokens

        start = time.perf_counter()
        with (
            set_forward_context(
                inputs.attn_metadata, self.kv_connector, cudagraph_mode, batch_descriptor
            ),
            self._maybe_kv_connector_output(scheduler_output) as kv_connector_output,
        ):
            hidden_states = self.model(
                self.input_ids.gpu[:num_input_tokens],
                self.positions.gpu[:num_input_tokens],
                **self._model_inputs_embeds(scheduler_output, inputs),
            )  # [num_input_tokens, hidden]: padding rows last
        # [num_logits, V]: one row a request, 1 + drafts rows when verifying drafts
        logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
        if grammar_output is not None:
            apply_grammar_bitmask(scheduler_output, grammar_output, self.input_batch, logits)
        sampler_output = self._sample(
            logits, inputs.discard_request_mask, inputs.spec_decode_metadata
        )
        self.forward_time += time.perf_counter() - start

        sampled, logprobs = self._bookkeeping_sync(sampler_output, inputs.discard_request_mask)
        if self.drafter is not None:
            self._draft_token_ids = self.propose_draft_token_ids(sampled)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=dict(self.input_batch.req_id_to_index),
            sampled_token_ids=sampled,
            logprobs=logprobs,
            kv_connector_output=kv_connector_output,
        )

    def _swap_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Phase 19's SwapScheduler (vLLM v0's CacheEngine.swap_out /
        swap_in): copy the step's blocks GPU -> CPU, then CPU -> GPU, in every
        layer, before the forward may overwrite them. A default SchedulerOutput
        has neither map: nothing happens."""
        swap_out = getattr(scheduler_output, "blocks_to_swap_out", None)
        swap_in = getattr(scheduler_output, "blocks_to_swap_in", None)
        if not swap_out and not swap_in:
            return
        start = time.perf_counter()
        gpu_kv_caches = [layer.kv_cache for layer in self.model.attention_layers()]
        if self.cpu_kv_caches is None:
            # Page-locked when the KV cache is on CUDA, as v0's CacheEngine did
            # (pin_memory only means something for copies to and from a GPU).
            self.cpu_kv_caches = [
                torch.zeros(
                    (self.num_cpu_blocks, *kv.shape[1:]),
                    dtype=kv.dtype,
                    device="cpu",
                    pin_memory=kv.is_cuda,
                )
                for kv in gpu_kv_caches
            ]
        for pairs, sources, targets in (
            (swap_out, gpu_kv_caches, self.cpu_kv_caches),
            (swap_in, self.cpu_kv_caches, gpu_kv_caches),
        ):
            if not pairs:
                continue
            src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
            for source, target in zip(sources, targets, strict=True):
                target[dst.to(target.device)] = source[src.to(source.device)].to(target.device)
        self.swap_time += time.perf_counter() - start

    def _model_inputs_embeds(
        self, scheduler_output: SchedulerOutput, inputs: PreparedInputs
    ) -> dict[str, torch.Tensor]:
        """``{"inputs_embeds": [num_tokens, hidden]}`` when the model must run on
        embeddings: a multimodal model always (the step's token embeddings with
        the image rows merged in, as upstream, gpu_model_runner.py:3385-3404),
        and any model in a step with a prompt given as embeddings (its rows
        take them: upstream's enable_prompt_embeds branch, :3411-3434). Else
        nothing: the model embeds its ids itself."""
        with_prompt_embeds = [
            req_id
            for req_id in self.input_batch.req_ids
            if self.requests[req_id].prompt_embeds is not None
        ]
        if not self.supports_mm_inputs and not with_prompt_embeds:
            return {}
        if self.supports_mm_inputs:
            self._execute_mm_encoder(scheduler_output)
            mm_embeds, is_mm_embed = self._gather_mm_embeddings(scheduler_output)
            inputs_embeds = self.model.embed_input_ids(
                inputs.input_ids, multimodal_embeddings=mm_embeds, is_multimodal=is_mm_embed
            )
        else:
            inputs_embeds = self.model.embed_input_ids(inputs.input_ids)
        if with_prompt_embeds:
            self._write_prompt_embeds(scheduler_output, inputs_embeds)
        return {"inputs_embeds": inputs_embeds}

    def _write_prompt_embeds(
        self, scheduler_output: SchedulerOutput, inputs_embeds: torch.Tensor
    ) -> None:
        """Overwrite the rows of prompt positions given as embeddings with them
        (upstream copies them in _prepare_inputs, gpu_model_runner.py:1941-1975):
        a request's chunk covers positions [computed, computed + scheduled);
        those below its prompt length take its prompt_embeds rows."""
        req_start_idx = 0
        for req_id in self.input_batch.req_ids:
            num_scheduled = scheduler_output.num_scheduled_tokens[req_id]
            state = self.requests[req_id]
            embeds = state.prompt_embeds
            if embeds is not None and state.num_computed_tokens < embeds.shape[0]:
                start = state.num_computed_tokens
                end = min(start + num_scheduled, embeds.shape[0])
                rows = slice(req_start_idx, req_start_idx + end - start)
                inputs_embeds[rows] = embeds[start:end].to(inputs_embeds)
            req_start_idx += num_scheduled

    def set_active_loras(self, num_scheduled_tokens: np.ndarray) -> None:
        """Each token's adapter, in the batch's row order, to the LoRA layers
        (upstream's LoRAModelRunnerMixin.set_active_loras,
        vllm/v1/worker/lora_model_runner_mixin.py:73)."""
        sampled = np.ones_like(num_scheduled_tokens)
        _, token_lora_mapping, lora_requests = self.input_batch.make_lora_inputs(
            num_scheduled_tokens, sampled
        )
        self.lora_manager.set_active_adapters(lora_requests, token_lora_mapping)

    def _maybe_kv_connector_output(self, scheduler_output: SchedulerOutput):
        """``_kv_connector_output`` with a connector; else yields None
        (upstream's maybe_get_kv_connector_output, kv_connector_model_runner_mixin.py:58)."""
        if self.kv_connector is None:
            return nullcontext()
        return self._kv_connector_output(scheduler_output)

    # mirrors vllm/v1/worker/kv_connector_model_runner_mixin.py:85-119
    @contextmanager
    def _kv_connector_output(
        self, scheduler_output: SchedulerOutput, wait_for_save: bool = True
    ) -> Iterator[KVConnectorOutput]:
        """One step of the worker half around the forward pass: bind the
        scheduler's metadata and start the loads; after it, wait for the
        saves and collect what finished and which blocks failed to load.
        Must run inside the step's forward context.

        Upstream's engine dies when a connector call raises; mini_vllm logs
        it once a step and goes on (``_kv_connector_errors``)."""
        connector = self.kv_connector
        assert connector is not None and scheduler_output.kv_connector_metadata is not None
        output = KVConnectorOutput()
        errors = get_forward_context().kv_connector_errors  # the layers add theirs
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        try:
            connector.start_load_kv(get_forward_context())
        except Exception as e:
            errors["start_load_kv"] = e
        try:
            yield output
        finally:
            if wait_for_save:
                try:
                    connector.wait_for_save()
                except Exception as e:
                    errors["wait_for_save"] = e
            # Finished ids a raising get_finished never took are passed again.
            self._kv_finished_req_ids |= scheduler_output.finished_req_ids
            try:
                finished = connector.get_finished(self._kv_finished_req_ids)
                output.finished_sending, output.finished_recving = finished
                self._kv_finished_req_ids = set()
            except Exception as e:
                errors["get_finished"] = e
            output.invalid_block_ids = connector.get_block_ids_with_load_errors()
            self._kv_connector_errors(scheduler_output, output, errors)
            connector.clear_connector_metadata()

    def _kv_connector_errors(
        self,
        scheduler_output: SchedulerOutput,
        output: KVConnectorOutput,
        errors: dict[str, Exception],
    ) -> None:
        """mini only: what a connector call that raised this step leaves.
        A load (start_load_kv, wait_for_layer_load): the blocks this step's
        requests started from are reported as failed loads, so each is
        recomputed or fails alone by kv_load_failure_policy. A save
        (save_kv_layer, wait_for_save): the save is lost; those requests go
        on (their KV here is intact), and once finished they are reported in
        finished_sending, so blocks held for that save are freed. get_finished:
        nothing finishes this step; it is called again next step, and the
        scheduler is told (``get_finished_failed``), so that it can give up
        on the transfers it waits for if the calls keep raising."""
        for name, e in errors.items():
            logger.error("KV connector %s raised (%s: %s)", name, type(e).__name__, e)
        output.get_finished_failed = "get_finished" in errors
        if errors.keys() & {"start_load_kv", "wait_for_layer_load"}:
            output.invalid_block_ids |= self._blocks_started_from(scheduler_output)
        if errors.keys() & {"save_kv_layer", "wait_for_save"}:
            self._kv_saves_lost.update(self.input_batch.req_ids)
        lost = self._kv_saves_lost & scheduler_output.finished_req_ids
        if lost:
            self._kv_saves_lost -= lost
            output.finished_sending = (output.finished_sending or set()) | lost

    def _blocks_started_from(self, scheduler_output: SchedulerOutput) -> set[int]:
        """The blocks holding the computed tokens that this step's new and
        resumed requests start from: where a connector loads. The runner
        cannot tell a load from a local prefix hit, so both count."""
        starts = [
            (r.block_ids[0], r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                starts.append((cached.new_block_ids[i][0], cached.num_computed_tokens[i]))
        return {
            block_id
            for block_ids, num_computed in starts
            for block_id in block_ids[: -(-num_computed // self.block_size)]
        }

    def propose_draft_token_ids(self, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Next step's drafts, one list per row (empty where the row sampled
        nothing), from each row's tokens including the ones just sampled."""
        batch = self.input_batch
        return self.drafter.propose(
            sampled_token_ids, batch.num_tokens_no_spec, batch.token_ids_cpu
        )

    # ------------------------------------------------------------ CUDA graphs

    def _cudagraph_mode(self) -> CUDAGraphMode:
        """The mode this runner can honour: FULL graphs of decode-only steps
        when the config asks for FULL graphs and everything the forward runs
        can be captured; else NONE. Upstream settles the mode against what its
        attention backends support in ``_check_and_update_cudagraph_mode``
        (gpu_model_runner.py:6669)."""
        from mini_vllm.attention.backends.triton_attn import TritonAttentionImpl

        config = self.vllm_config
        groups = self.kv_cache_config.kv_cache_groups if self.kv_cache_config else [None]
        capturable = (
            self.device.type == "cuda"
            and config.compilation_config.cudagraph_mode.has_mode(CUDAGraphMode.FULL)
            and config.parallel_config.world_size == 1
            and len(groups) == 1
            and all(
                type(layer.impl) is TritonAttentionImpl for layer in self.model.attention_layers()
            )
            and self.lora_manager is None
            and self.drafter is None
            and self.kv_connector is None
            and not self.supports_mm_inputs
            and not config.model_config.enable_prompt_embeds
        )
        return CUDAGraphMode.FULL_DECODE_ONLY if capturable else CUDAGraphMode.NONE

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Capture one FULL graph per decode key, largest first, on a dummy
        decode batch: each request one token, one slot of context (slots
        marked padding, so the KV cache is not written). The attention
        kernel's split count is fixed at capture from ``max_model_len``, so a
        replay serves any context length."""
        mode = self._cudagraph_mode()
        self.cudagraph_dispatcher.initialize_cudagraph_keys(mode)
        if mode == CUDAGraphMode.NONE:
            return
        self.model = CUDAGraphWrapper(self.model, CUDAGraphMode.FULL)
        for runtime_mode, keys in self.cudagraph_dispatcher.get_capture_descs():
            for key in keys:
                metadata = self._dummy_decode_metadata(key)
                ids, positions = (
                    self.input_ids.gpu[: key.num_tokens],
                    self.positions.gpu[: key.num_tokens],
                )
                # Once eagerly (Triton compiles its kernels), then captured.
                with set_forward_context(metadata):
                    self.model(ids, positions)
                torch.cuda.synchronize(self.device)
                with set_forward_context(metadata, None, runtime_mode, key):
                    self.model(ids, positions)
        torch.cuda.synchronize(self.device)

    def _dummy_decode_metadata(self, key: BatchDescriptor) -> AttentionMetadata:
        """Fill the buffers with a dummy decode batch of ``key``'s shape."""
        num_reqs, num_tokens = key.num_reqs, key.num_tokens
        self.input_ids.gpu[:num_tokens].zero_()
        self.positions.gpu[:num_tokens].zero_()
        qsl = self.query_start_loc
        qsl.np[: num_reqs + 1] = np.arange(num_reqs + 1)
        qsl.np[num_reqs + 1 :] = num_reqs
        qsl.copy_to_gpu()
        self.seq_lens.np[:num_reqs] = 1
        self.seq_lens.np[num_reqs:] = 0
        self.seq_lens.copy_to_gpu()
        self.input_batch.block_table[0].slot_mapping.gpu.fill_(PAD_SLOT_ID)
        return self._padded_decode_metadata(key)

    def _padded_decode_metadata(self, key: BatchDescriptor) -> AttentionMetadata:
        """The metadata a decode graph of ``key`` is captured with: views of
        the persistent buffers at the padded sizes, so a replay reads whatever
        ``_prepare_inputs`` wrote there. Rows past a step's requests hold
        seq_len 0 and tokens past its tokens the padding slot."""
        num_reqs, num_tokens = key.num_reqs, key.num_tokens
        block_table = self.input_batch.block_table[0]
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=1,
            query_start_loc=self.query_start_loc.gpu[: num_reqs + 1],
            max_seq_len=self.max_model_len,
            seq_lens=self.seq_lens.gpu[:num_reqs],
            block_table=block_table.get_device_tensor(num_reqs),
            slot_mapping=block_table.slot_mapping.gpu[:num_tokens],
        )

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts of the last step, once (None if there are none)."""
        if self._draft_token_ids is None:
            return None
        draft_token_ids = DraftTokenIds(list(self.input_batch.req_ids), self._draft_token_ids)
        self._draft_token_ids = None
        return draft_token_ids


def build_logitsprocs(vllm_config: VllmConfig, device: torch.device) -> LogitsProcessors:
    """The batch's logits processors, as upstream's ``build_logitsprocs``
    (vllm/v1/sample/logits_processor/__init__.py:184): the built-ins, then
    the custom ones (``LLM(..., logits_processors=[cls, ...])``). min_tokens
    is not among them: mini's batch keeps it (Lab 05.1) and the sampler
    applies it where upstream's processor runs."""
    custom = vllm_config.model_config.logits_processors or []
    classes = [LogitBiasLogitsProcessor, MinPLogitsProcessor, *custom]
    return LogitsProcessors(cls(vllm_config, device, False) for cls in classes)
