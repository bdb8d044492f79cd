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

    def _prepare_inputs(self, so: SchedulerOutput):
        req_ids = list(so.num_scheduled_tokens)
        num_reqs = len(req_ids)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens = []
        sample_rows: list[int] = []  # index into req_ids of requests that sample
        max_blocks = max(len(self.requests[r].block_ids) for r in req_ids)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + n
            if end <= len(state.prompt_token_ids):
                input_ids.extend(state.prompt_token_ids[start:end])
            else:
                input_ids.extend(state.token(p) for p in range(start, end))
            positions.extend(range(start, end))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            block_table[i, : len(state.block_ids)] = state.block_ids
            if end == state.num_tokens:
                sample_rows.append(i)
        pos = np.asarray(positions, dtype=np.int64)
        row_of_token = np.repeat(np.arange(num_reqs), np.diff(query_start_loc))
        slot_mapping = block_table[row_of_token, pos // bs].astype(np.int64) * bs + pos % bs
        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            max_query_len=int(np.diff(query_start_loc).max()),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            max_seq_len=max(seq_lens),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.from_numpy(block_table).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
        )
        logits_indices = [query_start_loc[i + 1] - 1 for i in sample_rows]
        return (
            req_ids,
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.from_numpy(pos).to(dev),
            metadata,
            sample_rows,
            logits_indices,
        )

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
        import time

        self._update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        req_ids, input_ids, positions, metadata, sample_rows, logits_indices = self._prepare_inputs(
            scheduler_output
        )

        start = time.perf_counter()
        with set_forward_context(metadata):
            hidden_states = self.model(input_ids, positions)
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs_lists: list | None = None
        if sample_rows:
            logits = self.model.compute_logits(hidden_states[logits_indices])
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
