"""Turn output token ids into text, a few tokens at a time, and find stop strings.

Mirrors upstream ``vllm/v1/engine/detokenizer.py`` at v0.22.1: the stop
logic of ``BaseIncrementalDetokenizer`` (:68; ``update`` :95,
``get_next_output_text`` :148), the decoding of its slow, tokenizer-agnostic
subclass ``SlowIncrementalDetokenizer`` (:250), and ``check_stop_strings``
(:309). Left out: the fast path on ``tokenizers.DecodeStream``, special-token
spacing options, delta (streaming) output text.

Why incremental is subtle: one token can be half of a character (byte-level
BPE), and a token's text can depend on its neighbours (leading spaces). So
each token decodes a short window, ``tokens[prefix_offset:]``, compares it
with the window's old text, ``tokens[prefix_offset:read_offset]``, and adds
only the difference, holding back while the end is an incomplete character
(the replacement character U+FFFD).

Stop strings are text, so only the front end can see them (the scheduler
sees token ids). Rules kept from upstream:
- only the text of the new tokens is searched, plus the last
  ``len(stop) - 1`` characters before it, so a stop string that spans two
  tokens is found and one that ended earlier is not found twice;
- the prompt never counts: the search starts in the output text;
- while ``min_tokens`` is unmet, no stop string counts, and text produced by
  the first ``min_tokens`` tokens is never searched;
- on a match the text is cut before the stop string, or after it with
  ``include_stop_str_in_output``; the caller finishes the request with
  ``finish_reason="stop"`` and ``stop_reason`` = the string;
- when the scheduler stopped the request on a token (EOS or a stop token
  id), that last token's text is left out unless
  ``include_stop_str_in_output``.
"""

from __future__ import annotations

from mini_vllm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    # How many prompt tokens seed the window (enough context for spacing).
    INITIAL_WINDOW = 5

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        params: SamplingParams | None = None,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-self.INITIAL_WINDOW :])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""
        # Output token ids seen so far (the stop-terminated one included).
        self.token_ids: list[int] = []

        params = params if params is not None else SamplingParams()
        self.stop: list[str] = list(params.stop)
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Characters held back from an unfinished output: they could be the
        # start of a stop string that the next token completes.
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def decode_next(self, next_token_id: int) -> str:
        """Add one token to the window; return the text it completes (maybe "")."""
        self.tokens.append(next_token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return new_text[len(prefix_text) :]
        return ""

    # BEGIN LAB 01.3: detokenize the new tokens, then look for a stop string
    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Decode ``new_token_ids`` into ``output_text``; return the stop
        string they complete, or None.

        ``stop_terminated``: the scheduler finished the request with
        FINISHED_STOPPED on the last of these tokens (EOS or a stop token id).
        """
        if not new_token_ids:
            return None
        # HINT: a stop-terminated last token is counted but not decoded,
        # HINT: unless include_stop_str_in_output.
        hide_last = stop_terminated and not self.include_stop_str_in_output
        to_decode = new_token_ids[:-1] if hide_last else new_token_ids

        # HINT: search only text made by these tokens, and none made while
        # HINT: num_output_tokens() <= min_tokens.
        search_from = len(self.output_text)
        for token_id in to_decode:
            self.token_ids.append(token_id)
            self.output_text += self.decode_next(token_id)
            if self.num_output_tokens() <= self.min_tokens:
                search_from = len(self.output_text)
        if hide_last:
            self.token_ids.append(new_token_ids[-1])

        # HINT: check_stop_strings says which string and where to cut (-1: nowhere).
        if not self.stop or self.num_output_tokens() <= self.min_tokens:
            return None
        match = check_stop_strings(
            self.output_text,
            len(self.output_text) - search_from,
            self.stop,
            self.include_stop_str_in_output,
        )
        if match is None:
            return None
        stop_string, truncate_to = match
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_string

    # END LAB 01.3

    def get_next_output_text(self, finished: bool) -> str:
        """The text so far, less the last ``stop_buffer_length`` characters
        while the request runs (they may turn out to be a stop string)."""
        buffer_length = 0 if finished else self.stop_buffer_length
        if not buffer_length:
            return self.output_text
        return self.output_text[:-buffer_length]


# BEGIN LAB 01.3: check_stop_strings: find a stop string in the new text
# mirrors vllm/v1/engine/detokenizer.py:309-344
def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """The first stop string (in ``stop``'s order) found in the last
    ``new_char_count`` characters of ``output_text``, or in text that ends
    there, as ``(stop_string, truncate_to)``; None if none.

    ``truncate_to`` is the length to cut ``output_text`` to: where the stop
    string starts, or where it ends if ``include_in_output``; -1 when no cut
    is needed (it ends exactly at the end of the text and is kept).
    """
    # HINT: nothing new (new_char_count == 0) or no stop strings: None.
    # HINT: a stop string of length L can start up to L - 1 characters before
    # HINT: the new text: str.find(s, start) accepts a negative start.
    if new_char_count == 0 or not stop:
        return None
    for stop_str in stop:
        # Negative: counted from the end of the text, as str.find does.
        window_start = -(new_char_count + len(stop_str) - 1)
        start = output_text.find(stop_str, window_start)
        if start == -1:
            continue
        if not include_in_output:
            return stop_str, start
        end = start + len(stop_str)
        return stop_str, (-1 if end >= len(output_text) else end)
    return None


# END LAB 01.3
