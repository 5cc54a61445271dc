"""Incremental detokenization with stop strings.

Text is decoded over a sliding window of token ids (prefix_offset ..
read_offset, as vLLM does), so the cost per token stays constant; a
multi-byte character split across tokens decodes to U+FFFD until its last
byte arrives, and is held back until then; one never completed is dropped
at the end. While stop strings are set, the last (longest stop - 1)
characters are held back too, so a stop string is
never streamed in part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 5  # prompt tokens decoded as context so the first output token gets its leading space right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        ctx = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.ids = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # all output text decoded so far (up to a stop string)
        self.emitted = 0  # characters of self.text already returned
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                               clean_up_tokenization_spaces=False))  # one sequence: one str

    def add_tokens(self, new_ids: list[int]) -> Optional[str]:
        """Decode ``new_ids``; returns the stop string hit, if any."""
        for tok in new_ids:
            self.ids.append(tok)
            prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.ids[self.prefix_offset :])
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                continue
            before = len(self.text)
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            hit = self._check_stop(before)
            if hit is not None:
                return hit
        return None

    def _check_stop(self, before: int) -> Optional[str]:
        for s in self.stop:
            idx = self.text.find(s, max(0, before - len(s) + 1))
            if idx != -1:
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                return s
        return None

    def flush(self) -> None:
        """At the end: whatever the window still holds back. A character whose
        last bytes never came (``max_tokens`` ended the request inside it) is
        dropped, so the text ends at the last complete character; the token
        still counts."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        rest = self._decode(self.ids[self.prefix_offset :])[len(prefix_text) :].rstrip("\ufffd")
        if rest:
            before = len(self.text)
            self.text += rest
            self._check_stop(before)

    def take_delta(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta
