"""Sampling through the real engine: seeds, stop rules, logprobs, detokenization.

Most tests drive the tiny seeded Qwen3 (512-token vocabulary, no tokenizer,
EOS id 2 from its config), which runs a step in milliseconds; HuggingFace
transformers on the same weights is the reference where a value is checked
(greedy tokens, logprobs, which prompt is followed by EOS). The
detokenization tests need a real tokenizer and use SmolLM2-135M.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy

from mini_vllm.engine.detokenizer import IncrementalDetokenizer
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.sample.logits_processor import LogitsProcessor, process_dict_updates
from mini_vllm.sampling_params import SamplingParams

VOCAB = 512  # the tiny model's
EOS = 2  # tiny_config's eos_token_id


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    # max_logprobs=-1 lifts upstream's cap of 20, so that logprobs=-1 (the whole vocabulary) runs.
    return LLM(tiny_qwen3[0], max_model_len=128, kv_cache_memory_bytes=16 << 20, max_logprobs=-1)


def prompts_of(n: int, seed: int = 0, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen).tolist()
    return [torch.randint(3, VOCAB, (n_,), generator=gen).tolist() for n_ in lengths]


def generate(llm: LLM, prompts: list[list[int]], params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@torch.no_grad()
def hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the logits that produced each output token: [len(output), vocab]."""
    logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


RANDOM = dict(temperature=1.0, max_tokens=16, ignore_eos=True)


# ------------------------------------------------------------------- seeds


def test_same_seed_same_tokens_across_runs_and_engines(llm, tiny_qwen3):
    prompt = prompts_of(1, seed=1)[0]
    params = SamplingParams(seed=1234, **RANDOM)
    first = generate(llm, [prompt], params)[0].token_ids
    again = generate(llm, [prompt], params)[0].token_ids
    other_engine = LLM(tiny_qwen3[0], max_model_len=128, kv_cache_memory_bytes=8 << 20)
    fresh = generate(other_engine, [prompt], params)[0].token_ids
    assert first == again == fresh
    assert len(first) == 16
    # Not greedy in disguise: the seeded draw leaves the argmax path.
    assert first != hf_greedy(tiny_qwen3[1], prompt, 16)


def test_different_seeds_give_different_tokens(llm):
    prompt = prompts_of(1, seed=2)[0]
    outs = generate(llm, [prompt] * 4, [SamplingParams(seed=s, **RANDOM) for s in range(4)])
    tokens = [tuple(o.token_ids) for o in outs]
    assert len(set(tokens)) == 4, tokens


def test_seeded_request_alone_equals_seeded_request_in_a_batch(llm, tiny_qwen3):
    prompt = prompts_of(1, seed=3, min_len=20)[0]
    seeded = SamplingParams(seed=77, top_k=50, top_p=0.95, **RANDOM)
    alone = generate(llm, [prompt], seeded)[0].token_ids

    # Eight others: unseeded random (drawing from the global stream, which
    # the seeded row must not share), other seeds, greedy, different
    # lengths, logprobs; the seeded one in the middle. A small token budget
    # chunks the prefills and staggers the requests.
    others = prompts_of(8, seed=4)
    other_params = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.5, top_k=5, max_tokens=12, ignore_eos=True),
        SamplingParams(seed=78, temperature=0.7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.5, max_tokens=9, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(seed=77, temperature=1.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True),
    ]
    batch_llm = LLM(
        tiny_qwen3[0],
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=24,
        max_num_seqs=9,
    )
    prompts = others[:4] + [prompt] + others[4:]
    params = other_params[:4] + [seeded] + other_params[4:]
    torch.manual_seed(999)  # a different global stream from the solo run's
    outs = generate(batch_llm, prompts, params)
    assert outs[4].token_ids == alone
    assert batch_llm.llm_engine.get_stats()["num_steps"] > 16 + 2  # prefills were chunked


# -------------------------------------------------------------- min_tokens


def test_min_tokens_holds_back_a_stop_token(llm, tiny_qwen3):
    prompt = prompts_of(1, seed=5)[0]
    greedy0 = hf_greedy(tiny_qwen3[1], prompt, 1)[0]
    assert greedy0 != EOS

    no_min = generate(
        llm, [prompt], SamplingParams(temperature=0.0, stop_token_ids=[greedy0], max_tokens=10)
    )[0]
    assert no_min.token_ids == [greedy0]
    assert no_min.finish_reason == "stop" and no_min.stop_reason == greedy0

    held = generate(
        llm,
        [prompt],
        SamplingParams(
            temperature=0.0, stop_token_ids=[greedy0], min_tokens=3, max_tokens=10, ignore_eos=True
        ),
    )[0]
    assert len(held.token_ids) >= 3
    assert greedy0 not in held.token_ids[:3]
    if greedy0 in held.token_ids:  # it may stop the request once allowed
        end = held.token_ids.index(greedy0)
        assert end == len(held.token_ids) - 1 and held.finish_reason == "stop"
    else:
        assert held.finish_reason == "length" and len(held.token_ids) == 10
    # The masked step falls back to the runner-up of the raw logits.
    logits = tiny_qwen3[1](torch.tensor([prompt])).logits[0, -1].detach()
    logits[greedy0] = float("-inf")
    assert held.token_ids[0] == int(logits.argmax())


def test_min_tokens_holds_back_a_large_stop_set_under_random_sampling(llm):
    # 160 stop ids carry a good share of the probability at every step, so
    # without min_tokens most requests stop within a few tokens; with
    # min_tokens=6 none of them may appear before the 7th token.
    stop = list(range(3, 163))
    prompts = prompts_of(8, seed=9)

    def run(min_tokens):
        return generate(
            llm,
            prompts,
            [
                SamplingParams(
                    seed=s,
                    temperature=1.0,
                    stop_token_ids=stop,
                    min_tokens=min_tokens,
                    max_tokens=12,
                    ignore_eos=True,
                )
                for s in range(8)
            ],
        )

    free = run(0)
    assert sum(len(o.token_ids) <= 6 for o in free) >= 4, [o.token_ids for o in free]
    for out in run(6):
        assert len(out.token_ids) >= 6
        assert not set(out.token_ids[:6]) & set(stop), out.token_ids
        if out.finish_reason == "stop":
            assert out.stop_reason == out.token_ids[-1] in stop
            assert not set(out.token_ids[:-1]) & set(stop)


@pytest.fixture(scope="module")
def eos_prompt(tiny_qwen3) -> list[int]:
    """A short prompt whose greedy next token (per transformers) is EOS."""
    hf = tiny_qwen3[1]
    with torch.no_grad():
        singles = torch.arange(3, VOCAB).unsqueeze(1)
        hits = (hf(singles).logits[:, -1].argmax(-1) == EOS).nonzero().flatten()
        if len(hits):
            return [int(singles[hits[0], 0])]
        pairs = torch.randint(3, VOCAB, (4096, 2), generator=torch.Generator().manual_seed(0))
        hits = (hf(pairs).logits[:, -1].argmax(-1) == EOS).nonzero().flatten()
    assert len(hits), "no short prompt of the tiny model is followed by EOS"
    return pairs[hits[0]].tolist()


