"""Turn output token ids into text, a few tokens at a time.

Mirrors upstream ``vllm/v1/engine/detokenizer.py`` (its slow, tokenizer-
agnostic path, ``SlowIncrementalDetokenizer`` :250) at v0.22.1. Left out: the
fast path on ``tokenizers.DecodeStream``, stop strings, special-token
spacing options.

Why incremental is subtle: one token can be half of a character (byte-level
BPE), and a token's text can depend on its neighbours (leading spaces). So
each step decodes a short window, ``tokens[prefix_offset:]``, compares it with
the window's old text, ``tokens[prefix_offset:read_offset]``, and emits only
the difference, holding back while the end is an incomplete character (the
replacement character U+FFFD).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    # How many prompt tokens seed the window (enough context for spacing).
    INITIAL_WINDOW = 5

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-self.INITIAL_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        delta = ""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset:])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                piece = new_text[len(prefix_text):]
                delta += piece
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta
