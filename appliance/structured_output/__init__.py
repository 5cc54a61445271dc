"""Structured outputs on xgrammar: constraints checked at the boundary,
trial compiles in bounded child processes, grammars compiled off the step
loop, one matcher per request, and the token bitmask of each step.

- ``check(so, max_whitespace, limits)`` (tokenizer-free, milliseconds)
  turns a request's constraint into xgrammar's grammar or a
  ``SamplingParamsError`` naming the field. Before anything parses it, the
  constraint's size (``ConstraintLimits.max_bytes``) and a JSON schema's
  nesting (``max_depth``; xgrammar's schema conversion grows with the cube
  of it) are checked. An invalid schema, regex or EBNF grammar carries the
  compiler's message; a JSON-schema keyword xgrammar would silently ignore
  (``UNSUPPORTED_KEYWORDS``, ``multipleOf`` on non-integers, unknown
  ``format`` values) and a ``$ref`` outside the schema (xgrammar resolves
  '#' and '#/...' only, and would leave any other unconstrained) are
  refused by name rather than left unenforced.
- ``check_writable(so, spelling)`` refuses a choice that tokens can start
  but never finish (a character no token of the vocabulary holds, such as
  U+0004 in SmolLM2's): its mask would allow no token at all.
- ``CompileSandbox`` runs trial compiles, each in a child forked from one
  helper process (``python -m appliance.structured_output``), its address
  space capped (RLIMIT_AS) and killed at a timeout. The server runs every
  new constraint through it before the engine compiles it; the child
  reports only whether and how the compile finished, since a
  ``CompiledGrammar``'s serialized form costs far more than the compile
  (tens of times its size and time, gigabytes for a schema of a few hundred
  properties), so the engine compiles again, in-process, what is known to
  finish within the bounds.
- ``Grammars`` (one per engine) compiles against the tokenizer on a thread
  pool, one compile per distinct constraint (``StructuredOutputsParams.key``),
  and keeps compiled grammars in an LRU bounded in bytes
  (``structured_output.cache_size_mib``). ``grammar_for(params)`` returns
  the request's ``RequestGrammar`` at once; the engine keeps the request
  waiting until ``ready()``.
- ``RequestGrammar`` holds the request's matcher, which has accepted exactly
  the request's output tokens (``sync`` rebuilds it from them if not, e.g.
  after a retried step). ``Grammars.bitmask`` fills one packed int32 row per
  sampled position: with drafts, a row per draft position (the matcher
  advanced through the drafts before it, then rolled back).
- With ``ReasoningTags`` (a reasoning parser's tags as token ids), a
  request's grammar applies to its answer only: its ``ReasoningGate`` lets
  the tokens through the end tag pass unconstrained (their bitmask rows
  stay all-allowed, drafts past the end tag are not kept), then the
  matcher takes over; a prompt whose last tag is the end tag starts in the
  answer.
- ``StepBitmask.apply`` masks a step's logits in place with xgrammar's
  kernel (CPU, or Triton/CUDA when the logits are on a GPU).
"""

from appliance.structured_output.check import (
    CONSTRAINT_NAMES,
    SUPPORTED_FORMATS,
    UNSUPPORTED_KEYWORDS,
    ConstraintLimits,
    TokenSpelling,
    check,
    check_writable,
    constraint_bytes,
    effective_constraint,
    external_refs,
    nested_deeper_than,
    tokenizer_info,
    unsupported_schema_features,
)
from appliance.structured_output.grammars import Grammars, ReasoningGate, ReasoningTags, RequestGrammar, StepBitmask
from appliance.structured_output.sandbox import CompileRefused, CompileReport, CompileSandbox

__all__ = ["CONSTRAINT_NAMES", "SUPPORTED_FORMATS", "UNSUPPORTED_KEYWORDS", "CompileRefused", "CompileReport",
           "CompileSandbox", "ConstraintLimits", "Grammars", "ReasoningGate", "ReasoningTags", "RequestGrammar",
           "StepBitmask", "TokenSpelling", "check",
           "check_writable", "constraint_bytes", "effective_constraint", "external_refs", "nested_deeper_than",
           "tokenizer_info", "unsupported_schema_features"]
