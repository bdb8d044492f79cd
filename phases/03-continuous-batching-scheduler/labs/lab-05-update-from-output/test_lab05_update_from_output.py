"""Lab 03.5 — taking in the model's output: stops, finish reasons, freeing.

Graded: the ``LAB 03.5`` regions of ``labs/phase_03/utils.py``
(``check_stop``) and of ``labs/phase_03/scheduler.py``
(``_update_request_with_output``; in ``update_from_output``, finishing and
freeing a stopped request, then dropping the stopped requests from
``running``). Every other region holds the reference's code while this lab
is graded.

The order of the checks in ``check_stop`` is the rule most often broken. A
request's last token is checked against, in this order:

1. ``min_tokens`` not reached yet -> keep going, whatever the token is;
2. EOS -> FINISHED_STOPPED (``stop_reason`` stays None);
3. a stop token -> FINISHED_STOPPED, ``stop_reason`` = that token;
4. ``max_model_len`` or ``max_tokens`` reached -> FINISHED_LENGTH_CAPPED.

Read the tests top to bottom: ``check_stop`` alone on one request, then
``update_from_output`` on a scheduler, then properties (a model that returns
several tokens per step, as speculative decoding does; your scheduler
against the reference), then upstream's own recorded traces.
"""

from __future__ import annotations

import traceback
import zlib

import pytest
from hypothesis import given

import mini_vllm.testing as mini
from mini_vllm.engine import FinishReason
from mini_vllm.grading import checks
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle import strategies
from mini_vllm.oracle.workload import Progress, fake_token, make_request
from mini_vllm.outputs import ModelRunnerOutput
from mini_vllm.request import RequestStatus

# What the finished_lab fixture (labs/conftest.py) runs first.
FAIL_FAST_SCENARIO = "stop_conditions"
PROPERTY = lab_settings(150, shrink=True)

EOS = mini.EOS_TOKEN_ID
STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED


# ------------------------------------------------------------------ helpers


def request(prompt_len=6, max_tokens=10, min_tokens=0, stop=None, ignore_eos=False, req_id="r"):
    """A RUNNING request (as the scheduler holds it when tokens come back)."""
    (req,) = mini.create_requests(
        1,
        req_ids=[req_id],
        prompt_token_ids=[[5] * prompt_len],
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=stop,
        ignore_eos=ignore_eos,
    )
    req.status = RequestStatus.RUNNING
    return req


def feed(check_stop, req, tokens, max_model_len=1000):
    """Append tokens one by one, calling check_stop after each, as the
    scheduler does. Returns (how many were appended, what check_stop said last)."""
    for k, tok in enumerate(tokens, 1):
        req.append_output_token_ids(tok)
        stopped = check_stop(req, max_model_len)
        assert stopped in (True, False), f"check_stop must return True or False, got {stopped!r}."
        assert stopped == req.is_finished(), (
            f"check_stop returned {stopped} but left the request {req.status.name}: it returns "
            f"True exactly when it has set a finished status."
        )
        if stopped:
            return k, True
    return len(tokens), False


def describe(req) -> str:
    return (
        f"status {req.status.name}, stop_reason {req.stop_reason!r}, outputs "
        f"{list(req.output_token_ids)}"
    )


def make(impl, **config):
    return mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **config)


def requests(ids, prompt_len=6, block_size=16, **kwargs):
    return mini.create_requests(
        len(ids),
        req_ids=list(ids),
        block_size=block_size,
        prompt_token_ids=[[i + 1] * prompt_len for i in range(len(ids))],
        **kwargs,
    )


def schedule(sched, label: str):
    try:
        return sched.schedule()
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - turned into a message
        where = traceback.extract_tb(e.__traceback__)[-1]
        pytest.fail(
            f"{label}: schedule() raised {type(e).__name__}: {e} (at `{where.line}`). "
            f"Did update_from_output leave a finished request in self.running?",
            pytrace=False,
        )


def runner_output(out, sampled: dict) -> ModelRunnerOutput:
    """What the model returns for this step: ``sampled[req_id]`` (a list of
    tokens; several per request, as with speculative decoding), [] otherwise."""
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[list(sampled.get(r, [])) for r in req_ids],
    )


