"""Structured outputs: constraints checked at the boundary (limits on size
and nesting before anything parses, references outside the schema,
choices the vocabulary cannot finish), trial compiles bounded in time and
memory in a child process, bitmask rows equal to xgrammar's own matcher
(draft rows too, with the matcher rolled back), and the engine with
constrained requests: outputs hold to their constraint, a request
compiling its grammar waits without holding others back, speculative
decoding and n > 1 keep working, a grammar that fails to compile ends only
its own request."""

import asyncio
import json
import os
import random
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import xgrammar as xgr

from appliance import LLM, SamplingParams, StructuredOutputsParams
from appliance.config.schema import StructuredOutputConfig
from appliance.engine.request import RequestStatus
from appliance.sampling_params import SamplingParamsError
from appliance.server.protocol import OpenAIError
from appliance.server.structured import ConstraintChecker
from appliance.structured_output import (CompileRefused, CompileSandbox, ConstraintLimits, Grammars, ReasoningTags,
                                         TokenSpelling, check, check_writable, external_refs,
                                         unsupported_schema_features)

TINY = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(overrides=TINY)


@pytest.fixture(scope="module")
def grammars(llm):
    return Grammars(llm.tokenizer, llm.resolved.cfg.model.vocab_size, [llm.tokenizer.eos_token_id])


def compiled(grammars, **constraint):
    g = grammars.grammar_for(SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
    g._future.result(timeout=60)
    return g


# -- the constraint itself ------------------------------------------------------------
def test_params_take_exactly_one_constraint():
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamsError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(SamplingParamsError) as e:
        StructuredOutputsParams(choice=[])
    assert e.value.param == "structured_outputs.choice"


def test_a_schema_dict_is_keyed_by_its_text_in_its_own_order():
    a = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}})
    assert a.kind == "json" and a.json == '{"properties": {"b": {}, "a": {}}}'  # properties are written in this order
    assert a.key == StructuredOutputsParams(json=a.json).key
    assert a.key != StructuredOutputsParams(json={"properties": {"a": {}, "b": {}}}).key
    assert StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key != a.key


@pytest.mark.parametrize("constraint, message", [
    ({"json": '{"type": "strin"}'}, 'Unsupported type "strin"'),
    ({"json": '{"type": "object", "properties": 5}'}, "properties must be an object"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "[a-"}, "Unclosed '['"),
    ({"grammar": 'root ::= "a" | '}, "Expect element"),
    ({"grammar": "root ::= foo"}, 'Rule "foo" is not defined'),
])
def test_invalid_constraints_carry_the_compilers_message(constraint, message):
    with pytest.raises(SamplingParamsError) as e:
        check(StructuredOutputsParams(**constraint))
    assert message in str(e.value) and e.value.param == f"structured_outputs.{next(iter(constraint))}"


def test_schema_features_that_would_go_unenforced_are_named():
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string", "format": "color"}},
        "n": {"type": "number", "multipleOf": 0.5}, "k": {"type": "integer", "multipleOf": 3},
        "x": {"not": {"type": "string"}}}}
    assert unsupported_schema_features(schema) == [
        "'format': 'color' at #/properties/tags/items", "'multipleOf' on a non-integer at #/properties/n",
        "'not' at #/properties/x", "'uniqueItems' at #/properties/tags"]
    with pytest.raises(SamplingParamsError, match="cannot enforce: .*uniqueItems"):
        check(StructuredOutputsParams(json=schema))
    for ok in (PERSON, {"type": "string", "format": "email"}, {"type": "integer", "multipleOf": 3},
               {"anyOf": [{"type": "integer"}, {"type": "null"}]}):
        check(StructuredOutputsParams(json=ok))


