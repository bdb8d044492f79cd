"""Runner workloads: a scheduler's real outputs applied to a model runner's batch.

Runs a scheduler workload (mini_vllm/oracle/workload.py: requests arriving,
chunked prefill, preemption, resumption, aborts, stop tokens) on the pinned
upstream ``Scheduler`` built on a CPU (mini_vllm/oracle/upstream.py), with the
fake model of workload.py, and hands every ``SchedulerOutput`` to two model
runner sides:

- ``MiniRunnerSide``: mini_vllm's ``GPUModelRunner`` (or a subclass, such as
  a student's) without a model: its ``_update_states``, ``_prepare_inputs``
  and ``_bookkeeping_sync`` run as in a real step, on mini's copy of the
  SchedulerOutput;
- ``UpstreamRunnerSide``: the pinned upstream's ``InputBatch`` and
  ``CachedRequestState``, edited by a replay of upstream's
  ``GPUModelRunner._update_states`` (vllm/v1/worker/gpu_model_runner.py:1116)
  and ``_bookkeeping_sync`` (vllm/v1/worker/gpu_model_runner.py:3512), since
  upstream's runner itself does not build on a CPU. The replay keeps the
  branches a synchronous, single-rank engine without speculative decoding,
  multimodal inputs or streaming takes, and leaves the others out.

After ``_update_states``, after input preparation and after the bookkeeping,
the trace records what the step depends on: every row of the batch (request,
token ids, counts, block ids, sampling parameters), every request state the
runner keeps (preempted ones included), the input ids, positions and
discard mask of the step, and the tokens each row keeps. Both sides are fed
the same sampled tokens: the fake model's, for the requests the scheduler
expects to sample; rows that should discard get -1.

Used by tests/upstream/test_runner_lockstep.py and Lab 05.3's grader
(phases/05-model-runner-persistent-batch/labs/lab-03-update-states/).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from mini_vllm.oracle.batch_workload import _observe
from mini_vllm.oracle.workload import Arrivals, Progress, Workload, _fake_runner_output

NOT_SAMPLED = -1  # the token a row gets when the scheduler expects none


def _config_sizes(config: dict) -> dict:
    """The runner's sizes for a scheduler configuration (create_scheduler's defaults)."""
    budget = config.get("max_num_batched_tokens", 8192)
    return {
        "max_num_reqs": config.get("max_num_seqs", 16),
        "max_num_batched_tokens": budget,
        "max_model_len": config.get("max_model_len") or budget,
        "block_size": config.get("block_size", 16),
        "enable_chunked_prefill": config.get("enable_chunked_prefill", True),
    }


def _states(requests: dict) -> dict:
    return {
        req_id: {
            "num_computed_tokens": s.num_computed_tokens,
            "block_ids": [list(ids) for ids in s.block_ids],
            "output_token_ids": list(s.output_token_ids),
        }
        for req_id, s in sorted(requests.items())
    }


# ------------------------------------------------------------------ mini_vllm


def to_mini_scheduler_output(out, eos_token_id: int):
    """mini_vllm's SchedulerOutput for upstream's ``out``: every list copied."""
    from mini_vllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from mini_vllm.sampling_params import SamplingParams

    def params(p):
        mini = SamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            max_tokens=p.max_tokens,
            min_tokens=p.min_tokens,
            logprobs=p.logprobs,
        )
        mini.update_from_generation_config({}, eos_token_id)
        return mini

    def blocks(block_ids):
        return None if block_ids is None else tuple(list(ids) for ids in block_ids)

    cached = out.scheduled_cached_reqs
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                req_id=d.req_id,
                prompt_token_ids=list(d.prompt_token_ids),
                sampling_params=params(d.sampling_params),
                block_ids=blocks(d.block_ids),
                num_computed_tokens=d.num_computed_tokens,
            )
            for d in out.scheduled_new_reqs
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=list(cached.req_ids),
            resumed_req_ids=set(cached.resumed_req_ids),
            new_token_ids=[list(t) for t in cached.new_token_ids],
            all_token_ids={r: list(t) for r, t in cached.all_token_ids.items()},
            new_block_ids=[blocks(b) for b in cached.new_block_ids],
            num_computed_tokens=list(cached.num_computed_tokens),
            num_output_tokens=list(cached.num_output_tokens),
        ),
        num_scheduled_tokens=dict(out.num_scheduled_tokens),
        total_num_scheduled_tokens=out.total_num_scheduled_tokens,
        num_common_prefix_blocks=list(out.num_common_prefix_blocks),
        finished_req_ids=set(out.finished_req_ids),
        preempted_req_ids=set(out.preempted_req_ids or ()),
    )


class _NoModel:
    """What GPUModelRunner reads from a model at construction, and no more."""

    def __init__(self, vocab_size: int) -> None:
        self.config = SimpleNamespace(vocab_size=vocab_size)

    def attention_layers(self) -> list:
        return []


class MiniRunnerSide:
    """mini_vllm's runner (``runner_cls``) on mini's copy of each SchedulerOutput."""

    def __init__(
        self, config: dict, reorder_batch_threshold, vocab_size, eos_token_id, runner_cls=None
    ):
        from mini_vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from mini_vllm.worker.gpu_model_runner import GPUModelRunner

        runner_cls = runner_cls or GPUModelRunner
        sizes = _config_sizes(config)
        vllm_config = VllmConfig(
            model_config=ModelConfig(max_model_len=sizes["max_model_len"]),
            cache_config=CacheConfig(block_size=sizes["block_size"]),
            scheduler_config=SchedulerConfig(
                max_num_seqs=sizes["max_num_reqs"],
                max_num_batched_tokens=sizes["max_num_batched_tokens"],
                enable_chunked_prefill=sizes["enable_chunked_prefill"],
            ),
        )
        self.runner = runner_cls(vllm_config, _NoModel(vocab_size), torch.device("cpu"))
        self.runner.reorder_batch_threshold = reorder_batch_threshold
        self.eos_token_id = eos_token_id

    @property
    def input_batch(self):
        return self.runner.input_batch

    @property
    def requests(self) -> dict:
        return self.runner.requests

    def update_states(self, out) -> None:
        self.out = to_mini_scheduler_output(out, self.eos_token_id)
        self.runner._update_states(self.out)

    def prepare_inputs(self) -> dict:
        batch = self.runner.input_batch
        num_scheduled = np.array(
            [self.out.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int32
        )
        inputs = self.runner._prepare_inputs(self.out, num_scheduled)
        self.discard = inputs.discard_request_mask
        return {
            "input_ids": inputs.input_ids.tolist(),
            "positions": inputs.positions.tolist(),
            "discard": self.discard.tolist(),
        }

    def bookkeeping(self, tokens: dict[str, int]) -> list[list[int]]:
        from mini_vllm.sample.sampler import SamplerOutput

        req_ids = self.runner.input_batch.req_ids
        sampled = torch.tensor([tokens.get(r, NOT_SAMPLED) for r in req_ids], dtype=torch.int64)
        kept, _ = self.runner._bookkeeping_sync(SamplerOutput(sampled), self.discard)
        return kept


# ------------------------------------------------------------------ upstream


class UpstreamRunnerSide:
    """Upstream's InputBatch, edited as upstream's runner edits it."""

    def __init__(self, config: dict, reorder_batch_threshold, vocab_size, eos_token_id):
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
        from vllm.v1.worker.gpu_input_batch import InputBatch

        sizes = _config_sizes(config)
        device = torch.device("cpu")
        self.input_batch = InputBatch(
            max_num_reqs=sizes["max_num_reqs"],
            max_model_len=sizes["max_model_len"],
            max_num_batched_tokens=sizes["max_num_batched_tokens"],
            device=device,
            pin_memory=False,
            vocab_size=vocab_size,
            block_sizes=[sizes["block_size"]],
            kernel_block_sizes=[sizes["block_size"]],
            logitsprocs=LogitsProcessors([MinTokensLogitsProcessor(None, device, False)]),
        )
        self.reorder_batch_threshold = reorder_batch_threshold
        self.requests: dict = {}

    def update_states(self, out) -> None:
        """Upstream's ``_update_states`` (gpu_model_runner.py:1116-1437), the
        branches of a synchronous last-rank runner without spec decoding."""
        from vllm.sampling_params import SamplingType
        from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        self.out = out
        batch = self.input_batch
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in out.finished_req_ids:
            batch.remove_request(req_id)
        cached = out.scheduled_cached_reqs
        scheduled = out.num_scheduled_tokens.keys()
        for req_id in batch.req_id_to_index.keys() - (scheduled - cached.resumed_req_ids):
            batch.remove_request(req_id)

        reqs_to_add = []
        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.sampling_type == SamplingType.RANDOM_SEED:
                generator = torch.Generator().manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                mm_features=[],
                sampling_params=params,
                generator=generator,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
            )
            self.requests[new.req_id] = state
            reqs_to_add.append(state)

        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            num_output_tokens = cached.num_output_tokens[i]
            req_index = batch.req_id_to_index.get(req_id)
            state.num_computed_tokens = num_computed_tokens
            if num_output_tokens < len(state.output_token_ids):
                del state.output_token_ids[num_output_tokens:]
                if req_index is not None:
                    end = batch.num_prompt_tokens[req_index] + num_output_tokens
                    batch.num_tokens_no_spec[req_index] = end
            if req_id not in cached.resumed_req_ids:
                if new_block_ids is not None:
                    for ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):
                        ids.extend(new_ids)
            else:
                assert req_index is None and new_block_ids is not None
                state.block_ids = new_block_ids
            if req_index is None:
                reqs_to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[req_index] = num_computed_tokens
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, req_index)

        for state in reqs_to_add:
            batch.add_request(state)
        batch.condense()
        if self.reorder_batch_threshold is not None:
            reorder_batch_to_split_decodes_and_prefills(
                batch, out, decode_threshold=self.reorder_batch_threshold
            )
        batch.refresh_metadata()

    def prepare_inputs(self) -> dict:
        """Input ids and positions as upstream's ``_prepare_inputs`` lays them
        out (gpu_model_runner.py:1863-1929), and its discard mask (:2006)."""
        batch = self.input_batch
        input_ids, positions, discard = [], [], []
        for i, req_id in enumerate(batch.req_ids):
            start = int(batch.num_computed_tokens_cpu[i])
            end = start + self.out.num_scheduled_tokens[req_id]
            positions.extend(range(start, end))
            input_ids.extend(batch.token_ids_cpu[i, start:end].tolist())
            discard.append(end < self.requests[req_id].num_tokens)
        self.discard = discard
        return {"input_ids": input_ids, "positions": positions, "discard": discard}

    def bookkeeping(self, tokens: dict[str, int]) -> list[list[int]]:
        """Upstream's ``_bookkeeping_sync`` for one token per row (:3512-3635)."""
        batch = self.input_batch
        kept = []
        for i, req_id in enumerate(batch.req_ids):
            if self.discard[i]:
                kept.append([])
                continue
            token = tokens.get(req_id, NOT_SAMPLED)
            start = int(batch.num_tokens_no_spec[i])
            batch.token_ids_cpu[i, start] = token
            batch.num_tokens_no_spec[i] = start + 1
            self.requests[req_id].output_token_ids.append(token)
            kept.append([token])
        return kept