def by_id(result) -> dict:
    return {o.request_id: o for o in result.outputs}


# ---------------------------------------------------------- 1. check_stop


@pytest.mark.points(1)
def test_eos_stops_the_request(impl):
    req = request()
    n, stopped = feed(impl.utils.check_stop, req, [1000, 1001, EOS, 1002])
    assert (n, stopped, req.status, req.stop_reason) == (3, True, STOPPED, None), (
        f"Outputs 1000, 1001, EOS: the third token is EOS (id {EOS}), so the request is "
        f"FINISHED_STOPPED right there with no stop_reason (EOS is not a stop token). Expected "
        f"a stop at token 3; got stopped={stopped} after {n} tokens, {describe(req)}."
    )


@pytest.mark.points(2)
def test_min_tokens_holds_off_eos_and_stop_tokens(impl):
    req = request(min_tokens=3, stop=[7])
    n, stopped = feed(impl.utils.check_stop, req, [EOS, 7, EOS, 1000])
    assert (n, stopped, req.status, req.stop_reason) == (3, True, STOPPED, None), (
        f"Rule 1 comes first: with min_tokens=3 the request keeps going until it has 3 "
        f"outputs, even if it samples EOS (output 1) or a stop token (output 2). Outputs EOS, "
        f"7, EOS must stop at output 3 (EOS, no stop_reason). Got stopped={stopped} after "
        f"{n} tokens, {describe(req)}. Check `num_output_tokens < min_tokens` before "
        f"anything else."
    )


@pytest.mark.points(2)
def test_stop_token_stops_and_sets_stop_reason(impl):
    req = request(stop=[7, 9])
    n, stopped = feed(impl.utils.check_stop, req, [1000, 9, 1001])
    assert (n, stopped, req.status) == (2, True, STOPPED), (
        f"stop_token_ids=[7, 9]: output 2 is 9, a stop token, so the request is "
        f"FINISHED_STOPPED at output 2; got stopped={stopped} after {n} tokens, "
        f"{describe(req)}."
    )
    assert req.stop_reason == 9, (
        f"A stop token sets request.stop_reason to the token that stopped it (here 9), so "
        f"the client can tell which stop fired (it travels in EngineCoreOutput.stop_reason); "
        f"got stop_reason {req.stop_reason!r}."
    )


@pytest.mark.points(1)
def test_eos_is_checked_before_stop_tokens(impl):
    req = request(stop=[EOS, 7])
    n, stopped = feed(impl.utils.check_stop, req, [1000, EOS])
    assert (n, stopped, req.status, req.stop_reason) == (2, True, STOPPED, None), (
        f"EOS is also listed in stop_token_ids here; rule 2 (EOS) comes before rule 3 (stop "
        f"tokens), so the request stops as an EOS: FINISHED_STOPPED with stop_reason None, "
        f"as upstream reports it. Got stopped={stopped} after {n} tokens, {describe(req)}."
    )


@pytest.mark.points(2)
def test_eos_and_stop_tokens_beat_the_length_cap(impl):
    check = impl.utils.check_stop
    req = request(max_tokens=3)
    feed(check, req, [1000, 1001, EOS])
    assert (req.status, req.stop_reason) == (STOPPED, None), (
        f"max_tokens=3 and output 3 is EOS: both EOS and the length cap apply, and EOS "
        f"(rule 2) is checked before the cap (rule 4): FINISHED_STOPPED, not "
        f"FINISHED_LENGTH_CAPPED. Got {describe(req)}."
    )
    req = request(max_tokens=3, stop=[7])
    feed(check, req, [1000, 1001, 7])
    assert (req.status, req.stop_reason) == (STOPPED, 7), (
        f"max_tokens=3 and output 3 is the stop token 7: the stop token (rule 3) wins over the "
        f"cap (rule 4): FINISHED_STOPPED with stop_reason 7. Got {describe(req)}."
    )
    req = request(prompt_len=6, max_tokens=50, stop=[7])
    feed(check, req, [1000, 1001, 7], max_model_len=9)
    assert (req.status, req.stop_reason) == (STOPPED, 7), (
        f"Prompt 6, max_model_len=9: output 3 brings the request to 9 tokens = max_model_len, "
        f"and it is the stop token 7. The stop token wins: FINISHED_STOPPED, stop_reason 7. "
        f"Got {describe(req)}."
    )