# -- limits, references, choices the vocabulary can write ----------------------------------
@pytest.mark.parametrize("kind, fits, over", [
    ("regex", "é" * 50, "é" * 50 + "a"),  # UTF-8 bytes: 100 and 101
    ("grammar", 'root ::= "' + "a" * 89 + '"', 'root ::= "' + "a" * 90 + '"'),
    ("choice", ["a" * 60, "b" * 40], ["a" * 60, "b" * 41]),
    ("json", json.dumps({"enum": ["a" * 86]}), json.dumps({"enum": ["a" * 87]})),
])
def test_a_constraint_over_max_schema_bytes_is_refused_before_it_parses(kind, fits, over):
    limits = ConstraintLimits(max_bytes=100)
    check(StructuredOutputsParams(**{kind: fits}), limits=limits)
    with pytest.raises(SamplingParamsError, match=r"structured_output.max_schema_bytes=100 is the most") as e:
        check(StructuredOutputsParams(**{kind: over}), limits=limits)
    assert e.value.param == f"structured_outputs.{kind}" and "101 bytes" in str(e.value)
    with pytest.raises(SamplingParamsError, match="max_schema_bytes"):  # refused unread: no parse error
        check(StructuredOutputsParams(regex="(" * 101), limits=limits)


def test_a_schema_nested_past_max_schema_depth_is_refused():
    def arrays(levels):  # ``levels`` objects, one inside each other's items
        return '{"type": "array", "items": ' * (levels - 1) + '{"type": "integer"}' + "}" * (levels - 1)

    limits = ConstraintLimits(max_depth=8)
    check(StructuredOutputsParams(json=arrays(8)), limits=limits)
    for text in (arrays(9), "[" * 100_000 + "]" * 100_000):  # the second is past Python's own recursion limit
        with pytest.raises(SamplingParamsError, match="more than 8 levels deep; structured_output.max_schema_depth"):
            check(StructuredOutputsParams(json=text), limits=limits)
    check(StructuredOutputsParams(json={"enum": [[[[[[[[1]]]]]]]]}), limits=ConstraintLimits(max_depth=10))
    with pytest.raises(SamplingParamsError, match="max_schema_depth"):  # data nests too: it is parsed all the same
        check(StructuredOutputsParams(json={"enum": [[[[[[[[1]]]]]]]]}), limits=limits)


def test_references_outside_the_schema_are_refused_by_path():
    schema = {"$defs": {"a": {"$ref": "https://example.com/a.json"}, "b": {"type": "integer"}},
              "properties": {"x": {"$ref": "file:///etc/passwd"}, "y": {"anyOf": [{"$ref": "#anchor"}]},
                             "z": {"$ref": "#/$defs/b"}, "self": {"$ref": "#"},
                             "$ref": {"type": "string"}},  # a property called "$ref"
              "default": {"$ref": "http://data.example"}}  # data, not a schema
    assert external_refs(schema) == ["'$ref': '#anchor' at #/properties/y/anyOf/0",
                                     "'$ref': 'file:///etc/passwd' at #/properties/x",
                                     "'$ref': 'https://example.com/a.json' at #/$defs/a"]
    with pytest.raises(SamplingParamsError, match=r"refers outside itself \('\$ref': 'http://x.org/s' at #\)") as e:
        check(StructuredOutputsParams(json={"$ref": "http://x.org/s"}))
    assert e.value.param == "structured_outputs.json"
    check(StructuredOutputsParams(json={"$defs": {"b": {"type": "integer"}}, "type": "object",
                                        "properties": {"z": {"$ref": "#/$defs/b"}, "again": {"$ref": "#"}}}))


