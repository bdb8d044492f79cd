"""Planted bugs: does the fast test tier still catch what each phase's graders caught?

When a phase was built, its session planted plausible bugs in a solved copy
of its labs and checked that the phase's graders fail on each one; the
closing notes list them. The fast tier (``MINI_VLLM_TIER=fast``, what
``make test`` runs) grades with fewer hypothesis examples. This tool
re-plants three of those bugs per phase, one at a time, and grades each in
the fast tier, so a cut in example counts that lets a known bug through
shows up here.

For each plant in ``PLANTS``: copy the working tree (mini_vllm/, phases/,
labs/, tests/, pyproject.toml) to a fresh temporary folder, make the one edit
there (``old`` must occur exactly once), and grade the plant's phase in that
copy, with ``PYTHONPATH`` and the working directory set to the copy so that
the graders import the copy's mini_vllm and not the editable install's.
Where the edit goes (``--into``):

- ``solved`` (the default, as the closing notes did it): into the plant's
  starter in a solved copy of the labs (``grading solve --out``), graded with
  ``check NN --labs-dir <copy>/solved``. The graders compare that code with
  the untouched reference, as they compare a student's.
- ``reference``: into the copy's mini_vllm itself, graded with
  ``check NN --impl ref``. A bug only a comparison with mini_vllm's own
  reference would show goes unseen here (both sides carry it); what is
  caught is caught by upstream's recordings, transformers or a stated rule.

Both add ``--no-upstream-tests --results <copy>/r.json``. CAUGHT means a
non-zero exit and a score below the maximum; anything else is MISSED.

Run it (each plant is a whole phase check: from seconds to a few minutes)::

    .venv/bin/python tests/planted_bugs.py                 # every phase
    .venv/bin/python tests/planted_bugs.py --phase 03      # one phase
    .venv/bin/python tests/planted_bugs.py --phase 03 --plant 2 --tier deep
    .venv/bin/python tests/planted_bugs.py --phase 03 --baseline --into reference

``--baseline`` first grades an unplanted copy of each phase, which must score
full marks: with a plant caught, it shows the copy, not the checkout, is what
gets graded. The exit status is non-zero if any plant was missed (or a
baseline fell short). tests/test_planted_bugs.py checks, at no grading cost,
that every plant still applies to the reference and to its solved starter.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mini_vllm.grading import regions

REPO = Path(__file__).resolve().parents[1]
COPIED = ("mini_vllm", "phases", "labs", "tests", "pyproject.toml")
TIMEOUT_S = 900
# Labs no plant reaches, left out of a phase's check: Lab 19.3 serves the
# student's code of every phase with v1's own scheduler (minutes a run), so a
# plant in a Phase 19 variant never touches it.
LEFT_OUT = {"19": "phases/19-capstone/labs/lab-03-whole-engine"}


@dataclass(frozen=True)
class Plant:
    phase: str  # "03"
    path: str  # a file under mini_vllm/, relative to the repository root
    old: str  # occurs exactly once in that file, and in its solved starter
    new: str  # the buggy replacement
    what: str  # the bug, in one sentence


# Where each bug comes from is the comment above it: "stop N" is that stop's
# closing note (`issues stops`), "issue N" the text (`issues show N`).
# Where a note only counts its planted bugs, the bug is written from the rule
# the lab's HINT states, and the comment says so.
PLANTS = [
    # ---- Phase 00: foundations
    # stop 8: "page size without the x2 for values: 4/23"
    Plant(
        "00",
        "mini_vllm/kv_cache_interface.py",
        "per KV head.\n        return 2 * self.block_size * self.num_kv_heads",
        "per KV head.\n        return self.block_size * self.num_kv_heads",
        "a block's page size counts the keys but not the values",
    ),
    # stop 8: "null block counted as usable"
    Plant(
        "00",
        "mini_vllm/kv_cache_interface.py",
        "return (num_blocks - 1) // cdiv(num_tokens, kv_cache_spec.block_size)",
        "return num_blocks // cdiv(num_tokens, kv_cache_spec.block_size)",
        "the null block is counted as a block requests can use",
    ),
    # stop 8 (Lab 00.1 counts "exactly P+n-1 positions fed"); the note counts
    # 12 planted bugs, this one is written from the lab's HINT
    Plant(
        "00",
        "mini_vllm/benchmarks/kv_cache_speedup.py",
        "        if step + 1 < max_tokens:\n",
        "        if step < max_tokens:\n",
        "greedy_with_cache feeds the last sampled token too (P+n positions, not P+n-1)",
    ),
    # ---- Phase 01: the request lifecycle
    # stop 8: "PREEMPTED-as-finished"
    Plant(
        "01",
        "mini_vllm/request.py",
        "return RequestStatus.is_finished(self.status)",
        "return RequestStatus.is_finished(self.status) or self.status == RequestStatus.PREEMPTED",
        "a preempted request reads as finished",
    ),
    # stop 23 (issue 11): 'planted "+1 per preempting step" bug'
    Plant(
        "01",
        "mini_vllm/engine/core.py",
        "        self.num_preemptions += len(scheduler_output.preempted_req_ids or ())\n"
        "        self.num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens\n"
        "        grammar_output",
        "        self.num_preemptions += 1 if scheduler_output.preempted_req_ids else 0\n"
        "        self.num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens\n"
        "        grammar_output",
        "EngineCore.step counts one preemption per preempting step, not one per request",
    ),
    # stop 23 (issue 11): 'planted "stop token left out of token_ids"'
    Plant(
        "01",
        "mini_vllm/engine/detokenizer.py",
        "        if hide_last:\n            self.token_ids.append(new_token_ids[-1])\n",
        "",
        "a hidden stop token is left out of the detokenizer's token_ids",
    ),
    # ---- Phase 02: the paged KV cache
    # stop 26: "planted O(n) removes still fail (head walk ...)"
    Plant(
        "02",
        "mini_vllm/core/kv_cache_utils.py",
        "        prev, nxt = block.prev_free_block, block.next_free_block\n",
        "        walk = self.fake_free_list_head\n"
        "        while walk is not None and walk is not block:\n"
        "            walk = walk.next_free_block\n"
        "        prev, nxt = block.prev_free_block, block.next_free_block\n",
        "remove() walks the free queue from its head: O(n), not O(1)",
    ),
    # stop 6 states the rule ("get_computed_blocks never covers the whole
    # prompt"); stop 7 counts 29 planted Phase 02 bugs without naming them
    Plant(
        "02",
        "mini_vllm/core/kv_cache_manager.py",
        "max_num_blocks = (request.num_tokens - 1) // self.block_size",
        "max_num_blocks = request.num_tokens // self.block_size",
        "a prefix-cache hit may cover the whole prompt, leaving no token to compute",
    ),
    # stop 6 states the rule ("free tail-first"), written from Lab 02.4's HINT
    Plant(
        "02",
        "mini_vllm/core/kv_cache_manager.py",
        "self.block_pool.free_blocks(reversed(blocks))",
        "self.block_pool.free_blocks(blocks)",
        "a request's blocks are freed head first, so a prefix's start is evicted first",
    ),
    # ---- Phase 03: the continuous-batching scheduler
    # stop 8: "running request not charged to the budget"
    Plant(
        "03",
        "mini_vllm/core/sched/scheduler.py",
        "            num_scheduled_tokens[request.request_id] = num_new_tokens\n"
        "            token_budget -= num_new_tokens\n"
        "            req_index += 1\n",
        "            num_scheduled_tokens[request.request_id] = num_new_tokens\n"
        "            req_index += 1\n",
        "a scheduled running request is not charged to the token budget",
    ),
    # stop 7: "check_stop testing EOS before min_tokens"
    Plant(
        "03",
        "mini_vllm/core/sched/utils.py",
        "    if num_output_tokens < params.min_tokens:\n"
        "        return False\n"
        "    last_token_id = request.output_token_ids[-1]\n"
        "    if last_token_id == params.eos_token_id:\n"
        "        request.status = RequestStatus.FINISHED_STOPPED\n"
        "        return True\n",
        "    last_token_id = request.output_token_ids[-1]\n"
        "    if last_token_id == params.eos_token_id:\n"
        "        request.status = RequestStatus.FINISHED_STOPPED\n"
        "        return True\n"
        "    if num_output_tokens < params.min_tokens:\n"
        "        return False\n",
        "check_stop tests EOS before min_tokens",
    ),
    # stop 7 counts 45 planted bugs in Labs 03.1-03.3 without naming this one;
    # written from Lab 03.3's HINT ("put it at the FRONT of the waiting queue")
    Plant(
        "03",
        "mini_vllm/core/sched/scheduler.py",
        "        self.waiting.prepend_request(request)\n",
        "        self.waiting.add_request(request)\n",
        "a preempted request goes to the back of the waiting queue, not the front",
    ),
    # ---- Phase 04: attention backends
    # stop 26: "a planted k/v swap fails 10 tests"
    Plant(
        "04",
        "mini_vllm/attention/backends/torch_attn.py",
        "    kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)\n"
        "    kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)\n",
        "    kv_cache[blocks, 0, offsets] = value.to(kv_cache.dtype)\n"
        "    kv_cache[blocks, 1, offsets] = key.to(kv_cache.dtype)\n",
        "reshape_and_cache stores keys in the value slots and values in the key slots",
    ),
    # stop 8: "a stage-2 merge without the rescale"
    Plant(
        "04",
        "mini_vllm/attention/ops/triton_decode_attention.py",
        "out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)",
        "out = tl.sum(acc, axis=0) / tl.sum(l, axis=0)",
        "the split-KV merge adds the splits without rescaling them to the global max",
    ),
    # stop 8 counts 16 planted Phase 04 bugs; written from Lab 04.1's HINT
    # (the output LSE is log(p_se + s_se) on the max_lse scale)
    Plant(
        "04",
        "mini_vllm/attention/ops/merge_attn_states.py",
        "output_lse.copy_(torch.log(out_se) + max_lse)",
        "output_lse.copy_(torch.log(out_se))",
        "merge_attn_states' output LSE forgets to add back the max it subtracted",
    ),
    # ---- Phase 05: the model runner and the persistent batch
    # stop 25: 'top_k "off" not vocab_size'
    Plant(
        "05",
        "mini_vllm/worker/gpu_input_batch.py",
        '            top_k = self.vocab_size  # keeping the whole vocabulary is "off"\n',
        "            pass\n",
        'a top_k that is "off" (0 or -1) is stored as given, not as vocab_size',
    ),
    # stop 25: "resumed blocks extended not replaced"
    Plant(
        "05",
        "mini_vllm/worker/gpu_model_runner.py",
        "                state.block_ids = tuple(list(ids) for ids in new_block_ids)\n",
        "                for ids, new_ids in zip(state.block_ids, new_block_ids, strict=True):\n"
        "                    ids.extend(new_ids)\n",
        "a resumed request's new blocks are appended to the ones it lost at preemption",
    ),
    # stop 25: "one-token first chunk counted as decode"
    Plant(
        "05",
        "mini_vllm/attention/backends/utils.py",
        "    region[~has_context] = 3\n",
        "    region[~has_context & ~few_tokens] = 3\n",
        "a one-token first chunk (no context yet) is counted as a decode",
    ),
    # ---- Phase 06: sampling and logits processors
    # stop 26 (issue 12): "presence reads the prompt"
    Plant(
        "06",
        "mini_vllm/sample/ops/penalties.py",
        "logits -= presence_penalties.unsqueeze(1) * output_mask",
        "logits -= presence_penalties.unsqueeze(1) * (prompt_mask | output_mask)",
        "the presence penalty also counts tokens of the prompt",
    ),
    # stop 26 (issue 12): "top-k-only `<=`"
    Plant(
        "06",
        "mini_vllm/sample/ops/topk_topp_sampler.py",
        'return logits.masked_fill_(logits < kth, float("-inf"))',
        'return logits.masked_fill_(logits <= kth, float("-inf"))',
        "top-k without sorting drops the k-th largest logit too",
    ),
    # stop 26 (issue 12): "one-way move as swap"
    Plant(
        "06",
        "mini_vllm/sample/logits_processor/builtin.py",
        "            if direction == MoveDirectionality.SWAP:\n"
        "                req_entries[a] = entry_b\n",
        "            req_entries[a] = entry_b\n",
        "a one-way move brings b's entry back to a, as a swap would",
    ),
    # ---- Phase 07: prefix caching at scale
    # issue 31: "the hit search from the right", written from Lab 07.1's rule
    # (cdiv(sliding_window - 1, block_size) blocks: the next token is in its own window)
    Plant(
        "07",
        "mini_vllm/core/single_type_kv_cache_manager.py",
        "num_contiguous_needed = cdiv(kv_cache_spec.sliding_window - 1, block_size)",
        "num_contiguous_needed = cdiv(kv_cache_spec.sliding_window, block_size)",
        "a window hit asks for a run covering the whole window, the next token included",
    ),
    # issue 31: "the fixed point across groups", written from Lab 07.2's rule
    # (a round that shrinks the candidate makes every kind look again)
    Plant(
        "07",
        "mini_vllm/core/kv_cache_coordinator.py",
        "            if is_simple_hybrid:\n                break\n",
        "            break\n",
        "the hybrid hit stops after one round even with two window kinds",
    ),
    # issue 31: "group ids in the cached-block keys", written from Lab 07.3's rule
    Plant(
        "07",
        "mini_vllm/core/single_type_kv_cache_manager.py",
        "            kv_cache_group_id=self.kv_cache_group_id,\n",
        "            kv_cache_group_id=0,\n",
        "every group caches its blocks under group 0's keys",
    ),
    # ---- Phase 08: speculative decoding
    # stop 26 (issue 13): "rollback by accepted instead of rejected"
    Plant(
        "08",
        "mini_vllm/core/sched/scheduler.py",
        "num_rejected = num_draft_tokens - num_accepted",
        "num_rejected = num_accepted",
        "the rollback takes back the accepted drafts instead of the rejected ones",
    ),
    # stop 26 (issue 13): "latest occurrence"
    Plant(
        "08",
        "mini_vllm/spec_decode/ngram_proposer.py",
        "start = int(starts[0]) + n",
        "start = int(starts[-1]) + n",
        "the n-gram proposer drafts after the latest match, not the earliest",
    ),
    # stop 26 (issue 13): "bonus written after a rejection"
    Plant(
        "08",
        "mini_vllm/sample/rejection_sampler.py",
        "            row[pos] = on_reject[pos]\n            return\n",
        "            row[pos] = on_reject[pos]\n            break\n",
        "a row that rejected a draft still gets the bonus token",
    ),
    # ---- Phase 09: priority and fairness
    # stop 26 (issue 14): "TPOT over n not n-1"
    Plant(
        "09",
        "mini_vllm/metrics/fairness.py",
        "decode_time / (n - 1) if n > 1 else 0.0",
        "decode_time / n if n > 1 else 0.0",
        "TPOT divides the decode time by every output token, not those after the first",
    ),
    # stop 26 (issue 14): "> for >="
    Plant(
        "09",
        "mini_vllm/core/sched/aging.py",
        "if self.now - self.entered[oldest][0] >= self.max_wait_steps:",
        "if self.now - self.entered[oldest][0] > self.max_wait_steps:",
        "aging promotes a request one step after it has waited max_wait_steps",
    ),
    # stop 26 (issue 14): "scheduled_ts overwritten on resume"
    Plant(
        "09",
        "mini_vllm/metrics/fairness.py",
        "    if req_stats.scheduled_ts is None:\n        req_stats.scheduled_ts = now\n",
        "    req_stats.scheduled_ts = now\n",
        "a resumed request's admission overwrites its first scheduled_ts",
    ),
    # ---- Phase 10: quantization
    # issue 33 (Lab 10.1: "low nibbles are weights 0-15"), written from the lab's HINT
    Plant(
        "10",
        "mini_vllm/model_executor/layers/quantization/gguf.py",
        "q = torch.cat([packed & 0x0F, packed >> 4], dim=1)",
        "q = torch.cat([packed >> 4, packed & 0x0F], dim=1)",
        "Q4 blocks unpack the high nibbles first",
    ),
    # issue 33 (Lab 10.2: QuantFP8 multiplies by the reciprocal), from the lab's HINT
    Plant(
        "10",
        "mini_vllm/model_executor/layers/quantization/input_quant_fp8.py",
        "out = x.to(torch.float32) * scale.to(torch.float32).reciprocal()",
        "out = x.to(torch.float32) / scale.to(torch.float32)",
        "QuantFP8 divides by the scale instead of multiplying by its reciprocal",
    ),
    # issue 33 (Lab 10.3: k_scale folded into the query), from the lab's HINT
    Plant(
        "10",
        "mini_vllm/model_executor/layers/attention.py",
        "            query = query * self._k_scale_float\n",
        "",
        "an fp8 cache stores key / k_scale but the query never gets k_scale back",
    ),
    # issue 33 (Lab 10.4: the weight scale as a row over the outputs), from the lab's HINT
    Plant(
        "10",
        "mini_vllm/model_executor/layers/quantization/fp8.py",
        "layer.weight_scale = nn.Parameter(weight_scale.view(1, -1), requires_grad=False)",
        "layer.weight_scale = nn.Parameter(weight_scale, requires_grad=False)",
        "a per-channel fp8 weight scale kept as a column, not a row over the outputs",
    ),
    # ---- Phase 11: LoRA
    # issue 34 (Lab 11.1: hold back a new adapter once max_loras are in the step), from the HINT
    Plant(
        "11",
        "mini_vllm/core/sched/scheduler.py",
        "and len(scheduled_loras) == self.lora_config.max_loras",
        "and len(scheduled_loras) > self.lora_config.max_loras",
        "the scheduler never holds a request back for max_loras",
    ),
    # issue 34 (Lab 11.2: shrink scales by the adapter's scaling), from the HINT
    Plant(
        "11",
        "mini_vllm/lora/ops/torch_ops/lora_ops.py",
        "output_tensor[:, : shrunk.shape[1]] = scaling * shrunk",
        "output_tensor[:, : shrunk.shape[1]] = shrunk",
        "bgmv_shrink (and so sgmv_shrink) leaves out the scaling",
    ),
    # issue 34 (Lab 11.3: evict the least recently used active adapter), from the HINT
    Plant(
        "11",
        "mini_vllm/lora/model_manager.py",
        "self.deactivate_adapter(next(iter(self._active_adapters)))",
        "self.deactivate_adapter(next(reversed(self._active_adapters)))",
        "a full set of slots evicts the most recently used adapter",
    ),
    # issue 34 (Lab 11.4: each shard expands into its own columns), from the HINT
    Plant(
        "11",
        "mini_vllm/lora/punica_wrapper/punica_cpu.py",
        "            offset += size\n",
        "",
        "every shard of a merged projection expands into the first shard's columns",
    ),
    # ---- Phase 12: structured outputs
    # stop 26 (issue 15): "FCFS taking waiting before skipped_waiting"
    Plant(
        "12",
        "mini_vllm/core/sched/scheduler.py",
        "return self.skipped_waiting or self.waiting or None",
        "return self.waiting or self.skipped_waiting or None",
        "FCFS admits from waiting before the older skipped_waiting requests",
    ),
    # stop 26 (issue 15): "no rollback after walking drafts"
    Plant(
        "12",
        "mini_vllm/structured_output/__init__.py",
        "            if state_advancements > 0:\n"
        "                grammar.rollback(state_advancements)\n",
        "",
        "the grammar is not rolled back after walking the drafts to fill their rows",
    ),
    # stop 27 (issue 15): "drafts don't push rows" (Lab 12.3 catches it)
    Plant(
        "12",
        "mini_vllm/structured_output/utils.py",
        "        offset += len(spec_tokens.get(req_id, ()))\n",
        "",
        "a request's drafts do not push the later requests' logits rows down",
    ),
    # ---- Phase 13: multimodal inputs and the encoder budget
    # issue 36: "a prefill chunk stopping before an image it cannot afford"
    Plant(
        "13",
        "mini_vllm/core/sched/scheduler.py",
        "                if num_computed_tokens < start_pos:\n"
        "                    num_new_tokens = start_pos - num_computed_tokens\n"
        "                else:\n"
        "                    num_new_tokens = 0\n"
        "                break\n",
        "                break\n",
        "a chunk runs on into an image the encoder budget cannot take, unencoded",
    ),
    # issue 36: "entries freed when consumed" (Lab 13.1's HINT: all placeholders computed)
    Plant(
        "13",
        "mini_vllm/core/sched/scheduler.py",
        "if position.offset + position.length <= request.num_computed_tokens:",
        "if position.offset < request.num_computed_tokens:",
        "an image is released once its first placeholder is computed, not its last",
    ),
    # Lab 13.2's HINT: "Evict from the front of self.freeable (oldest first)"
    Plant(
        "13",
        "mini_vllm/core/encoder_cache_manager.py",
        "self.freeable.popitem(last=False)",
        "self.freeable.popitem()",
        "the encoder cache evicts its newest unreferenced entry first",
    ),
    # Lab 13.3's HINT: "With an is_embed mask, only its True positions take rows"
    Plant(
        "13",
        "mini_vllm/worker/gpu_model_runner.py",
        "                if pos_info.is_embed is None:\n",
        "                if True:\n",
        "the step's mask marks every placeholder, ignoring the is_embed mask",
    ),
    # ---- Phase 14: async scheduling
    # stop 26 (issue 14): "prefill chunk gets a placeholder"
    Plant(
        "14",
        "mini_vllm/core/sched/async_scheduler.py",
        "            if request.is_prefill_chunk:\n"
        "                continue\n"
        "            # This step samples one token for it",
        "            # This step samples one token for it",
        "a request still mid-prefill gets an output placeholder",
    ),
    # stop 26 (issue 14): "cache_blocks up to ... num_computed_tokens"
    Plant(
        "14",
        "mini_vllm/core/sched/async_scheduler.py",
        "request, request.num_computed_tokens - request.num_output_placeholders",
        "request, request.num_computed_tokens",
        "blocks holding placeholder positions (ids not known yet) join the prefix cache",
    ),
    # stop 26 (issue 14): "<= queue bound"
    Plant(
        "14",
        "mini_vllm/engine/core.py",
        "and len(batch_queue) < self.batch_queue_size",
        "and len(batch_queue) <= self.batch_queue_size",
        "the batch queue holds one step more than batch_queue_size in flight",
    ),
    # issue 29, item 19 (graders' blind spot, now graded: a late token reaching max_tokens)
    Plant(
        "14",
        "mini_vllm/core/sched/async_scheduler.py",
        "stopped_preempted_reqs = [r for r in preempted if r.is_finished()]",
        "stopped_preempted_reqs = [\n"
        "            r for r in preempted if r.status == RequestStatus.FINISHED_STOPPED\n"
        "        ]",
        "a preempted request finished by its late token reaching max_tokens stays waiting",
    ),
    # ---- Phase 15: KV connectors
    # issue 32 (lab 15.1's HINT: the connector answers about the tokens past the LOCAL hit)
    Plant(
        "15",
        "mini_vllm/core/sched/scheduler.py",
        "get_num_new_matched_tokens(\n"
        "                        request, num_new_local_computed_tokens\n",
        "get_num_new_matched_tokens(\n                        request, 0\n",
        "the connector is asked as if nothing were cached locally: it counts the local hit twice",
    ),
    # issue 32 (lab 15.2's HINT: a hit on every token recomputes the last one)
    Plant(
        "15",
        "mini_vllm/core/sched/scheduler.py",
        "            if request.num_computed_tokens == request.num_tokens:\n"
        "                request.num_computed_tokens = request.num_tokens - 1\n",
        "",
        "an asynchronous load of the whole prompt leaves no token to compute, so none is sampled",
    ),
    # issue 32 (lab 15.3's HINT: storing requests are not loads)
    Plant(
        "15",
        "mini_vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py",
        "            if request.is_store:\n                continue\n            logger.info(",
        "            logger.info(",
        "start_load_kv loads the storing requests too, over the KV their forward pass computes",
    ),
    # ---- Phase 16: serving
    # stop 25 (issue 16): "wrong choice index"
    Plant(
        "16",
        "mini_vllm/entrypoints/openai/serving_completion.py",
        "i = output.index + prompt_idx * num_choices",
        "i = output.index + prompt_idx",
        "a streamed choice's index ignores n: prompt 1's choices collide with prompt 0's",
    ),
    # stop 25 (issue 16): "max_tokens not capped"
    Plant(
        "16",
        "mini_vllm/entrypoints/openai/serving_engine.py",
        "return room if max_tokens is None else min(max_tokens, room)",
        "return room if max_tokens is None else max_tokens",
        "max_tokens is not capped by the room the prompt leaves in the context",
    ),
    # stop 25 (issue 16): "core never told to abort"
    Plant(
        "16",
        "mini_vllm/engine/async_llm.py",
        "        if known and self.engine_core is not None:\n"
        "            self.engine_core.abort_requests(known)\n",
        "",
        "abort forgets the requests in the front end but never frees them in the engine core",
    ),
    # issue 29, item 20 (graders' blind spot, now graded with n=2)
    Plant(
        "16",
        "mini_vllm/entrypoints/openai/serving_completion.py",
        "completion_tokens=previous_num_tokens[i],\n"
        "                            total_tokens=prompt_tokens + previous_num_tokens[i],",
        "completion_tokens=sum(previous_num_tokens),\n"
        "                            total_tokens=prompt_tokens + sum(previous_num_tokens),",
        "continuous usage on a choice's chunk counts every choice's tokens, not its own",
    ),
    # issue 29, item 21 (graders' blind spot, now graded with n=2)
    Plant(
        "16",
        "mini_vllm/engine/async_llm.py",
        "self.abort(collector.child_ids)",
        "self.abort(collector.child_ids[:1])",
        "a disconnect aborts only the request's first child",
    ),
    # ---- Phase 17: tensor parallelism
    # issue 35 (lab 17.1's HINT: the bias goes in once over the group)
    Plant(
        "17",
        "mini_vllm/model_executor/layers/linear.py",
        "        bias = self.bias if self.tp_rank == 0 else None\n",
        "        bias = self.bias\n",
        "a row-parallel layer adds its bias on every rank: the all-reduce adds it tp times",
    ),
    # issue 35 (lab 17.1's HINT: move the gathered dim next to `dim`)
    Plant(
        "17",
        "mini_vllm/distributed/parallel_state.py",
        "out = out.reshape((self.world_size,) + tuple(input_.shape)).movedim(0, dim)",
        "out = out.reshape((self.world_size,) + tuple(input_.shape))",
        "all_gather stacks the ranks' tensors without moving them next to dim: wrong order",
    ),
    # issue 35 (lab 17.2: a KV head shared by several ranks is the same part on each)
    Plant(
        "17",
        "mini_vllm/model_executor/layers/linear.py",
        "        return self.tp_rank // self.num_kv_head_replicas\n",
        "        return self.tp_rank % self.total_num_kv_heads\n",
        "ranks sharing KV heads take them round-robin, not in runs of num_kv_head_replicas",
    ),
    # issue 35 (lab 17.2: the vocabulary is padded to 64 before it is split)
    Plant(
        "17",
        "mini_vllm/model_executor/layers/vocab_parallel_embedding.py",
        "            padded = pad_vocab_size(num_embeddings, padding_size)\n",
        "            padded = pad_vocab_size(num_embeddings, self.tp_size)\n",
        "the vocabulary is padded to a multiple of the rank count, not of 64",
    ),
    # issue 35 (lab 17.3: a worker that raised fails the executor)
    Plant(
        "17",
        "mini_vllm/executor/multiproc_executor.py",
        '                if status == "error":\n',
        '                if status == "error" and method == "execute_model":\n',
        "collective_rpc takes a worker's error as its answer, except during a step",
    ),
    # ---- Phase 18: performance engineering
    # Lab 18.1's docstring: "a running one is a prefill when it has more than one token scheduled"
    Plant(
        "18",
        "mini_vllm/metrics/perf.py",
        "ctx.add(n, computed + n, is_prefill=n > 1)",
        "ctx.add(n, computed + n, is_prefill=False)",
        "a running request's prefill chunk (or a resumed request) is counted as a decode",
    ),
    # Lab 18.1's hint: the decode reads its cached keys and values at cache_byte_size
    Plant(
        "18",
        "mini_vllm/metrics/perf.py",
        "            prefill = ctx.prefill_num_tokens * q + 2 * ctx.prefill_context_len * kv\n",
        "            prefill = ctx.prefill_num_tokens * q + 2 * ctx.prefill_num_tokens * kv\n",
        "a prefill's attention reads only its new keys and values, not its cached prefix's",
    ),
    # Lab 18.2: NONE above the largest captured size, not at it
    Plant(
        "18",
        "mini_vllm/cudagraph_dispatcher.py",
        "or num_tokens > max_size",
        "or num_tokens >= max_size",
        "a step of exactly the largest captured size runs eagerly instead of replaying its graph",
    ),
    # Lab 18.2's hint: "The FULL check is has_mode, not =="
    Plant(
        "18",
        "mini_vllm/cudagraph_dispatcher.py",
        "if uniform_decode and self.cudagraph_mode.has_mode(CUDAGraphMode.FULL):",
        "if uniform_decode and self.cudagraph_mode == CUDAGraphMode.FULL:",
        "a uniform decode batch loses its uniform key in FULL_DECODE_ONLY and FULL_AND_PIECEWISE",
    ),
    # Lab 18.3: a re-admission after a preemption does not move scheduled_ts
    Plant(
        "18",
        "mini_vllm/metrics/stats.py",
        "                if req_stats.scheduled_ts == 0.0:\n"
        "                    req_stats.scheduled_ts = event.timestamp\n",
        "                req_stats.scheduled_ts = event.timestamp\n",
        "every SCHEDULED event moves scheduled_ts, so a preempted request's queue time grows",
    ),
    # Lab 18.3's hint: "a negative cached count means none"
    Plant(
        "18",
        "mini_vllm/metrics/loggers.py",
        "finished.num_prompt_tokens - max(finished.num_cached_tokens, 0)",
        "finished.num_prompt_tokens - finished.num_cached_tokens",
        "a request with no cached count (-1) observes one prefill token too many",
    ),
    # Lab 18.4's hint: "that dimension of a tensor" (dim, not always 0)
    Plant(
        "18",
        "mini_vllm/compilation/decorators.py",
        "            torch._dynamo.mark_dynamic(arg, dim)\n",
        "            torch._dynamo.mark_dynamic(arg, 0)\n",
        "dimension 0 is marked dynamic whatever dynamic_arg_dims says",
    ),
    # Lab 18.4's hint: "None stays as it is"
    Plant(
        "18",
        "mini_vllm/compilation/decorators.py",
        "        if isinstance(arg, torch.Tensor):\n"
        "            torch._dynamo.mark_dynamic(arg, dim)\n",
        "        torch._dynamo.mark_dynamic(arg, dim)\n",
        "an argument that is None (inputs_embeds) is marked too",
    ),
    # Lab 18.4's hint: one bool a guard, keep it or not
    Plant(
        "18",
        "mini_vllm/compilation/wrapper.py",
        '        options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe\n',
        '        options["guard_filter_fn"] = lambda guards: [True for _ in guards]\n',
        "every guard is kept: a changed attribute traces the model again",
    ),
    # ---- Phase 19: two designs v1 does not use
    # issue 38 (lab 19.1's HINT: the CPU blocks go back to the pool)
    Plant(
        "19",
        "mini_vllm/core/sched/swap_scheduler.py",
        "        self.free_cpu_block_ids.extend(cpu_block_ids)\n        self.num_swapped_in += 1\n",
        "        self.num_swapped_in += 1\n",
        "_swap_in never gives a request's CPU blocks back to the swap space",
    ),
    # issue 38 (lab 19.1: the swap-in map pairs each CPU block with its GPU block)
    Plant(
        "19",
        "mini_vllm/core/sched/swap_scheduler.py",
        "self.blocks_to_swap_in.extend(zip(cpu_block_ids, gpu_block_ids, strict=True))",
        "self.blocks_to_swap_in.extend(zip(cpu_block_ids[::-1], gpu_block_ids, strict=True))",
        "swapping in copies a request's CPU blocks back in reverse order",
    ),
    # issue 38 (lab 19.1: swap while the swap space holds the victim)
    Plant(
        "19",
        "mini_vllm/core/sched/swap_scheduler.py",
        "        return 0 < needed <= len(self.free_cpu_block_ids)\n",
        "        return 0 < needed < len(self.free_cpu_block_ids) // 2\n",
        "a victim is recomputed unless the swap space holds twice its blocks",
    ),
    # issue 38 (lab 19.2: a decode step admits nobody, a prefill step runs no decode)
    Plant(
        "19",
        "mini_vllm/core/sched/prefill_first_scheduler.py",
        "            return self._schedule_only(prefills, admit=True)\n",
        "            return self._schedule_only(list(self.running), admit=True)\n",
        "a prefill step lets the decoding requests run too: steps are mixed again",
    ),
    # issue 38 (lab 19.2's HINT: a waiting head counts only under max_num_seqs)
    Plant(
        "19",
        "mini_vllm/core/sched/prefill_first_scheduler.py",
        "        if self.waiting and len(self.running) < self.max_num_running_reqs:\n",
        "        if self.waiting:\n",
        "the waiting head asks for a prefill step even when no seat is free under max_num_seqs",
    ),
    # issue 38 (lab 19.2's HINT: a prompt not all computed is a prefill)
    Plant(
        "19",
        "mini_vllm/core/sched/prefill_first_scheduler.py",
        "        return request.num_computed_tokens >= max(request.num_prompt_tokens, "
        "request.num_tokens - 1)\n",
        "        return request.num_computed_tokens >= request.num_tokens - 1\n",
        "a request one prompt token short of its whole prompt counts as decoding",
    ),
]


@dataclass
class Outcome:
    """One graded copy: its exit status, score and failing tests."""

    rc: int | None  # None: killed at TIMEOUT_S
    score: float | None  # None: no results file was written
    max_score: float | None
    failing: list[str]
    seconds: float
    problem: str = ""  # why there is no score

    @property
    def full_marks(self) -> bool:
        return self.rc == 0 and self.score is not None and self.score == self.max_score

    @property
    def caught(self) -> bool:
        """A plant is caught when the check fails with points lost."""
        return self.rc not in (0, None) and self.score is not None and self.score < self.max_score

    @property
    def score_text(self) -> str:
        if self.score is None:
            return "no score"
        return f"{self.score:g}/{self.max_score:g}"


def copy_tree(dest: Path) -> None:
    """The parts of the working tree a phase check reads, without caches."""
    ignore = shutil.ignore_patterns("__pycache__", ".venv", "*.pyc", ".hypothesis")
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


@functools.cache
def solved_starters(phase: str) -> dict[Path, str]:
    """A phase's starters with the reference's code in every region, as
    ``grading solve`` writes them, by path under the labs folder."""
    code = regions.reference_region_code(phase)
    return {
        rel: regions.splice(text, dict(enumerate(code[rel.name])), str(rel))
        for rel, text in regions.starters(phase).items()
        if rel.name != "__init__.py"
    }


def solved_starter(plant: Plant) -> tuple[Path, str]:
    """The plant's file in a solved copy of the labs: (path under it, text)."""
    rel = regions.starter_relpath(plant.phase, REPO / plant.path)
    return rel, solved_starters(plant.phase)[rel]


