"""The engine's side of output constraints (the grammars themselves are
``structured_output``'s, behind the ``GrammarSource`` and
``RequestGrammar`` protocols): a step's bitmask rows, and a request's
matcher advanced over the tokens it keeps."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.engine.interfaces import GrammarSource
    from appliance.engine.request import Request
    from appliance.engine.scheduler_output import SchedulerOutput


def mask_step(grammars: GrammarSource, requests: dict[str, Request], sched_out: SchedulerOutput) -> None:
    """The grammar bitmask of the requests this step samples (a row per
    sampled position: with drafts, one per draft and one past them), into
    ``sched_out.grammar_bitmask``."""
    entries = []
    for rid in sched_out.num_scheduled_tokens:
        req = requests[rid]
        if req.grammar is not None and req.num_computed_tokens >= req.num_tokens:
            entries.append((rid, req.grammar, req.output_token_ids,
                            sched_out.scheduled_spec_decode_tokens.get(rid, [])))
    if entries:
        sched_out.grammar_bitmask = grammars.bitmask(entries)


def advance_grammar(req: Request, tokens: list[int]) -> int:
    """The request's matcher takes the tokens it keeps; returns how many it
    keeps when the grammar terminates among them (the request then ends
    there, finish_reason stop), else 0."""
    g = req.grammar
    assert g is not None  # called for requests with a grammar
    for j, tok in enumerate(tokens, 1):
        if g.accept([tok]) != 1:
            raise RuntimeError(f"the grammar refused token {tok}, which its own mask allowed")
        if g.is_terminated():
            return j
    return 0
