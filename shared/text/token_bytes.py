"""The raw bytes of each token: what OpenAI's logprobs `bytes` fields carry (and what a token alone, decoded,
cannot show when it holds part of a UTF-8 character: its text is then U+FFFD).

Life cycle: `TokenBytes(tokenizer)` reads the tokenizer's model once: a byte-level BPE (GPT-2, Llama 3, Qwen:
its decoder is `ByteLevel`) spells each byte as one printable character, mapped back here; a SentencePiece
style vocabulary spells byte-fallback tokens `<0xAB>` and spaces `▁`; added tokens are their content. Other
vocabularies fall back to the token decoded alone. Calls are cached per id.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from edgecore.shared.text.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte → printable character table, inverted: printable Latin-1 bytes stand for themselves,
    the others for 256 + their rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


def _kinds(node: object) -> set[str]:
    """Every component type of a tokenizer.json decoder (sequences flattened)."""
    if not isinstance(node, dict):
        return set()
    out = {node.get("type", "")}
    for child in node.get("decoders") or []:
        out |= _kinds(child)
    return out


class TokenBytes:
    def __init__(self, tokenizer: Tokenizer):
        backend = tokenizer.backend
        decoder = _kinds(json.loads(backend.to_str()).get("decoder"))
        added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        alphabet = _byte_level_alphabet() if "ByteLevel" in decoder else None
        spaces = "Replace" in decoder or "Metaspace" in decoder

        @lru_cache(maxsize=65536)
        def of(token_id: int) -> bytes:
            if token_id in added:
                return added[token_id].encode()
            piece = backend.id_to_token(token_id)
            if piece is None:
                return b""
            if alphabet is not None and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            match = _BYTE_TOKEN.fullmatch(piece)
            if match and "ByteFallback" in decoder:
                return bytes([int(match.group(1), 16)])
            if spaces:
                return piece.replace("▁", " ").encode()
            return tokenizer.decode([token_id], skip_special_tokens=False).encode()
        self.of = of