@pytest.mark.points(2)
def test_length_caps(impl):
    check = impl.utils.check_stop
    req = request(max_tokens=4)
    n, stopped = feed(check, req, [1000, 1001, 1002, 1003, 1004])
    assert (n, stopped, req.status, req.stop_reason) == (4, True, LENGTH, None), (
        f"max_tokens=4: the 4th output ends the request, FINISHED_LENGTH_CAPPED "
        f"(num_output_tokens >= max_tokens), not one token later or earlier. Got "
        f"stopped={stopped} after {n} tokens, {describe(req)}."
    )
    req = request(prompt_len=6, max_tokens=50)
    n, stopped = feed(check, req, [1000, 1001, 1002, 1003], max_model_len=9)
    assert (n, stopped, req.status) == (3, True, LENGTH), (
        f"Prompt 6, max_model_len=9, max_tokens=50: after 3 outputs the request holds 9 "
        f"tokens = max_model_len, so it is FINISHED_LENGTH_CAPPED (num_tokens >= "
        f"max_model_len) even though max_tokens is far away. Got stopped={stopped} after {n} "
        f"tokens, {describe(req)}."
    )
    req = request(max_tokens=5, ignore_eos=True)
    n, stopped = feed(check, req, [EOS, EOS, 1000])
    assert (n, stopped, req.status) == (3, False, RequestStatus.RUNNING), (
        f"ignore_eos=True: the engine leaves sampling_params.eos_token_id at None, so EOS is "
        f"an ordinary token; nothing else applies (max_tokens=5). Got stopped={stopped} after "
        f"{n} tokens, {describe(req)}."
    )


# ---------------------------------------------- 2. update_from_output


@pytest.mark.points(2)
def test_tokens_after_the_stopping_token_are_dropped(impl):
    sched = make(impl, max_model_len=256)
    a, b, c = requests("abc", max_tokens=10, stop_token_ids=[7])
    b.max_tokens = 2
    for r in (a, b, c):
        sched.add_request(r)
    out = schedule(sched, "step 0")
    result = sched.update_from_output(
        out,
        runner_output(
            out, {"a": [1000, 7, 1001, 1002], "b": [1000, 1001, 1002], "c": [1000, 1001, 1002]}
        ),
    )
    got = by_id(result)
    assert list(a.output_token_ids) == [1000, 7] and got["a"].new_token_ids == [1000, 7], (
        f"The model returned 4 tokens for a (as a speculative decoder can): 1000, 7, 1001, "
        f"1002. Appending them ONE BY ONE with check_stop after each, a stops at 7 (a stop "
        f"token); the tokens after it were never really generated and must be dropped from "
        f"both the request and the output. Expected [1000, 7]; the request holds "
        f"{list(a.output_token_ids)}, the output reports {got['a'].new_token_ids}."
    )
    assert list(b.output_token_ids) == [1000, 1001] and got["b"].new_token_ids == [1000, 1001], (
        f"b has max_tokens=2 and the model returned 3 tokens: it is length-capped at its 2nd "
        f"token and the 3rd is dropped. The request holds {list(b.output_token_ids)}, the "
        f"output reports {got['b'].new_token_ids}; expected [1000, 1001]."
    )
    assert list(c.output_token_ids) == [1000, 1001, 1002], (
        f"c does not stop, so all 3 of its tokens are kept and it keeps RUNNING; got {describe(c)}."
    )
    assert not c.is_finished(), (
        f"c does not stop, so all 3 of its tokens are kept and it keeps RUNNING; got {describe(c)}."
    )