def apply(plant: Plant, path: Path) -> None:
    """Make the plant's edit in ``path``; ``old`` must occur exactly once."""
    text = path.read_text()
    count = text.count(plant.old)
    if count != 1:
        raise SystemExit(f"{path}: the snippet of {plant.what!r} occurs {count} times, not once")
    path.write_text(text.replace(plant.old, plant.new))


def grading_env(root: Path, tier: str) -> dict[str, str]:
    env = dict(os.environ, MINI_VLLM_TIER=tier, PYTHONPATH=str(root))
    for name in ("IMPL", "MINI_VLLM_LABS_DIR"):
        env.pop(name, None)  # grade only what the command line names
    return env


def check_imports_copy(root: Path, env: dict[str, str]) -> None:
    """Fail unless ``python -m mini_vllm...`` in the copy finds the copy's package
    (the venv's editable install points at the checkout)."""
    probe = "import importlib.util; print(importlib.util.find_spec('mini_vllm').origin)"
    origin = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, env=env, capture_output=True, text=True
    ).stdout.strip()
    if not Path(origin).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"the copy at {root} imports mini_vllm from {origin}")


def run(cmd: list[str], root: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *cmd],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def grade(phase: str, plant: Plant | None, tier: str, into: str) -> Outcome:
    """Copy the tree, plant (unless None), and grade ``phase`` in the copy."""
    root = Path(tempfile.mkdtemp(prefix=f"planted-{phase}-"))
    try:
        copy_tree(root)
        env = grading_env(root, tier)
        check_imports_copy(root, env)
        check = ["mini_vllm.grading", "check", phase, "--no-upstream-tests"]
        check += ["--results", str(root / "r.json")]
        if into == "solved":
            solved = root / "solved"
            made = run(["mini_vllm.grading", "solve", "--out", str(solved)], root, env)
            if made.returncode != 0:
                raise SystemExit(f"grading solve failed:\n{made.stdout}{made.stderr}")
            if plant is not None:
                apply(plant, solved / regions.starter_relpath(phase, REPO / plant.path))
            check += ["--labs-dir", str(solved)]
        else:
            if plant is not None:
                apply(plant, root / plant.path)
            check += ["--impl", "ref"]
        if phase in LEFT_OUT:  # pytest's options come after the tool's
            check += ["--", f"--deselect={LEFT_OUT[phase]}"]
        start = time.monotonic()
        try:
            proc = run(check, root, env)
        except subprocess.TimeoutExpired:
            seconds = time.monotonic() - start
            return Outcome(None, None, None, [], seconds, f"killed after {TIMEOUT_S} s")
        seconds = time.monotonic() - start
        results = root / "r.json"
        if not results.exists():
            tail = (proc.stdout + proc.stderr)[-3000:]
            return Outcome(proc.returncode, None, None, [], seconds, f"no results file:\n{tail}")
        summary = json.loads(results.read_text())
        failing = [t["name"] for t in summary["tests"] if t["status"] != "passed"]
        return Outcome(proc.returncode, summary["score"], summary["max_score"], failing, seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(phase: str, verdict: str, what: str, out: Outcome) -> None:
    print(f"[{phase}] {verdict} {what}: {out.score_text} in {out.seconds:.0f} s")
    for name in out.failing:
        print(f"    failed: {name}")
    if out.problem:
        print(f"    {out.problem}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", help="only this phase's plants (e.g. 03)")
    parser.add_argument("--plant", type=int, help="only the phase's N-th plant (1-based)")
    parser.add_argument("--tier", choices=["fast", "deep"], default="fast")
    parser.add_argument(
        "--into",
        choices=["solved", "reference"],
        default="solved",
        help="plant into a solved copy of the labs (default) or into mini_vllm itself",
    )
    parser.add_argument(
        "--baseline", action="store_true", help="grade an unplanted copy of each phase first"
    )
    args = parser.parse_args(argv)
    phases = sorted({p.phase for p in PLANTS})
    if args.phase is not None and args.phase not in phases:
        parser.error(f"no plants for phase {args.phase!r}; phases: {' '.join(phases)}")
    if args.plant is not None and args.phase is None:
        parser.error("--plant needs --phase")
    rows: list[tuple[str, str, str, Outcome]] = []  # phase, caught, what, outcome
    ok = True
    for phase in [args.phase] if args.phase else phases:
        plants = [p for p in PLANTS if p.phase == phase]
        if args.plant is not None:
            if not 1 <= args.plant <= len(plants):
                parser.error(f"phase {phase} has plants 1..{len(plants)}")
            plants = [plants[args.plant - 1]]
        if args.baseline:
            base = grade(phase, None, args.tier, args.into)
            report(phase, "FULL" if base.full_marks else "NOT FULL", "baseline (no plant)", base)
            ok &= base.full_marks
            rows.append((phase, "-", "baseline (no plant)", base))
        for plant in plants:
            out = grade(phase, plant, args.tier, args.into)
            report(phase, "CAUGHT" if out.caught else "MISSED", plant.what, out)
            ok &= out.caught
            rows.append((phase, "yes" if out.caught else "NO", plant.what, out))
    print(f"\nMINI_VLLM_TIER={args.tier}, planted into: {args.into}")
    print(f"{'phase':<6} {'caught':<7} {'score':>9} {'seconds':>8}  what")
    for phase, caught, what, out in rows:
        print(f"{phase:<6} {caught:<7} {out.score_text:>9} {out.seconds:>8.0f}  {what}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