def test_eos_stops_a_request_and_ignore_eos_continues(llm, tiny_qwen3, eos_prompt):
    out = generate(llm, [eos_prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.token_ids == [EOS]
    assert out.finish_reason == "stop" and out.stop_reason is None

    cont = generate(
        llm, [eos_prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )[0]
    assert cont.token_ids == hf_greedy(tiny_qwen3[1], eos_prompt, 8)
    assert cont.token_ids[0] == EOS and len(cont.token_ids) == 8
    assert cont.finish_reason == "length"


def test_min_tokens_also_holds_back_eos(llm, eos_prompt):
    out = generate(llm, [eos_prompt], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2))[
        0
    ]
    assert len(out.token_ids) >= 2
    assert EOS not in out.token_ids[:2]


# ----------------------------------------------------------- max_model_len


def test_max_model_len_caps_the_output(tiny_qwen3):
    max_model_len = 32
    small = LLM(tiny_qwen3[0], max_model_len=max_model_len, kv_cache_memory_bytes=4 << 20)
    prompt = prompts_of(1, seed=6, min_len=max_model_len - 3, max_len=max_model_len - 3)[0]
    big, unset = generate(
        small,
        [prompt, prompt],
        [
            SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
        ],
    )
    for out in (big, unset):
        assert len(out.token_ids) == 3
        assert out.finish_reason == "length" and out.stop_reason is None
    assert big.token_ids == hf_greedy(tiny_qwen3[1], prompt, 3)


# ---------------------------------------------------------------- logprobs


def test_logprobs_per_token_match_transformers(llm, tiny_qwen3):
    prompt = prompts_of(1, seed=7)[0]
    out = generate(
        llm,
        [prompt],
        SamplingParams(seed=5, logprobs=2, temperature=1.0, max_tokens=10, ignore_eos=True),
    )[0]
    ref = hf_logprobs(tiny_qwen3[1], prompt, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 10
    off_top = 0
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        top2 = ref[i].topk(2).indices.tolist()
        assert set(entry) == {tok, *top2}, (i, entry, top2)
        assert list(entry)[0] == tok  # the sampled token comes first
        for t, lp in entry.items():
            assert lp == pytest.approx(float(ref[i, t]), abs=1e-4)
        off_top += tok not in top2
    assert off_top > 0  # some draws left the top 2: the sampled entry is exercised
    assert out.cumulative_logprob == pytest.approx(
        sum(out.logprobs[i][t] for i, t in enumerate(out.token_ids)), abs=1e-5
    )


def test_each_request_gets_its_own_number_of_logprobs(llm):
    prompt = prompts_of(1, seed=8)[0]
    wants = [None, 0, 2, -1]
    outs = generate(
        llm,
        [prompt] * 4,
        [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=n) for n in wants],
    )
    none, zero, two, full = outs
    assert none.logprobs is None and none.cumulative_logprob is None
    assert [list(e) for e in zero.logprobs] == [[t] for t in zero.token_ids]
    # Greedy: the sampled token is the top one, so top-2 adds one more.
    assert all(
        len(e) == 2 and list(e)[0] == t for e, t in zip(two.logprobs, two.token_ids, strict=True)
    )
    assert all(len(e) == VOCAB for e in full.logprobs)  # -1: the whole vocabulary
    for e, t in zip(full.logprobs, full.token_ids, strict=True):
        assert max(e, key=e.get) == t
        assert sum(torch.tensor(list(e.values())).exp()) == pytest.approx(1.0, abs=1e-4)
    assert zero.token_ids == two.token_ids == full.token_ids == none.token_ids


@torch.no_grad()
def test_logprobs_mode_picks_what_the_logprobs_hold(tiny_qwen3):
    """LLM(logprobs_mode=...) as upstream's engine argument: raw_logits reports
    the model's logits, processed_logprobs the log-softmax of what the draw
    used (here top_k=2: two finite entries summing to probability 1). The
    mode changes what is reported, never which tokens are drawn."""
    prompt = prompts_of(1, seed=9)[0]
    params = SamplingParams(seed=3, top_k=2, logprobs=1, **dict(RANDOM, max_tokens=4))
    outs = {}
    for mode in ("raw_logits", "processed_logprobs"):
        engine = LLM(
            tiny_qwen3[0], max_model_len=128, kv_cache_memory_bytes=8 << 20, logprobs_mode=mode
        )
        outs[mode] = generate(engine, [prompt], params)[0]
    raw, processed = outs["raw_logits"], outs["processed_logprobs"]
    assert raw.token_ids == processed.token_ids
    logits = tiny_qwen3[1](torch.tensor([prompt + raw.token_ids])).logits[0, len(prompt) - 1 : -1]
    for i, tok in enumerate(raw.token_ids):
        for t, value in raw.logprobs[i].items():
            assert value == pytest.approx(float(logits[i, t]), abs=1e-4), ("raw_logits", i, t)
        top2 = logits[i].topk(2)
        want = dict(zip(top2.indices.tolist(), top2.values.log_softmax(-1).tolist(), strict=True))
        assert tok in want, (i, tok, want)  # top_k=2 drew from the top two
        assert processed.logprobs[i][tok] == pytest.approx(want[tok], abs=1e-4), i


def test_an_unknown_logprobs_mode_is_refused_before_loading():
    with pytest.raises(ValueError, match="^logprobs_mode must be one of raw_logprobs, raw_logits"):
        LLM("/no/such/model", logprobs_mode="logprobs")


# ------------------------------------------------------- detokenization


@pytest.fixture(scope="module")
def smollm2():
    return LLM(str(smollm2_gguf_path()), max_model_len=256, kv_cache_memory_bytes=16 << 20)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_smollm2_text_is_the_decoded_tokens(smollm2):
    out = smollm2.generate(
        "The capital of France is", SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )[0]
    completion = out.outputs[0]
    assert len(completion.token_ids) == 8
    assert completion.text == decode(smollm2.get_tokenizer(), completion.token_ids)
    assert completion.text.startswith(" Paris")


DETOK_PROMPTS = [
    "The capital of France is",
    "Café ☕ 日本",
    "日本の首都は",
    "Emoji party: 🎉🎈",
    "Привет, как дела?",
]


def test_streamed_text_matches_a_full_decode_at_every_step(smollm2):
    """At every step the cumulative text is the full decode of the tokens so
    far, except that a trailing incomplete character (which a full decode
    shows as U+FFFD) is held back until it is complete."""
    tok = smollm2.get_tokenizer()
    engine = smollm2.llm_engine
    params = [SamplingParams(temperature=0.0, max_tokens=16)] * len(DETOK_PROMPTS) + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=16) for s in range(len(DETOK_PROMPTS))
    ]
    # One more whose seeded draw ends in EOS (<|im_end|>, a special token
    # that the text leaves out).
    prompts = DETOK_PROMPTS * 2 + [DETOK_PROMPTS[0]]
    params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=16))
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"detok-{i}", prompt, p)
    checked = held_back = 0
    non_ascii = False
    eos_seen = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            ids, text = c.token_ids, c.text
            # The longest prefix of the tokens whose decode ends cleanly.
            j = len(ids)
            while j and decode(tok, ids[:j]).endswith("\ufffd"):
                j -= 1
            assert text == decode(tok, ids[:j]), (out.request_id, ids, text)
            checked += 1
            held_back += j < len(ids)
            non_ascii |= any(ord(ch) > 127 for ch in text)
            if out.finished:
                full = decode(tok, ids)
                assert full.startswith(text) and "\ufffd" in full[len(text) :] or full == text
                if c.finish_reason == "stop":
                    assert ids[-1] == tok.eos_token_id and tok.eos_token not in text
                    eos_seen = True
    assert checked >= 10 * 8
    assert non_ascii  # the check covered multi-byte characters
    assert held_back > 0  # and a character split across tokens
    assert eos_seen