def allowed_tokens(matcher, vocab_size):
    row = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(row, 0)
    return [t for t in range(vocab_size) if (row[0, t // 32] >> (t % 32)) & 1]


def test_choices_of_control_characters_are_exact_constraints(llm, grammars):
    """Every token the mask allows is accepted, and every walk of the
    grammar writes one of the choices: NUL and every other control
    character included."""
    vocab, eos = grammars.vocab_size, llm.tokenizer.eos_token_id
    rng = random.Random(0)
    for code in [*range(32), 127]:
        ch = chr(code)
        choices = [f"a{ch}b", ch, f"{ch}{ch}z", "plain"]
        compiled_grammar = compiled(grammars, choice=choices)._future.result()
        written = set()
        for _ in range(6):
            m = xgr.GrammarMatcher(compiled_grammar)
            out = []
            while not m.is_terminated():
                allowed = allowed_tokens(m, vocab)
                assert allowed, (choices, out)
                for t in allowed:
                    assert m.accept_token(t), (choices, out, t)
                    m.rollback(1)
                t = rng.choice(allowed)
                m.accept_token(t)
                out.append(t)
            assert out[-1] == eos
            written.add(llm.tokenizer.decode(out[:-1]))
        assert written <= set(choices), (code, written)


def spelling_of(*tokens, special=()):
    """A TokenSpelling over ``tokens`` (bytes; token 0 the stop token)."""
    return TokenSpelling(SimpleNamespace(decoded_vocab=[b"</s>", *tokens], stop_token_ids=[0],
                                         special_token_ids=list(special)))


def test_dead_ends_are_prefixes_tokens_write_but_cannot_finish():
    spelling = spelling_of(b"a", b"b", b"c", b"ab\x04", b"\x05c", b"\xc3\xa9", b"<|im|>", special=[7])
    assert spelling.dead_end(b"abc") is None
    assert spelling.dead_end(b"\x04") == 0  # no token holds it
    assert spelling.dead_end(b"ab\x04c") == 2  # "a" "b" can be written, then nothing continues
    assert spelling.dead_end(b"x\x04") == 0
    assert spelling.dead_end(b"\x05c") is None and spelling.dead_end(b"a\x05cab") is None
    assert spelling.dead_end("é".encode()) is None and spelling.dead_end("éa".encode()[:1]) == 0
    assert spelling.dead_end(b"<|im|>") == 0  # special tokens write no text
    check_writable(StructuredOutputsParams(choice=["abc", "\x05c"]), spelling)
    with pytest.raises(SamplingParamsError, match=r"choice 1 \('ab\\x04c'\) cannot .* after b'ab' no token") as e:
        check_writable(StructuredOutputsParams(choice=["abc", "ab\x04c"]), spelling)
    assert e.value.param == "structured_outputs.choice"


def test_the_engine_refuses_what_is_over_its_limits_or_unwritable(llm, monkeypatch):
    grammars = Grammars(llm.tokenizer, llm.resolved.cfg.model.vocab_size, [llm.tokenizer.eos_token_id],
                        limits=ConstraintLimits(max_bytes=64, max_depth=4))
    with pytest.raises(ValueError, match="max_schema_bytes=64"):
        grammars.grammar_for(constrained(regex="a" * 65))
    with pytest.raises(ValueError, match="max_schema_depth=4"):
        grammars.grammar_for(constrained(json={"items": {"items": {"items": {"items": {}}}}}))
    assert all(grammars.grammar_for(constrained(choice=[chr(c)])) for c in range(32))  # every byte is a token
    monkeypatch.setattr(grammars, "_spelling", spelling_of(b"o", b"k"))
    with pytest.raises(ValueError, match="cannot be written"):
        grammars.grammar_for(constrained(choice=["ok", "ok\x04"]))


# -- trial compiles ---------------------------------------------------------------------
MANY_PROPERTIES = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(8000)}}  # seconds


def memory_hungry():
    """Three string patterns whose compile takes over 64 MiB within a second or so (tiny vocabulary)."""
    return {"anyOf": [{"type": "string", "pattern": "^(([a-z]{1,40}%s){1,40}\\.){1,30}$" % sep}
                      for sep in "-_~"]}


def helper_pids():
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError):
            continue
        if ppid == os.getpid() and b"appliance.structured_output" in cmd:
            pids.append(int(pid))
    return pids


def test_a_trial_compile_reports_what_the_engines_compile_makes(grammars):
    sandbox = CompileSandbox(grammars.info, 2, 30, 1024 << 20, 2)
    try:
        for constraint in ({"json": PERSON}, {"regex": "[0-9]{2}-[a-c]+"}, {"choice": ["a\x00b", "\x04"]}):
            grammar = check(StructuredOutputsParams(**constraint), 16)
            report = sandbox.compile(grammar).result(timeout=60)
            assert report.grammar_bytes == grammars._compiler.compile_grammar(grammar).memory_size_bytes
            assert 0 < report.seconds < 30
    finally:
        sandbox.close()
    assert not helper_pids()


def test_a_compile_past_its_timeout_is_killed_without_holding_others(grammars):
    sandbox = CompileSandbox(grammars.info, 2, 0.5, 1024 << 20, 2)
    try:
        sandbox.compile(check(StructuredOutputsParams(regex="a"), 16)).result(timeout=60)  # the helper is up
        t0 = time.monotonic()
        slow = sandbox.compile(check(StructuredOutputsParams(json=MANY_PROPERTIES), 16))
        quick = sandbox.compile(check(StructuredOutputsParams(json=PERSON), 16))
        assert quick.result(timeout=30).grammar_bytes > 0 and not slow.done()
        with pytest.raises(CompileRefused, match="longer than structured_output.compile_timeout_s=0.5 s") as e:
            slow.result(timeout=30)
        assert e.value.limit == "structured_output.compile_timeout_s" and time.monotonic() - t0 < 5
        assert not slow.cancel()  # others may wait on it
        sandbox.compile(check(StructuredOutputsParams(json=PERSON), 16)).result(timeout=30)
    finally:
        sandbox.close()


def test_a_compile_past_its_memory_is_refused_and_a_lost_helper_is_replaced(grammars):
    sandbox = CompileSandbox(grammars.info, 2, 60, 64 << 20, 1)
    try:
        with pytest.raises(CompileRefused, match="more than structured_output.compile_memory_mib=64 MiB") as e:
            sandbox.compile(check(StructuredOutputsParams(json=memory_hungry()), 16)).result(timeout=60)
        assert e.value.limit == "structured_output.compile_memory_mib"
        sandbox.compile(check(StructuredOutputsParams(json=PERSON), 16)).result(timeout=30)
        slow = sandbox.compile(check(StructuredOutputsParams(json=MANY_PROPERTIES), 16))
        [helper] = helper_pids()
        os.kill(helper, 9)
        with pytest.raises(CompileRefused, match="the compile helper exited"):
            slow.result(timeout=30)
        sandbox.compile(check(StructuredOutputsParams(json=PERSON), 16)).result(timeout=60)
        assert helper_pids() and helper not in helper_pids()
    finally:
        sandbox.close()


def test_the_servers_check_tries_each_constraint_once(llm, monkeypatch):
    cfg = StructuredOutputConfig(max_schema_bytes=4096, compile_timeout_s=0.5)
    checker = ConstraintChecker(cfg, llm.tokenizer, llm.resolved.cfg.model.vocab_size)
    trials = []
    real = CompileSandbox.compile
    monkeypatch.setattr(CompileSandbox, "compile", lambda self, g: trials.append(g) or real(self, g))

    async def run(so, source="structured_outputs"):
        return await checker.check(so, source, None)

    async def main():
        await asyncio.gather(*(run(StructuredOutputsParams(json=PERSON)) for _ in range(3)))
        await run(StructuredOutputsParams(json=PERSON))
        assert len(trials) == 1  # one shared trial, then remembered
        with pytest.raises(OpenAIError) as e:
            await run(StructuredOutputsParams(regex="a" * 5000), "guided_regex")
        assert e.value.status == 400 and e.value.param == "guided_regex" and "max_schema_bytes=4096" in e.value.message
        with pytest.raises(OpenAIError) as e:
            await run(StructuredOutputsParams(json=memory_hungry()), "response_format")
        assert e.value.param == "response_format" and "the JSON schema took longer than" in e.value.message

    asyncio.run(main())
    checker._sandbox.close()


# -- bitmask rows -------------------------------------------------------------------
def reference_row(grammars, constraint, tokens):
    """xgrammar's own matcher after ``tokens``: its next-token bitmask."""
    m = xgr.GrammarMatcher(grammars._compiler.compile_grammar(check(StructuredOutputsParams(**constraint))))
    for t in tokens:
        assert m.accept_token(t)
    row = xgr.allocate_token_bitmask(1, grammars.vocab_size)
    m.fill_next_token_bitmask(row, 0)
    return row[0]


def encode(llm, text):
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("constraint, prefix", [
    ({"json": PERSON}, '{"name": "Al'), ({"regex": r"[0-9]{2}-[a-c]+"}, "12-"),
    ({"choice": ["Paris", "Parma", "Rome"]}, "Par"), ({"json_object": True}, '{"a": [1, '),
])
def test_bitmask_rows_equal_xgrammars_matcher(llm, grammars, constraint, prefix):
    tokens = encode(llm, prefix)
    g = compiled(grammars, **constraint)
    mask = grammars.bitmask([("r", g, tokens, [])])
    assert mask.rows == {"r": (0, 1)}
    assert torch.equal(mask.tensor[0], reference_row(grammars, constraint, tokens))
    assert g.num_accepted == len(tokens)  # synced from the output tokens