@pytest.mark.points(3)
def test_stopped_request_is_finished_freed_and_leaves_running(impl):
    sched = make(impl, max_model_len=256)
    a, b, c = requests("abc", prompt_len=20, max_tokens=10, stop_token_ids=[7])
    for r in (a, b, c):
        sched.add_request(r)
    out = schedule(sched, "step 0")
    sched.update_from_output(out, runner_output(out, {"a": [1000], "b": [1000], "c": [1000]}))
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    b_blocks = len(sched.kv_cache_manager.get_block_ids("b")[0])
    out = schedule(sched, "step 1")
    result = sched.update_from_output(out, runner_output(out, {"a": [1001], "b": [7], "c": [1001]}))
    got = by_id(result)
    assert (
        "b" in got and got["b"].finish_reason == FinishReason.STOP and got["b"].stop_reason == 7
    ), (
        f"Step 1: b sampled its stop token 7. Its EngineCoreOutput must say so: "
        f"finish_reason STOP (request.get_finished_reason()) and stop_reason 7. Got "
        f"{got.get('b')}."
    )
    assert got["a"].finish_reason is None and got["c"].finish_reason is None, (
        f"Step 1: a and c did not stop: their outputs carry finish_reason None; got "
        f"a={got['a'].finish_reason}, c={got['c'].finish_reason}."
    )
    running = [r.request_id for r in sched.running]
    assert running == ["a", "c"], (
        f"Step 1: b finished, so it must leave self.running at once (remove_all over the "
        f"stopped set, keeping the others' order): expected ['a', 'c'], got {running}. A "
        f"finished request left in running would be scheduled again next step."
    )
    assert "b" not in sched.requests and "b" not in sched.kv_cache_manager.req_to_blocks, (
        f"Step 1: a stopped request is freed at once (self._free_request): removed from "
        f"self.requests and its KV blocks released. b is "
        f"{'still' if 'b' in sched.requests else 'no longer'} in requests and "
        f"{'still holds' if 'b' in sched.kv_cache_manager.req_to_blocks else 'holds no'} "
        f"blocks."
    )
    free_after = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free_after == free_before + b_blocks, (
        f"Step 1: freeing b returns its {b_blocks} block(s): {free_before} free before, "
        f"expected {free_before + b_blocks} after, got {free_after}."
    )
    out = schedule(sched, "step 2")
    assert out.finished_req_ids == {"b"}, (
        f"Step 2: the workers learn that b finished from finished_req_ids (filled by "
        f"_free_request), and b is not scheduled: expected finished {{'b'}}, got "
        f"{out.finished_req_ids}; scheduled {dict(out.num_scheduled_tokens)}."
    )
    assert "b" not in out.num_scheduled_tokens, (
        f"Step 2: the workers learn that b finished from finished_req_ids (filled by "
        f"_free_request), and b is not scheduled: expected finished {{'b'}}, got "
        f"{out.finished_req_ids}; scheduled {dict(out.num_scheduled_tokens)}."
    )
    sched.update_from_output(out, runner_output(out, {"a": [EOS], "c": [7]}))
    running = [r.request_id for r in sched.running]
    assert running == [], (
        f"Step 2: a (EOS) and c (stop token) both stop in the same step, so running must be "
        f"empty afterwards; got running {running}, a {a.status.name}, c {c.status.name}. "
        f"remove_all RETURNS the new list when it removes more than one request: assign it "
        f"(self.running = remove_all(...))."
    )
    assert a.status == c.status == STOPPED, (
        f"Step 2: a (EOS) and c (stop token) both stop in the same step, so running must be "
        f"empty afterwards; got running {running}, a {a.status.name}, c {c.status.name}. "
        f"remove_all RETURNS the new list when it removes more than one request: assign it "
        f"(self.running = remove_all(...))."
    )


@pytest.mark.points(2)
def test_abort_while_the_model_runs(impl):
    sched = make(impl, max_model_len=256, max_num_seqs=2)
    a, b, w = requests(["a", "b", "w"], max_tokens=4)
    for r in (a, b, w):
        sched.add_request(r)
    out = schedule(sched, "step 0")
    # Aborted between schedule() and update_from_output(): a is running, w waits.
    assert sorted(sched.finish_requests(["a", "w"], RequestStatus.FINISHED_ABORTED)) == ["a", "w"]
    result = sched.update_from_output(out, runner_output(out, {"a": [1000], "b": [1000]}))
    got = by_id(result)
    assert "a" not in got and list(a.output_token_ids) == [], (
        f"a was aborted while the model ran: update_from_output skips it (it is no longer in "
        f"self.requests), so its sampled token is dropped and no output is made; got outputs "
        f"{sorted(got)}, a holds {list(a.output_token_ids)}."
    )
    assert (
        list(got) == ["b"]
        and got["b"].new_token_ids == [1000]
        and [r.request_id for r in sched.running] == ["b"]
    ), (
        f"b was not aborted: it gets its token and keeps running. Outputs {sorted(got)}, "
        f"running {[r.request_id for r in sched.running]}."
    )
    for i in range(1, 5):
        out = schedule(sched, f"step {i}")
        if i == 1:
            assert out.finished_req_ids == {"a", "w"}, (
                f"Step 1: the aborted a and w are reported to the workers once, in "
                f"finished_req_ids; got {out.finished_req_ids}."
            )
        result = sched.update_from_output(out, runner_output(out, {"b": [1000 + i]}))
    assert b.status == LENGTH and sched.running == [] and not sched.has_unfinished_requests(), (
        f"b (max_tokens=4) must finish length-capped after 4 tokens and leave running; got "
        f"{describe(b)}, running {[r.request_id for r in sched.running]}."
    )