# ------------------------------------------------------------------ running


def run_runner_workload(
    workload: Workload, side_factory, reorder_batch_threshold: int | None
) -> list[tuple[str, dict]]:
    """Drive the pinned upstream scheduler through ``workload`` and feed each
    step to the side ``side_factory(config, reorder_batch_threshold,
    vocab_size, eos_token_id)`` builds; return (stage, observation) pairs."""
    from mini_vllm.oracle import upstream

    sched = upstream.create_scheduler(**workload.config)
    eos = upstream.EOS_TOKEN_ID
    side = side_factory(workload.config, reorder_batch_threshold, eos + 1, eos)
    specs = {s.req_id: s for s in workload.requests}
    arrivals = Arrivals(upstream, sched, workload)
    trace: list[tuple[str, dict]] = []
    step, progress = 0, Progress()
    while True:
        arrivals.admit(step)
        if not arrivals.pending and not sched.has_requests():
            break
        if step >= workload.max_steps:
            raise RuntimeError(f"workload {workload.name!r} did not finish in {step} steps")

        out = sched.schedule()
        runner_output = _fake_runner_output(upstream, sched, out, specs, eos)
        side.update_states(out)
        trace.append(
            (
                f"step {step}: _update_states",
                {**_observe(side.input_batch), "states": _states(side.requests)},
            )
        )
        if out.total_num_scheduled_tokens:
            trace.append((f"step {step}: _prepare_inputs", side.prepare_inputs()))
            tokens = {
                r: t[0]
                for r, t in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
                if t
            }
            kept = side.bookkeeping(tokens)
            trace.append(
                (
                    f"step {step}: _bookkeeping_sync",
                    {**_observe(side.input_batch), "kept": kept, "states": _states(side.requests)},
                )
            )
        sched.update_from_output(out, runner_output)
        progress.after_step(sched, step)
        step += 1
    return trace


def first_runner_difference(
    expected: list[tuple[str, dict]], got: list[tuple[str, dict]], labels=("upstream", "mini_vllm")
) -> str | None:
    """None if the traces agree, else the first stage and field that differ."""
    a, b = labels
    for (stage, e), (_, g) in zip(expected, got, strict=False):
        for key in e:
            if e[key] == g.get(key):
                continue
            if key in ("rows", "states"):
                for item in sorted(set(e[key]) | set(g.get(key, {})), key=str):
                    er, gr = e[key].get(item), g.get(key, {}).get(item)
                    if er == gr:
                        continue
                    if isinstance(er, dict) and isinstance(gr, dict):
                        field = next(f for f in {**er, **gr} if er.get(f) != gr.get(f))
                        er, gr = er.get(field), gr.get(field)
                        item = f"{item!r}, field {field!r}"
                    return f"after {stage}: {key} {item} differs.\n  {a}: {er}\n  {b}: {gr}"
            return f"after {stage}: {key!r} differs.\n  {a}: {e[key]}\n  {b}: {g.get(key)}"
    if len(expected) != len(got):
        return f"{a} recorded {len(expected)} stages but {b} recorded {len(got)}."
    return None
