"""The harness Labs 19.1 and 19.2 grade the two scheduler variants with.

The reference's own tests (tests/test_scheduler_variants.py) and the graded
suites under phases/19-capstone/ share it: generated workloads run with a fake
model (each sampled token is 1000 + its index), while a fake KV cache keeps in
every GPU and CPU block the token ids written into it. The step's swap maps
are copied before the "forward", and each scheduled request must find its
computed tokens in its block table before its new ones are written: a block
swapped to the wrong place, or freed while still needed, shows up as lost KV
at a named step and position. ``greedy`` runs a tiny real model under memory
pressure through ``LLM(scheduler_cls=...)``.
"""

from __future__ import annotations

from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.kv_cache_interface import cdiv

MAX_STEPS = 2000
MAX_MODEL_LEN = 32


class FakeKV:
    """Token ids in place of KV: ``gpu[block][slot]`` and ``cpu[block][slot]``."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}

    def swap(self, out) -> None:
        for gpu_block, cpu_block in getattr(out, "blocks_to_swap_out", ()):
            self.cpu[cpu_block] = list(self.gpu.get(gpu_block, [None] * self.block_size))
        for cpu_block, gpu_block in getattr(out, "blocks_to_swap_in", ()):
            self.gpu[gpu_block] = list(self.cpu[cpu_block])

    def run(self, request, block_ids: list[int], start: int, num_new: int, step: int) -> None:
        """Check tokens [0, start) are in place, then write [start, start + num_new)."""
        tokens = request.all_token_ids
        for pos in range(start + num_new):
            block = self.gpu.setdefault(block_ids[pos // self.block_size], [None] * self.block_size)
            slot = pos % self.block_size
            if pos < start:
                assert block[slot] == tokens[pos], (
                    f"step {step}: {request.request_id} lost its KV at position {pos} "
                    f"(block {block_ids[pos // self.block_size]} holds {block[slot]}, "
                    f"want {tokens[pos]}): a swap copied the wrong blocks, or a block "
                    "was handed out while its owner still needed it"
                )
            elif pos < len(tokens):
                block[slot] = tokens[pos]


def is_decode(request, start: int, admitted: bool) -> bool:
    """A decode: a running request with everything before its last token
    computed. A request admitted this step (new, or resumed from the waiting
    queue) prefills, even when its prefix cache hits leave one token."""
    return not admitted and start >= max(request.num_prompt_tokens, request.num_tokens - 1)


def drive(sched, requests, arrivals, check_step=None, before_step=None) -> dict:
    """Run to the end with a fake model. ``before_step(step)`` runs before each
    ``schedule()`` and its value goes to ``check_step(step, kinds, out, seen)``
    (kinds: the set of is_decode values of the step's requests)."""
    kv = FakeKV(sched.block_size)
    outputs = {r.request_id: [] for r in requests}
    pending = sorted(zip(arrivals, range(len(requests)), strict=True))
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            sched.add_request(requests[pending.pop(0)[1]])
        seen = before_step(step) if before_step is not None else None
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.max_num_scheduled_tokens, (
            f"step {step}: {out.total_num_scheduled_tokens} tokens over the budget"
        )
        assert len(sched.running) <= sched.scheduler_config.max_num_seqs, (
            f"step {step}: {len(sched.running)} running > max_num_seqs"
        )
        kv.swap(out)
        kinds = set()
        admitted = {r.req_id for r in out.scheduled_new_reqs}
        admitted |= set(out.scheduled_cached_reqs.resumed_req_ids)
        for req_id, n in out.num_scheduled_tokens.items():
            request = sched.requests[req_id]
            start = request.num_computed_tokens - n
            kinds.add(is_decode(request, start, req_id in admitted))
            block_ids = sched.kv_cache_manager.get_block_ids(req_id)[0]
            kv.run(request, block_ids, start, n, step)
        if check_step is not None:
            check_step(step, kinds, out, seen)
        runner_output = mini.make_model_runner_output(
            sched, out, lambda r: 1000 + len(r.output_token_ids)
        )
        sched.update_from_output(out, runner_output)
        for request_id, tokens in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            if tokens:
                outputs[request_id].extend(tokens)
        step += 1
        assert step < MAX_STEPS, f"no end after {MAX_STEPS} steps: a request never ran again"
    return {"outputs": outputs, "steps": step}


workloads = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([2, 4]),
        "max_num_seqs": st.integers(1, 6),
        "budget": st.sampled_from([8, 16, 64]),
        "chunked": st.booleans(),
        "caching": st.booleans(),
        "extra_blocks": st.integers(0, 12),
        "reqs": st.lists(
            st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 6)),
            min_size=1,
            max_size=10,
        ),
        "shared_prefix": st.booleans(),
        "reserve_full_isl": st.booleans(),
    }
)

