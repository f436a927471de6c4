"""What a generated token holds as bytes, and where a text's last whole character ends.

A token is a run of bytes, not always whole characters: a byte-level BPE tokenizer (GPT-2's
kind, SmolLM2's) may give a multi-byte character's bytes to two tokens, and
``tokenizer.decode([id])`` of either half is only U+FFFD.

- :func:`token_bytes`: the bytes of tokens as the tokenizer's vocabulary holds them: for a
  byte-level tokenizer its token strings mapped back through the byte alphabet, for
  SentencePiece byte fallback (``<0xF0>``) the byte, else the UTF-8 of the decoded text.
- :func:`whole_characters`: how many leading tokens end on a whole character, so that a text
  cut by the token limit in the middle of one can leave out its first bytes.

Callers hold the model's lock (the tokenizer is shared).
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from collections.abc import Sequence
from typing import Any

# Per tokenizer: its byte-level alphabet (character -> byte), or None where it has none.
_ALPHABETS: weakref.WeakKeyDictionary[Any, dict[str, int] | None] = weakref.WeakKeyDictionary()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet, character to byte: printable Latin-1 bytes stand for
    themselves, the others (control characters, space, soft hyphen...) for the characters
    from U+0100 on, in byte order.

    Example
    -------
    >>> alphabet = byte_alphabet()
    >>> alphabet["A"], alphabet["Ġ"], len(alphabet)  # Ġ: the space
    (65, 32, 256)
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shown = set(printable)
    others = [b for b in range(256) if b not in shown]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return table


def _alphabet(tokenizer: Any) -> dict[str, int] | None:
    try:
        return _ALPHABETS[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: work it out each time
        return _byte_level(tokenizer)
    found = _ALPHABETS[tokenizer] = _byte_level(tokenizer)
    return found


def _byte_level(tokenizer: Any) -> dict[str, int] | None:
    """The byte alphabet where the tokenizer's decoder is (or contains) a ByteLevel one."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return None
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    parts = state.get("decoders") or [state]
    if any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts):
        return byte_alphabet()
    return None


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> list[bytes]:
    """The bytes each of ``ids`` holds (see the module's docstring); an added token's
    (a special one's) are those of its text.

    Example
    -------
    >>> token_bytes(tokenizer, tokenizer("🍕", add_special_tokens=False)["input_ids"])  # doctest: +SKIP
    [b'\\xf0', b'\\x9f', b'\\x8d', b'\\x95']
    """
    alphabet = _alphabet(tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    out = []
    for token_id, piece in zip(ids, pieces, strict=True):
        if token_id in added or piece is None:
            out.append(str(added.get(token_id, "")).encode())
        elif alphabet is not None and all(c in alphabet for c in piece):
            out.append(bytes(alphabet[c] for c in piece))
        elif (fallback := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            out.append(bytes([int(fallback.group(1), 16)]))
        else:
            out.append(tokenizer.decode([token_id]).encode())
    return out


def whole_characters(pieces: Sequence[bytes]) -> int:
    """How many leading ``pieces`` (tokens' bytes) end on a whole UTF-8 character: all of
    them, unless the last ones hold only the first bytes of one (a valid start, cut short).
    Invalid bytes count as whole (they decode to U+FFFD, as they would in a longer text).

    Example
    -------
    >>> pizza = "🍕".encode()
    >>> whole_characters([b"a", pizza[:1], pizza[1:2]]), whole_characters([b"a", pizza])
    (1, 2)
    """
    n = len(pieces)
    while n:
        # A character has at most 4 bytes: the last few tell whether one is cut short.
        tail = b"".join(pieces[:n])[-4:]
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(tail, final=False)
        if not decoder.getstate()[0]:
            break
        n -= 1
    return n
