"""Reasoning in a model's output (``server.reasoning_parser``): what a
thinking model writes between ``<think>`` and ``</think>`` is returned as
``reasoning_content``, apart from the answer (``content``, where tool calls
are read), whole or as streamed deltas.

The parsers, as vLLM's of the same names read text:

    deepseek_r1   the output opens in reasoning (its chat template writes
                  ``<think>`` into the prompt; one the model writes itself
                  is dropped) until ``</think>``; no ``</think>``: all of it
                  is reasoning
    qwen3         reasoning only when the output opens with ``<think>``,
                  until ``</think>``; otherwise all of it is the answer
                  (``chat_template_kwargs: {"enable_thinking": false}``)

``ReasoningSplit`` takes the text in any pieces and holds back a tail that
may be the start of a tag, so a tag cut across deltas is still found and
the pieces add up to what ``split`` gives for the whole text. Output
constraints apply to the answer only: the engine's grammars start after
the end tag (``structured_output.reasoning``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str
    end: str
    opens_in_reasoning: bool  # an output that does not open with the start tag is reasoning (else the answer)


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", THINK_START, THINK_END, opens_in_reasoning=True),
    "qwen3": ReasoningParser("qwen3", THINK_START, THINK_END, opens_in_reasoning=False),
}


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (shorter than the tag)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplit:
    """One output's text, fed in pieces, as (reasoning, answer) pieces."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.state = "opening"  # opening (is the start tag coming?), reasoning, answer
        self.held = ""
        self.reasoned = False  # some of the output was reasoning (or its tags)

    def feed(self, text: str) -> tuple[str, str]:
        p = self.parser
        buf, self.held = self.held + text, ""
        reasoning = ""
        while buf:
            if self.state == "opening":
                if buf.startswith(p.start):
                    buf, self.state, self.reasoned = buf[len(p.start):], "reasoning", True
                elif p.start.startswith(buf):  # maybe the tag, not all of it here yet
                    self.held = buf
                    return reasoning, ""
                else:
                    self.state = "reasoning" if p.opens_in_reasoning else "answer"
                    self.reasoned = p.opens_in_reasoning
            elif self.state == "reasoning":
                i = buf.find(p.end)
                if i >= 0:
                    reasoning += buf[:i]
                    buf, self.state = buf[i + len(p.end):], "answer"
                    continue
                k = _partial_tag(buf, p.end)
                reasoning += buf[: len(buf) - k]
                self.held = buf[len(buf) - k:]
                return reasoning, ""
            else:
                return reasoning, buf
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        held, self.held = self.held, ""
        if self.state == "opening" and held:
            self.state = "reasoning" if self.parser.opens_in_reasoning else "answer"
            self.reasoned = self.parser.opens_in_reasoning
        return (held, "") if self.state == "reasoning" else ("", held)


def split(parser: ReasoningParser, text: str) -> tuple[Optional[str], str]:
    """A whole output's (reasoning or None when it has none, answer)."""
    s = ReasoningSplit(parser)
    r1, a1 = s.feed(text)
    r2, a2 = s.finish()
    return (r1 + r2 if s.reasoned else None), a1 + a2