def test_incremental_detokenizer_on_non_ascii_text(smollm2):
    tok = smollm2.get_tokenizer()
    text = " Café ☕ 日本語のテキスト, naïve façade — 🎉🎈 done."
    ids = tok.encode(text)
    # Some characters are split across tokens: a prefix decodes to U+FFFD.
    assert any(decode(tok, ids[:j]).endswith("\ufffd") for j in range(1, len(ids)))
    for chunk in (1, 3):
        detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
        pieces = []
        for i in range(0, len(ids), chunk):
            before = len(detok.output_text)
            assert detok.update(ids[i : i + chunk]) is None  # no stop strings asked for
            pieces.append(detok.output_text[before:])
        assert "".join(pieces) == detok.output_text == decode(tok, ids) == text


# ------------------------------------------- penalties, logit_bias, allowed ids


@torch.no_grad()
def greedy_by_definition(hf, prompt: list[int], n: int, adjust) -> list[int]:
    """Greedy tokens when ``adjust(logits, output so far)`` edits each step's
    transformers logits: the features' definitions, written out per step."""
    output: list[int] = []
    for _ in range(n):
        logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()  # [vocab]
        output.append(int(adjust(logits.clone(), output).argmax()))
    return output


def _repetition(penalty: float, prompt: list[int]):
    def adjust(logits, output):
        seen = sorted(set(prompt) | set(output))
        row = logits[seen]
        logits[seen] = torch.where(row > 0, row / penalty, row * penalty)
        return logits

    return adjust


def _frequency_presence(frequency: float, presence: float):
    def adjust(logits, output):
        for token in set(output):
            logits[token] -= frequency * output.count(token) + presence
        return logits

    return adjust


@pytest.mark.parametrize(
    ("kwargs", "adjust_of"),
    [
        ({"repetition_penalty": 2.0}, lambda prompt: _repetition(2.0, prompt)),
        ({"frequency_penalty": 1.5}, lambda prompt: _frequency_presence(1.5, 0.0)),
        ({"presence_penalty": 2.0}, lambda prompt: _frequency_presence(0.0, 2.0)),
    ],
    ids=["repetition", "frequency", "presence"],
)
def test_penalties_change_greedy_tokens_as_defined(llm, tiny_qwen3, kwargs, adjust_of):
    """Greedy tokens with a penalty equal transformers' logits with the
    penalty applied by its definition at every step (repetition: prompt and
    output; frequency and presence: output only), and differ from the tokens
    without it (the penalty matters on these prompts)."""
    hf = tiny_qwen3[1]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    starts = prompts_of(3, seed=21, max_len=12)
    # Each prompt ends with its own greedy continuation, so the tokens the
    # model favours are in the prompt: whether a penalty reads it matters.
    prompts = [s + o.token_ids for s, o in zip(starts, generate(llm, starts, greedy), strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kwargs)
    outs = generate(llm, prompts, params)
    plain = generate(llm, prompts, greedy)
    for prompt, out in zip(prompts, outs, strict=True):
        want = greedy_by_definition(hf, prompt, 12, adjust_of(prompt))
        assert out.token_ids == want
    assert any(o.token_ids != b.token_ids for o, b in zip(outs, plain, strict=True))


def test_logit_bias_forces_and_bans_tokens(llm, tiny_qwen3):
    hf = tiny_qwen3[1]
    prompt = prompts_of(1, seed=22)[0]
    plain = generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    first = plain[0].token_ids[0]
    forced = generate(
        llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8, logit_bias={77: 100.0})
    )[0]
    assert forced.token_ids == [77] * 8

    def ban(logits, output):
        logits[first] -= 100.0
        return logits

    banned = generate(
        llm,
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={first: -100.0}),
    )[0]
    assert banned.token_ids == greedy_by_definition(hf, prompt, 8, ban)
    assert first not in banned.token_ids


def test_allowed_token_ids_restrict_every_token(llm):
    allowed = [5, 9, 200, 301]
    outs = generate(
        llm,
        prompts_of(4, seed=23),
        SamplingParams(temperature=1.0, seed=3, max_tokens=10, allowed_token_ids=allowed),
    )
    for out in outs:
        assert set(out.token_ids) <= set(allowed)
    assert len({t for out in outs for t in out.token_ids}) > 1


def test_bad_words_need_a_tokenizer(llm):
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        generate(llm, prompts_of(1), SamplingParams(bad_words=["x"]))


class BanToken(LogitsProcessor):
    """A custom processor: a request with ``extra_args={"ban": t}`` never gets token t."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        ban = (sampling_params.extra_args or {}).get("ban")
        if ban is not None and (isinstance(ban, bool) or not isinstance(ban, int)):
            raise ValueError(f"ban must be a token id, got {ban!r}.")

    def __init__(self, vllm_config, device, is_pin_memory):
        self.bans: dict[int, int] = {}  # row -> banned token

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        process_dict_updates(
            self.bans, batch_update, lambda params, _, __: (params.extra_args or {}).get("ban")
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, token in self.bans.items():
            logits[row, token] = float("-inf")
        return logits


def test_custom_logits_processor_follows_its_rows(tiny_qwen3):
    """Requests of different lengths in one batch: rows finish, the batch
    condenses, and the processor's per-row state must move with its request.
    Banned rows equal transformers' greedy tokens with the token masked;
    the others equal plain greedy."""
    hf = tiny_qwen3[1]
    llm = LLM(
        tiny_qwen3[0],
        max_model_len=128,
        kv_cache_memory_bytes=16 << 20,
        logits_processors=[BanToken],
    )
    prompts = prompts_of(6, seed=24, max_len=10)
    lengths = [3, 12, 5, 12, 2, 9]
    plain = [
        generate(llm, [p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
        for p, n in zip(prompts, lengths, strict=True)
    ]
    bans = {i: plain[i].token_ids[0] for i in (1, 2, 5)}
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=n,
            ignore_eos=True,
            extra_args={"ban": bans[i]} if i in bans else None,
        )
        for i, n in enumerate(lengths)
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        tokens = out.outputs[0].token_ids
        if i not in bans:
            assert tokens == plain[i].token_ids, i
            continue

        def ban(logits, output, token=bans[i]):
            logits[token] = float("-inf")
            return logits

        assert tokens == greedy_by_definition(hf, prompt, lengths[i], ban), i
        assert bans[i] not in tokens
    with pytest.raises(ValueError, match="ban must be a token id"):
        generate(llm, prompts[:1], SamplingParams(extra_args={"ban": "x"}))


def test_bad_words_keep_a_word_out_of_smollm2_output(smollm2):
    """The first word of the greedy output, banned, never appears in its token ids."""
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    plain = smollm2.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    word = decode(smollm2.get_tokenizer(), plain.token_ids[:1])
    params = SamplingParams(temperature=0.0, max_tokens=8, bad_words=[word])
    out = smollm2.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert plain.token_ids[0] not in out.token_ids
    assert out.token_ids != plain.token_ids
