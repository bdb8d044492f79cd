"""Stop strings, end to end: SamplingParams, the detokenizer, the output
processor and the engine.

Rules checked (upstream behaviour at v0.22.1):
- ``stop`` takes a string or a list; an empty stop string is rejected, with
  upstream's message (vllm/sampling_params.py:539);
- the engine's text is HF transformers' greedy text cut before the first
  stop string (or after it with ``include_stop_str_in_output``), with
  ``finish_reason="stop"`` and ``stop_reason`` = the string;
- the request is aborted in EngineCore, so it is never scheduled again and
  every KV block returns to the pool;
- while a request runs, its text hides the last ``len(stop) - 1``
  characters (they may become a stop string);
- a model without a tokenizer refuses stop strings.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy

from mini_vllm.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from mini_vllm.engine.detokenizer import IncrementalDetokenizer
from mini_vllm.engine.output_processor import OutputProcessor
from mini_vllm.model_executor.model_loader import load_model
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.oracle.lifecycle import make_engine
from mini_vllm.sampling_params import SamplingParams

PROMPT = "Write a haiku about the sea:"
N = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(loaded tiny Llama with SmolLM2's tokenizer, its HF greedy text for PROMPT)."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(
        tmp_path_factory.mktemp("tiny_tok"), arch="llama", seed=0, tokenizer=True
    )
    loaded = load_model(folder, device="cpu", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = hf_greedy(hf, loaded.tokenizer.encode(PROMPT), N)
    return loaded, ids


def run(engine, params):
    engine.add_request("r", PROMPT, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


# ------------------------------------------------------------ SamplingParams


def test_stop_accepts_a_string_or_a_list():
    assert SamplingParams().stop == []
    assert SamplingParams(stop="ab").stop == ["ab"]
    given = ["a", "b"]
    p = SamplingParams(stop=given)
    assert p.stop == given and p.stop is not given


@pytest.mark.parametrize("stop", [[""], ["a", ""], [3]])
def test_bad_stop_strings_are_rejected(stop):
    with pytest.raises(ValueError, match="^stop"):
        SamplingParams(stop=stop)


@pytest.mark.upstream
def test_stop_normalisation_and_empty_string_match_upstream():
    from vllm.sampling_params import SamplingParams as Upstream

    for stop in (None, "x", ["x", "yz"]):
        assert SamplingParams(stop=stop).stop == Upstream(stop=stop).stop
    with pytest.raises(ValueError) as theirs:
        Upstream(stop=[""])
    with pytest.raises(ValueError) as mine:
        SamplingParams(stop=[""])
    assert str(mine.value) == str(theirs.value)


# ------------------------------------------------------------ the engine


@pytest.mark.parametrize("include", [False, True])
def test_engine_text_is_hf_greedy_text_cut_at_the_stop_string(tiny, include):
    loaded, hf_ids = tiny
    tok = loaded.tokenizer
    full = tok.decode(hf_ids)
    # A stop string that starts inside HF's 6th token's text and spans into
    # the 7th (so it crosses a token boundary), and is not found earlier.
    cut = len(tok.decode(hf_ids[:6]))
    stop = full[cut - 1 : cut + 1]
    first = full.find(stop)
    engine = make_engine(loaded, num_gpu_blocks=32)
    free_before = engine.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    outs = run(
        engine,
        SamplingParams(
            temperature=0.0,
            max_tokens=N,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        ),
    )
    last = outs[-1].outputs[0]
    want = full[: first + len(stop)] if include else full[:first]
    assert (last.text, last.finish_reason, last.stop_reason) == (want, "stop", stop)
    assert outs[-1].finished and sum(o.finished for o in outs) == 1
    # The tokens up to the one that completed the stop string are reported.
    assert last.token_ids == hf_ids[: len(last.token_ids)] and len(last.token_ids) < N
    sched = engine.engine_core.scheduler
    # Aborted and freed at once; only its id waits to be reported in the
    # next SchedulerOutput's finished_req_ids (so the model runner drops it).
    assert sched.get_num_unfinished_requests() == 0 and sched.finished_req_ids == {"r"}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before


def test_running_text_holds_back_a_possible_stop_string(tiny):
    loaded, hf_ids = tiny
    stop = "\x00never"  # never generated: the request runs to max_tokens
    engine = make_engine(loaded, num_gpu_blocks=32)
    outs = run(engine, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, stop=[stop]))
    full = loaded.tokenizer.decode(hf_ids)
    for out in outs[:-1]:
        text = out.outputs[0].text
        assert not out.finished and full.startswith(text)
    # Unfinished outputs hide len(stop) - 1 characters; the final one shows all.
    detok = IncrementalDetokenizer(loaded.tokenizer, [1], params=SamplingParams(stop=[stop]))
    detok.update(hf_ids)
    assert detok.get_next_output_text(False) == full[: -(len(stop) - 1)]
    assert outs[-1].outputs[0].text == full and outs[-1].outputs[0].finish_reason == "length"


def test_a_model_without_a_tokenizer_refuses_stop_strings(tiny):
    loaded, _ = tiny
    engine = make_engine(loaded._replace(tokenizer=None), num_gpu_blocks=32)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("r", [1, 2, 3], SamplingParams(stop=["x"]))
    assert not engine.has_unfinished_requests()


# ------------------------------------------------------------ output processor


def test_output_processor_asks_to_abort_what_it_finished(tiny):
    loaded, hf_ids = tiny
    tok = loaded.tokenizer
    proc = OutputProcessor(tok)
    stop = tok.decode(hf_ids[:3])[-2:]
    params = SamplingParams(stop=[stop])
    proc.add_request("a", None, [1, 2], 0.0, params)
    proc.add_request("b", None, [1, 2], 0.0, SamplingParams())
    out = proc.process_outputs(
        EngineCoreOutputs([EngineCoreOutput("a", hf_ids[:3]), EngineCoreOutput("b", [5])])
    )
    assert out.reqs_to_abort == ["a"]
    finished = {o.request_id: o.finished for o in out.request_outputs}
    assert finished == {"a": True, "b": False}
    # Finished by EngineCore itself (a stop token): nothing to abort.
    out = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("b", [6], FinishReason.STOP)]))
    assert out.reqs_to_abort == [] and not proc.has_unfinished_requests()
    # A user abort reports only the ids still known.
    proc.add_request("c", None, [1], 0.0, SamplingParams())
    assert proc.abort_requests(["c", "zzz"]) == ["c"]