# Four 10-token prompts growing by 12 in the smallest pool that holds one:
# requests must be preempted.
PRESSURE = {
    "block_size": 4,
    "max_num_seqs": 4,
    "budget": 64,
    "chunked": True,
    "caching": False,
    "extra_blocks": 0,
    "reqs": [(10, 12, 0)] * 4,
    "shared_prefix": False,
}


def build(cls, w, num_cpu_blocks: int | None = None, watermark: float | None = None):
    """(scheduler of class ``cls``, requests, arrival steps, GPU blocks) for
    workload ``w``; ``watermark``: CacheConfig's, when not its default."""
    num_blocks = cdiv(MAX_MODEL_LEN, w["block_size"]) + 1 + w["extra_blocks"]
    budget = w["budget"] if w["chunked"] else max(w["budget"], MAX_MODEL_LEN)
    config = mini.create_scheduler(
        block_size=w["block_size"],
        max_model_len=MAX_MODEL_LEN,
        num_blocks=num_blocks,
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=max(budget, w["max_num_seqs"]),
        enable_chunked_prefill=w["chunked"],
        enable_prefix_caching=w["caching"],
        scheduler_reserve_full_isl=w.get("reserve_full_isl", True),
    ).vllm_config
    config.cache_config.num_cpu_blocks = num_cpu_blocks
    if watermark is not None:
        config.cache_config.watermark = watermark
    sched = cls(config, log_stats=True)
    requests, arrivals = [], []
    for i, (prompt_len, out_len, arrive) in enumerate(w["reqs"]):
        head = [7] * 6 if w["shared_prefix"] else []
        prompt = (head + [100 + i] * prompt_len)[: MAX_MODEL_LEN - out_len]
        (req,) = mini.create_requests(
            1,
            prompt_token_ids=[prompt],
            max_tokens=out_len,
            ignore_eos=True,
            block_size=w["block_size"],
            req_ids=[f"r{i}"],
        )
        requests.append(req)
        arrivals.append(arrive)
    return sched, requests, arrivals, num_blocks


def check_end(sched, requests, result, num_blocks) -> None:
    """Every request finished with all its tokens; every GPU block free again."""
    for r in requests:
        got = len(result["outputs"][r.request_id])
        assert got == r.max_tokens, f"{r.request_id} got {got} tokens, asked {r.max_tokens}"
        assert r.is_finished(), f"{r.request_id} never finished"
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == num_blocks - 1, f"{num_blocks - 1 - free} GPU blocks never came back"


def greedy(folder: str, cls, prompts, **kwargs) -> tuple[list[list[int]], object]:
    """Greedy tokens of ``prompts`` on the model in ``folder`` with 7 usable
    KV blocks of 16 tokens, and the engine's scheduler."""
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    llm = LLM(
        folder,
        max_model_len=96,
        num_gpu_blocks_override=8,
        block_size=16,
        scheduler_cls=cls,
        **kwargs,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.engine_core.scheduler


def pressure_prompts(vocab_size: int) -> list[list[int]]:
    """Four 40-token prompts that grow by 24: more than 7 blocks of 16 hold."""
    return [[(7 * i + 13 * j) % vocab_size for j in range(40)] for i in range(4)]