def test_draft_rows_follow_the_drafts_and_the_matcher_rolls_back(llm, grammars):
    tokens = encode(llm, '{"name": "')
    drafts = encode(llm, 'Al", "age')
    g = compiled(grammars, json=PERSON)
    mask = grammars.bitmask([("a", g, tokens[:2], []), ("b", g, tokens, drafts)])
    assert mask.rows == {"a": (0, 1), "b": (1, 1 + len(drafts))}
    for j in range(len(drafts) + 1):
        assert torch.equal(mask.tensor[1 + j], reference_row(grammars, {"json": PERSON}, tokens + drafts[:j]))
    assert g.num_accepted == len(tokens)
    after = grammars.bitmask([("b", g, tokens, [])])
    assert torch.equal(after.tensor[0], mask.tensor[1])  # the drafts left no trace


def test_only_drafts_the_grammar_allows_are_kept(llm, grammars):
    g = compiled(grammars, regex="[0-9]+")
    g.sync(encode(llm, "1"))
    assert g.valid_prefix(encode(llm, "23")) == len(encode(llm, "23"))
    assert g.valid_prefix([*encode(llm, "4"), *encode(llm, "x")]) == len(encode(llm, "4"))
    assert g.num_accepted == 1 and g.accept(encode(llm, "5")) == 1


@pytest.fixture(scope="module")
def thinking(llm):
    """Grammars of a reasoning model: they apply after </think>."""
    tags = ReasoningTags(tuple(encode(llm, "<think>")), tuple(encode(llm, "</think>")))
    return Grammars(llm.tokenizer, llm.resolved.cfg.model.vocab_size, [llm.tokenizer.eos_token_id], reasoning=tags)


def test_a_reasoning_models_grammar_takes_the_answer_after_the_end_tag(llm, thinking):
    constraint = {"regex": "[0-9]{3}"}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    g = thinking.grammar_for(params, encode(llm, "Q?<think>"))
    g._future.result(timeout=60)
    allowed = torch.full_like(reference_row(thinking, constraint, []), -1)
    thought, end = encode(llm, "some 42 words"), encode(llm, "</think>")
    assert len(end) > 1  # the tag is several tokens here: the gate follows it across tokens and drafts
    # reasoning: rows stay free; the drafts through the end tag free too, the row after them the grammar's first
    mask = thinking.bitmask([("r", g, [], thought + end)])
    for j in range(len(thought + end)):
        assert torch.equal(mask.tensor[j], allowed)
    assert torch.equal(mask.tensor[len(thought + end)], reference_row(thinking, constraint, []))
    assert g.valid_prefix(thought + end + encode(llm, "1")) == len(thought + end)  # not past the end tag
    assert g.accept(thought + end[:-1]) == len(thought + end[:-1]) and not g.answering and not g.is_terminated()
    assert g.accept(end[-1:]) == 1 and g.answering
    digits = encode(llm, "123")
    assert g.accept(encode(llm, "x")) == 0  # the answer is the grammar's
    assert g.valid_prefix(digits + encode(llm, "x")) == len(digits)
    outputs = thought + end + digits
    g.sync(outputs)
    assert g.num_accepted == len(outputs) and not g.is_terminated()
    assert g.accept([llm.tokenizer.eos_token_id]) == 1 and g.is_terminated()
    g.sync(thought)  # rebuilt from the tokens: back in the reasoning, the matcher at its start
    assert not g.answering and g.num_accepted == len(thought)
    # a template that closed the reasoning (Qwen3's enable_thinking: false) leaves the whole output to the grammar
    closed = thinking.grammar_for(params, encode(llm, "Q?<think>\n\n</think>\n\n"))
    assert closed.answering
    assert torch.equal(thinking.bitmask([("r", closed, [], [])]).tensor[0], reference_row(thinking, constraint, []))
    assert not thinking.grammar_for(params, encode(llm, "</think>\n<think>")).answering  # the last tag decides


def native_bitmask():
    return pytest.importorskip("appliance.kernels.cpu_native",
                               reason="the native CPU kernels do not build here").apply_token_bitmask


@pytest.mark.parametrize("kernel", ["xgrammar", "native"])
def test_apply_masks_only_the_constrained_rows(llm, grammars, kernel):
    g = compiled(grammars, choice=["Rome"])
    mask = grammars.bitmask([("c", g, [], [])])
    logits = torch.zeros(3, grammars.vocab_size)
    mask.apply(logits, {"c": 1, "other": 0}, native_bitmask() if kernel == "native" else None)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all("Rome".startswith(llm.tokenizer.decode([t])) for t in allowed)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


@pytest.mark.parametrize("vocab", [32, 100, 1000, 49152])
def test_the_native_mask_equals_xgrammars(vocab):
    """Random rows of whole, empty and mixed words, rows taken out of order,
    logits wider than the vocabulary (the padding stays as it was)."""
    apply = native_bitmask()
    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31, (5, words), dtype=torch.int32, generator=gen)
    bitmask[0] = -1
    bitmask[1] = 0
    bitmask[2, ::3] = 0
    bitmask[3, ::2] = -1
    logits = torch.randn(7, vocab + 5, generator=gen)
    pairs = [(6, 2), (0, 4), (3, 0), (1, 1), (4, 3), (2, 2)]
    ref = logits.clone()
    full = torch.full((7, words), -1, dtype=torch.int32)
    full[[d for d, _ in pairs]] = bitmask[[s for _, s in pairs]]
    xgr.apply_token_bitmask_inplace(ref, full, vocab_size=vocab, indices=[d for d, _ in pairs])
    apply(logits, bitmask, pairs, vocab)
    assert torch.equal(logits, ref)
    assert torch.isinf(logits[1, :vocab]).all() and torch.isfinite(logits[1, vocab:]).all()
    assert torch.isfinite(logits[5]).all()  # a row no pair names


def test_the_native_mask_refuses_what_it_cannot_read():
    apply = native_bitmask()
    bitmask = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="fp32"):
        apply(torch.zeros(2, 128, dtype=torch.float64), bitmask, [(0, 0)], 128)
    with pytest.raises(ValueError, match="exceeds"):
        apply(torch.zeros(2, 128), bitmask, [(0, 0)], 129)
    with pytest.raises(IndexError):
        apply(torch.zeros(2, 128), bitmask, [(2, 0)], 128)


def test_one_compile_per_constraint_and_compile_times_reported(llm):
    grammars = Grammars(llm.tokenizer, llm.resolved.cfg.model.vocab_size, [llm.tokenizer.eos_token_id])
    a = compiled(grammars, regex="[a-z]{3}")
    b = grammars.grammar_for(SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]{3}")))
    assert b.ready() and b._future is a._future  # cached
    assert len(grammars.take_compile_seconds()) == 1 and grammars.take_compile_seconds() == []


