"""Token bytes and whole characters (dask_pcm.engine.tokens), and the text of a generation
that the token limit cut in the middle of a character (engine.generation.completion)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dask_pcm.engine.generation import completion
from dask_pcm.engine.tokens import byte_alphabet, token_bytes, whole_characters

PIZZA = "🍕"  # four bytes: F0 9F 8D 95


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_byte_alphabet_is_the_byte_level_pre_tokenizers():
    alphabet = byte_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(alphabet.values()) == list(range(256))
    assert (alphabet["Ġ"], alphabet["Ċ"], alphabet["!"]) == (ord(" "), ord("\n"), ord("!"))


def test_a_byte_level_tokens_bytes_are_its_real_bytes(tok):
    pieces = ids(tok, PIZZA)
    assert len(pieces) == 4  # the tiny tokenizer never saw an emoji: one token per byte
    assert {tok.decode([t]) for t in pieces} == {"\ufffd"}
    assert token_bytes(tok, pieces) == [bytes([b]) for b in PIZZA.encode()]
    words = ids(tok, "Paris is the capital")
    assert b"".join(token_bytes(tok, words)) == b"Paris is the capital"
    assert token_bytes(tok, [tok.eos_token_id]) == [b"</s>"]


def test_byte_fallback_and_plain_tokenizers_give_bytes_too():
    vocab = {"<unk>": 0, "<0xF0>": 1, "hi": 2, "é": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    plain = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    assert token_bytes(plain, [1, 2, 3]) == [b"\xf0", b"hi", "é".encode()]


def test_whole_characters_leaves_out_a_cut_characters_first_bytes():
    raw = PIZZA.encode()
    assert whole_characters([b"ab", raw[:1], raw[1:3]]) == 1
    assert whole_characters([b"ab", raw[:2], raw[2:]]) == 3
    assert whole_characters([b"ab" + raw[:1]]) == 0  # the whole token goes with it
    assert whole_characters([b"ab", raw[:1], b""]) == 1  # a special token holds no bytes
    # Bytes that can start no character decode to U+FFFD, whatever follows: whole.
    assert whole_characters([b"ab", raw[1:2]]) == 2
    assert whole_characters([b"ab", b"\xff"]) == 2
    assert whole_characters([]) == 0


def test_a_text_cut_by_the_limit_in_a_character_ends_before_it(tok):
    eos = {tok.eos_token_id}
    head, pizza = ids(tok, "Paris"), ids(tok, PIZZA)
    for cut in (1, 2, 3):
        result = completion(tok, head + pizza[:cut], eos, [], prompt_tokens=3)
        assert tok.decode(head + pizza[:cut]).endswith("\ufffd")
        assert result == {
            "text": "Paris",
            "finish_reason": "length",
            "prompt_tokens": 3,
            "completion_tokens": len(head) + cut,
        }
    assert completion(tok, head + pizza, eos, [], 3)["text"] == "Paris" + PIZZA
    # A U+FFFD the tokens hold whole (its three bytes, EF BF BD) is text, and stays.
    whole = ids(tok, "Paris\ufffd")
    assert completion(tok, whole, eos, [], 3)["text"] == "Paris\ufffd"
    # As does one that a byte no character starts with decodes to.
    stray = completion(tok, head + pizza[1:2], eos, [], 3)
    assert stray["text"] == "Paris\ufffd"
    # Only the limit's cut: an end-of-sequence token after half a character keeps the text.
    ended = completion(tok, [*head, *pizza[:2], tok.eos_token_id], eos, [], 3)
    assert (ended["text"], ended["finish_reason"]) == (tok.decode(head + pizza[:2]), "stop")
