"""Incremental detokenization never emits broken UTF-8 and matches a full decode."""

import pytest

from appliance.config.compose import resolve
from appliance.engine.detokenizer import IncrementalDetokenizer
from appliance.models.loader import resolve_model_folder


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_folder(resolve(["+profile=cpu", "model=tiny_random"], check=False).cfg.model)))


TEXTS = ["Unicode: café naïve 東京 こんにちは 😀 🚀 “quotes”", "Hello world, the quick brown fox.", "😀😀😀 東京東京"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_are_valid_and_equal_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Prompt:")
    ids = tokenizer.encode(text)
    d = IncrementalDetokenizer(tokenizer, prompt)
    deltas = []
    for t in ids:
        d.add_tokens([t])
        deltas.append(d.take_delta(finished=False))
    d.flush()
    deltas.append(d.take_delta(finished=True))
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    # Byte-level BPE splits the emoji over several tokens: some steps must have emitted nothing.
    if "😀" in text:
        assert "" in deltas[:-1]


def test_stop_string_is_held_back_and_cut(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps")
    d = IncrementalDetokenizer(tokenizer, [], stop=["brown f"])
    streamed, hit = "", None
    for t in ids:
        hit = d.add_tokens([t])
        streamed += d.take_delta(finished=hit is not None)
        if hit:
            break
    assert hit == "brown f" and streamed == "The quick "


def test_cut_inside_a_character_ends_at_the_last_complete_one(tokenizer):
    """max_tokens can end a request between the bytes of one character: the text
    ends at the last complete character, the same streamed and whole."""
    ids = tokenizer.encode(TEXTS[0])
    cuts = [i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd")]
    assert cuts, "the test text must split a character across tokens"
    for cut in cuts:
        d = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
        streamed = ""
        for t in ids[:cut]:
            d.add_tokens([t])
            streamed += d.take_delta(finished=False)
        d.flush()
        streamed += d.take_delta(finished=True)
        assert streamed == d.text == tokenizer.decode(ids[:cut]).rstrip("\ufffd")
        assert "\ufffd" not in d.text and TEXTS[0].startswith(d.text)