# -- through the engine -----------------------------------------------------------------
def constrained(max_tokens=24, temperature=0.0, **constraint):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_outputs_hold_to_their_constraints(llm):
    runner = llm.engine.runner
    assert (runner.bitmask_kernel is not None) == (runner.backend.name == "cpu_native")  # the native mask there
    params = [constrained(regex=r"[0-9]{3}-[a-z]{2}"), constrained(choice=["alpha", "beta", "gamma"]),
              constrained(max_tokens=60, json=PERSON), constrained(grammar='root ::= "yes" | "no" | "maybe"'),
              constrained(temperature=1.0, regex=r"(ab|cd)+!")]
    outs = llm.generate(["Hello"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[0]), texts
    assert texts[1] in ("alpha", "beta", "gamma") and texts[3] in ("yes", "no", "maybe"), texts
    if outs[2].outputs[0].finish_reason == "stop":
        value = json.loads(texts[2])
        assert set(value) == {"name", "age"} and 0 <= value["age"] <= 99 and len(value["name"]) <= 8
    assert all(o.outputs[0].finish_reason == "stop" for i, o in enumerate(outs) if i != 2)
    assert re.fullmatch(r"(ab|cd)+!", texts[4]) or outs[4].outputs[0].finish_reason == "length"


def test_a_reasoning_models_constraint_waits_for_its_answer():
    thinker = LLM(overrides=[*TINY, "server.reasoning_parser=deepseek_r1"])
    closed = encode(thinker, "Q?<think>\n\n</think>\n\n")  # the template closed the reasoning: all answer
    opened = encode(thinker, "Q?<think>\n")  # the model reasons first, freely
    digits = constrained(max_tokens=6, regex="[0-9]{6}")
    out = thinker.generate([closed, opened], digits, use_tqdm=False)
    assert re.fullmatch("[0-9]{6}", out[0].outputs[0].text)
    free = thinker.generate([opened], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert out[1].outputs[0].token_ids == free[0].outputs[0].token_ids
    assert not re.fullmatch("[0-9]{6}", out[1].outputs[0].text)


def test_n_samples_each_hold_and_logprobs_stay_finite(llm):
    p = SamplingParams(n=6, max_tokens=8, temperature=1.0, logprobs=5,
                       structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))
    out = llm.generate("Colour:", p, use_tqdm=False)[0]
    assert all(c.text in ("red", "green", "blue") for c in out.outputs)
    for c in out.outputs:
        for lp in c.logprobs:
            assert lp.logprob > float("-inf") and all(v > float("-inf") for _, v in lp.top)


def test_stop_strings_and_min_tokens_beside_a_grammar(llm):
    first, second = llm.generate(["x", "x"], [SamplingParams(max_tokens=8, stop=[";"], temperature=0,
                                                             structured_outputs=StructuredOutputsParams(regex="ab;cd")),
                                              SamplingParams(max_tokens=8, min_tokens=3, temperature=0, structured_outputs=
                                                             StructuredOutputsParams(choice=["ok"]))], use_tqdm=False)
    assert first.outputs[0].text == "ab" and first.outputs[0].stop_reason == ";"
    # the grammar allows nothing but the end after "ok": it wins over min_tokens
    assert second.outputs[0].text == "ok" and second.outputs[0].finish_reason == "stop"


def test_a_compiling_request_waits_without_holding_others_back(llm, monkeypatch):
    engine = llm.engine
    release = threading.Event()
    real = engine.grammars._compile
    monkeypatch.setattr(engine.grammars, "_compile", lambda g: (release.wait(60), real(g))[1])
    ids = encode(llm, "Hello")
    engine.add_request("slow", ids, constrained(regex="[0-9]{40}z"))
    engine.add_request("free", ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert engine.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
    done = {}
    for _ in range(20):
        for d in engine.step():
            if d.finished:
                done[d.request_id] = d
        if "free" in done:
            break
    assert "free" in done and "slow" not in done
    assert engine.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
    release.set()
    text, reason = "", None
    while engine.has_unfinished_requests():
        for d in engine.step():
            text += d.new_text
            reason = d.finish_reason
    assert re.fullmatch(r"[0-9]{24}", text) and reason == "length"


def test_a_grammar_that_fails_to_compile_ends_only_its_request(llm, monkeypatch):
    engine = llm.engine

    def fail(grammar):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.grammars, "_compile", fail)
    ids = encode(llm, "Hello")
    engine.add_request("bad", ids, constrained(regex="never-compiled-[0-9]"))
    engine.add_request("good", ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({d.request_id: d.finish_reason for d in engine.step() if d.finished})
    assert finished == {"bad": "error", "good": "length"}


def test_an_invalid_constraint_is_refused_at_admission(llm):
    with pytest.raises(ValueError, match="Unclosed"):
        llm.engine.add_request("r", encode(llm, "x"), constrained(regex="(["))
    assert "r" not in llm.engine.scheduler.requests


@pytest.mark.parametrize("spec", [["speculative=ngram"],
                                  ["speculative=draft_model", "speculative.draft_model=tiny_random"]])
def test_speculative_decoding_keeps_a_constrained_output_unchanged(spec):
    prompt = "one two three one two three one two three"
    params = [constrained(max_tokens=30, regex=r"(one |two |three )+"),
              constrained(max_tokens=30, json={"type": "array", "items": {"enum": ["one", "two", "three"]},
                                               "maxItems": 6}, disable_any_whitespace=True)]
    plain = [o.outputs[0].text for o in LLM(overrides=TINY).generate([prompt] * 2, params, use_tqdm=False)]
    spec_llm = LLM(overrides=[*TINY, *spec])
    assert [o.outputs[0].text for o in spec_llm.generate([prompt] * 2, params, use_tqdm=False)] == plain
    assert spec_llm.engine.stats().spec_drafts > 0