# ---------------------------------------------------------------- properties


def first_stop(req, max_model_len):
    """(k, status, stop_reason) of the first output at which check_stop's
    rules end the request, or None."""
    p = req.sampling_params
    for k, tok in enumerate(req.output_token_ids, 1):
        if k < p.min_tokens:
            continue
        if tok == p.eos_token_id:
            return k, STOPPED, None
        if tok in p.stop_token_ids:
            return k, STOPPED, tok
        if req.num_prompt_tokens + k >= max_model_len or k >= req.max_tokens:
            return k, LENGTH, None
    return None


def run_with_speculation(impl, workload):
    """The workload loop, with a model that returns 1 to 3 tokens per request
    and step; checks the stop rules and the freeing after every step."""
    sched = make(impl, **workload.config)
    max_model_len = sched.max_model_len
    block_size = workload.config.get("block_size", 16)
    specs = {s.req_id: s for s in workload.requests}
    arrivals = sorted(workload.requests, key=lambda s: s.arrive_step)
    objects = {}
    finished_since = set()
    reported = set()
    progress = Progress()
    nxt = 0
    for i in range(workload.max_steps):
        while nxt < len(arrivals) and arrivals[nxt].arrive_step <= i:
            s = arrivals[nxt]
            r = make_request(mini, s, float(workload.requests.index(s)), block_size)
            sched.add_request(r)
            objects[s.req_id] = r
            nxt += 1
        aborts = sorted(s.req_id for s in workload.requests if s.abort_step == i)
        if aborts:
            finished_since |= set(sched.finish_requests(aborts, RequestStatus.FINISHED_ABORTED))
        if nxt == len(arrivals) and not sched.has_requests():
            break
        out = schedule(sched, f"step {i}")
        assert set(out.finished_req_ids) == finished_since, (
            f"step {i}: finished_req_ids must hold exactly the requests finished since the "
            f"previous step ({sorted(finished_since)}); got {sorted(out.finished_req_ids)}."
        )
        finished_since = set()
        sampled = {}
        for r in out.num_scheduled_tokens:
            req = sched.requests[r]
            if req.num_computed_tokens >= req.num_tokens:
                n = 1 + zlib.crc32(f"{r}:{req.num_output_tokens}".encode()) % 3
                sampled[r] = [
                    fake_token(specs[r], req.num_output_tokens + j, mini.EOS_TOKEN_ID)
                    for j in range(n)
                ]
        before = {r: objects[r].num_output_tokens for r in sampled}
        result = sched.update_from_output(out, runner_output(out, sampled))
        progress.after_step(sched, i)
        for o in result.outputs:
            req = objects[o.request_id]
            kept = list(req.output_token_ids[before[o.request_id] :])
            where = f"step {i}, request {o.request_id} (model returned {sampled[o.request_id]})"
            assert o.new_token_ids == kept == sampled[o.request_id][: len(kept)], (
                f"{where}: the output reports {o.new_token_ids} and the request appended "
                f"{kept}; both must be the model's tokens up to and including the stopping "
                f"one."
            )
            assert o.request_id not in reported, f"{where}: reported finished twice."
            if o.finish_reason is not None:
                reported.add(o.request_id)
                finished_since.add(o.request_id)
                assert (
                    o.finish_reason == req.get_finished_reason()
                    and o.stop_reason == req.stop_reason
                ), (
                    f"{where}: the output says finish_reason {o.finish_reason}, stop_reason "
                    f"{o.stop_reason!r}; the request is {req.status.name}, stop_reason "
                    f"{req.stop_reason!r}."
                )
                assert (
                    o.request_id not in sched.requests
                    and o.request_id not in sched.kv_cache_manager.req_to_blocks
                ), (
                    f"{where}: the request finished, so it must be freed at once "
                    f"(self._free_request: out of self.requests, its blocks released)."
                )
                assert req not in sched.running, (
                    f"{where}: the request finished, so it must leave self.running in this "
                    f"same update_from_output (self.running = remove_all(...))."
                )
            else:
                assert not req.is_finished(), (
                    f"{where}: the request is {req.status.name} but its output says "
                    f"finish_reason None: a stopped request reports "
                    f"request.get_finished_reason()."
                )
                assert kept == sampled[o.request_id], (
                    f"{where}: the request did not stop, so every token must be kept; kept {kept}."
                )
        for req in sched.running:
            assert req.status == RequestStatus.RUNNING, (
                f"step {i}: {req.request_id} is {req.status.name} but still in self.running."
            )
        for r, req in objects.items():
            expected = first_stop(req, max_model_len)
            if req.status == RequestStatus.FINISHED_ABORTED or not req.is_finished():
                assert expected is None, (
                    f"step {i}: {r} should have stopped at output {expected[0]} "
                    f"({expected[1].name}, stop_reason {expected[2]!r}) but is "
                    f"{req.status.name}; {describe(req)}; min_tokens "
                    f"{req.sampling_params.min_tokens}, max_tokens {req.max_tokens}, "
                    f"stop_token_ids {req.sampling_params.stop_token_ids}, prompt "
                    f"{req.num_prompt_tokens}, max_model_len {max_model_len}."
                )
            else:
                got = (req.num_output_tokens, req.status, req.stop_reason)
                assert expected is not None, (
                    f"step {i}: {r} is {req.status.name} after {got[0]} outputs, but no rule "
                    f"ends it yet (min_tokens {req.sampling_params.min_tokens}, max_tokens "
                    f"{req.max_tokens}, stop_token_ids {req.sampling_params.stop_token_ids}, "
                    f"prompt {req.num_prompt_tokens}, max_model_len {max_model_len}); "
                    f"{describe(req)}. Is min_tokens checked first?"
                )
                assert got == expected, (
                    f"step {i}: {r}: by the rules (min_tokens {req.sampling_params.min_tokens} "
                    f"-> EOS -> stop tokens {req.sampling_params.stop_token_ids} -> length: "
                    f"max_tokens {req.max_tokens}, prompt {req.num_prompt_tokens}, "
                    f"max_model_len {max_model_len}) it ends at output {expected[0]} as "
                    f"{expected[1].name}, stop_reason {expected[2]!r}; got {got[0]} outputs, "
                    f"{got[1].name}, stop_reason {got[2]!r} ({describe(req)})."
                )
    else:
        raise AssertionError("the workload did not finish")
    assert (
        sched.kv_cache_manager.block_pool.get_num_free_blocks()
        == sched.kv_cache_manager.block_pool.num_gpu_blocks - 1
    ), "Every request is done, so every block must be free again: a finished request was not freed."


@pytest.mark.timeout(60)
@pytest.mark.points(3)
@PROPERTY
@given(workload=strategies.workloads())
def test_property_first_stop_wins_with_several_tokens_per_step(finished_lab, workload):
    run_with_speculation(finished_lab, workload)


@pytest.mark.timeout(60)
@pytest.mark.points(3)
@PROPERTY
@given(workload=strategies.workloads())
def test_property_same_trace_as_the_reference(finished_lab, workload):
    mismatch = checks.reference_mismatch(finished_lab.scheduler.Scheduler, workload)
    assert mismatch is None, "Your scheduler and the reference differ:\n" + mismatch


# ------------------------------------------------- upstream's recorded traces


@pytest.mark.points(1)
@pytest.mark.parametrize("scenario", ["stop_conditions", "aborts"])
def test_snapshot(impl, scenario):
    mismatch = checks.snapshot_mismatch(impl.scheduler.Scheduler, scenario)
    assert mismatch is None, mismatch
