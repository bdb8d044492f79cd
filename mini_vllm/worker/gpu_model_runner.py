"""Turns a SchedulerOutput into one forward pass and one sampled token per request.

Mirrors upstream ``vllm/v1/worker/gpu_model_runner.py`` (``GPUModelRunner``
:415: ``_update_states`` :1116, ``_prepare_inputs`` :1863, ``execute_model``
:3955) and the request state ``CachedRequestState``
(gpu_input_batch.py:34) at v0.22.1. Left out: the persistent GPU input batch and its reordering,
CUDA graphs, async output copies, speculative decoding, LoRA, multimodal,
pooling, pipeline parallelism.

Like upstream, the runner keeps its own copy of every running request:
new requests arrive in full (``NewRequestData``), running ones as deltas
(new block ids, computed count); the runner appends the tokens it samples
itself, so the scheduler never resends them. A resumed request lost its
blocks, so its block table is replaced and its tokens are reloaded from
``all_token_ids``.

A request samples only when this step computes its last token; a request
still mid-prefill returns ``[]`` (upstream samples it and throws the token
away; the result is the same).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from mini_vllm.attention.backend import AttentionMetadata
from mini_vllm.core.sched.output import SchedulerOutput
from mini_vllm.forward_context import set_forward_context
from mini_vllm.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.sampler import Sampler
from mini_vllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]


@dataclass
class PreparedInputs:
    """One step's model inputs (``_prepare_inputs``); num_tokens is the
    total number of scheduled tokens."""

    req_ids: list[str]  # batch order: num_scheduled_tokens' order
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    sample_rows: list[int]  # indices into req_ids of the requests that sample
    logits_indices: list[int]  # per sampling request, the row of its last token


def _num_logprobs(params: SamplingParams, vocab_size: int) -> int:
    """How many top logprobs a request wants besides its sampled token."""
    return vocab_size if params.logprobs == -1 else params.logprobs


class GPUModelRunner:
    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        # Seconds spent in the model forward + sampling, for the bench's
        # "time outside the model" figure.
        self.forward_time = 0.0

    # ---------------------------------------------------------------- states

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=params,
                generator=generator,
                block_ids=list(new.block_ids[0]),
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_block_ids[0]) if new_block_ids else []
                all_tokens = cached.all_token_ids[req_id]
                state.output_token_ids = list(all_tokens[len(state.prompt_token_ids) :])
            elif new_block_ids is not None:
                state.block_ids.extend(new_block_ids[0])

    # ---------------------------------------------------------------- inputs

    def _prepare_inputs(self, so: SchedulerOutput) -> PreparedInputs:
        """The step's flat batch: every scheduled request's new tokens, one
        after another, in ``num_scheduled_tokens`` order."""
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        num_scheduled = [so.num_scheduled_tokens[r] for r in req_ids]
        input_ids, positions = self.prepare_input_ids_and_positions(states, num_scheduled)
        seq_lens = [s.num_computed_tokens + n for s, n in zip(states, num_scheduled, strict=True)]
        query_start_loc = np.concatenate([[0], np.cumsum(num_scheduled)])  # [num_reqs + 1]
        block_table = self.prepare_block_table(states)  # [num_reqs, max_blocks]
        slot_mapping = self.prepare_slot_mapping(block_table, positions, num_scheduled)
        # A request samples when this step computes its last token.
        sample_rows = [i for i, s in enumerate(states) if seq_lens[i] == s.num_tokens]
        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            max_query_len=max(num_scheduled),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            max_seq_len=max(seq_lens),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.from_numpy(block_table).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
        )
        return PreparedInputs(
            req_ids=req_ids,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            attn_metadata=metadata,
            sample_rows=sample_rows,
            logits_indices=[int(query_start_loc[i + 1]) - 1 for i in sample_rows],
        )

    @staticmethod
    def prepare_input_ids_and_positions(
        states: list[CachedRequestState], num_scheduled: list[int]
    ) -> tuple[list[int], np.ndarray]:
        """Token ids and positions of every request's scheduled tokens, in batch
        order: ([num_tokens], [num_tokens] int64)."""
        input_ids: list[int] = []
        positions: list[int] = []
        for state, n in zip(states, num_scheduled, strict=True):
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            if end <= len(state.prompt_token_ids):
                input_ids.extend(state.prompt_token_ids[start:end])
            else:
                input_ids.extend(state.token(p) for p in range(start, end))
            positions.extend(range(start, end))
        return input_ids, np.asarray(positions, dtype=np.int64)

    @staticmethod
    def prepare_block_table(states: list[CachedRequestState]) -> np.ndarray:
        """Row i: request i's block ids, zero-padded: [num_reqs, max_blocks] int32."""
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((len(states), max_blocks), dtype=np.int32)
        for i, state in enumerate(states):
            block_table[i, : len(state.block_ids)] = state.block_ids
        return block_table

    def prepare_slot_mapping(
        self, block_table: np.ndarray, positions: np.ndarray, num_scheduled: list[int]
    ) -> np.ndarray:
        """The KV-cache slot of each new token, block id * block_size + offset:
        [num_tokens] int64 (upstream: BlockTable.compute_slot_mapping)."""
        bs = self.block_size
        row_of_token = np.repeat(np.arange(len(num_scheduled)), num_scheduled)  # [num_tokens]
        return block_table[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs

    def _sampling_metadata(
        self, states: list[CachedRequestState], vocab_size: int
    ) -> SamplingMetadata:
        dev = self.device
        params = [s.sampling_params for s in states]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        all_greedy = all(p.sampling_type_greedy for p in params)
        top_k = top_p = None
        if not all_greedy:
            if any(p.top_k > 0 for p in params):
                top_k = torch.tensor(
                    [max(p.top_k, 0) for p in params], dtype=torch.int64, device=dev
                )
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        blocked = {
            row: sorted(p.all_stop_token_ids)
            for row, (p, s) in enumerate(zip(params, states, strict=True))
            if len(s.output_token_ids) < p.min_tokens and p.all_stop_token_ids
        }
        # logprobs=-1 means the whole vocabulary (upstream gpu_input_batch.py:416).
        wanted = [_num_logprobs(p, vocab_size) for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperature=temperature,
            all_greedy=all_greedy,
            top_k=top_k,
            top_p=top_p,
            generators=[s.generator for s in states],
            max_num_logprobs=max(wanted) if wanted else None,
            min_tokens_blocked=blocked,
        )

    # --------------------------------------------------------------- execute

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self._prepare_inputs(scheduler_output)
        req_ids, sample_rows = batch.req_ids, batch.sample_rows

        start = time.perf_counter()
        with set_forward_context(batch.attn_metadata):
            hidden_states = self.model(batch.input_ids, batch.positions)  # [num_tokens, hidden]
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs_lists: list | None = None
        if sample_rows:
            # [num_sampling_reqs, vocab]
            logits = self.model.compute_logits(hidden_states[batch.logits_indices])
            states = [self.requests[req_ids[i]] for i in sample_rows]
            out = self.sampler(logits, self._sampling_metadata(states, logits.shape[-1]))
            tokens = out.sampled_token_ids.tolist()
            if out.logprobs is not None:
                logprobs_lists = [None] * len(req_ids)
            for k, row in enumerate(sample_rows):
                states[k].output_token_ids.append(tokens[k])
                sampled_lists[row] = [tokens[k]]
                num = states[k].sampling_params.logprobs
                if logprobs_lists is not None and num is not None:
                    # The sampler gathers the batch's largest top-n; each
                    # request keeps its sampled token and its own top-n
                    # (upstream trims the same way, logprobs.py:189).
                    ids, vals, rank = out.logprobs[k]
                    keep = _num_logprobs(states[k].sampling_params, logits.shape[-1]) + 1
                    logprobs_lists[row] = [(ids[:keep], vals[:keep], rank)]
        self.forward_time += time.perf_counter() - start
        for req_id in req_ids:
            state = self.requests[req_id]
            state.num_computed_tokens += scheduler_output.num_scheduled_tokens[req_id]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled_lists,
            logprobs=logprobs_lists,
        )
