"""An exact, faster encoder for byte-level BPE tokenizers: pre-tokenize with the tokenizer's own
regex, then look each piece up in a word cache.

Hugging Face `tokenizers` spends most of its time per document on bookkeeping (normalised
strings, offsets, `Encoding` objects), not on BPE: code and prose repeat the same few hundred
thousand words. Here a document is split by the very regex the tokenizer's pre-tokenizer uses
(`regex` module: the same `\\p{L}`/`\\p{N}` classes), each piece's ids come from a dict, and only
a new piece goes through the tokenizer's own BPE model (`model.tokenize`, merges and all). The
ids are the library's (tests/test_tokenizer.py checks them on code, many scripts, odd whitespace
and special-token strings); `ladle data prepare` runs 2.4x faster with it (docs/performance.md).

Only pipelines whose every step is reproduced here are accepted (`for_tokenizer` returns None
otherwise and callers keep the library): no normaliser or NFC; a ByteLevel pre-tokenizer with its
GPT-2 regex, or a Split regex (isolated) followed by ByteLevel without regex, as Llama 3 and Qwen2
ship; no prefix space; a BPE model without dropout, subword prefixes or byte fallback. A document
containing the text of an added token (`<|eos|>`, chat markers) is left to the library, which
matches those first.
"""

from __future__ import annotations

import json
import unicodedata

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CACHE_WORDS = 500_000  # ~100 MB at most per process; cleared when full


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which ByteLevel applies to every piece."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_CHARS = _bytes_to_unicode()


def _pattern(pre: dict | None) -> str | None:
    if not pre:
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    ok = (
        split.get("type") == "Split"
        and "Regex" in (split.get("pattern") or {})
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("add_prefix_space")
        and not byte_level.get("use_regex", True)
    )
    return split["pattern"]["Regex"] if ok else None


class CachedBPE:
    def __init__(self, hf_tokenizer, pattern: str, nfc: bool, added: list[str]):
        import regex  # only here: the library path does not need it

        self._model = hf_tokenizer.model
        self._split = regex.compile(pattern).findall
        self._nfc = nfc
        self._added = added
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def for_tokenizer(cls, hf_tokenizer) -> CachedBPE | None:
        """A CachedBPE for this `tokenizers.Tokenizer`, or None when its pipeline is not one of the
        reproduced ones (or the `regex` module is missing)."""
        try:
            import regex  # noqa: F401
        except ImportError:
            return None
        spec = json.loads(hf_tokenizer.to_str())
        model = spec.get("model") or {}
        norm = spec.get("normalizer")
        if norm is not None and norm.get("type") != "NFC":
            return None
        if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
            return None
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            return None
        pattern = _pattern(spec.get("pre_tokenizer"))
        if pattern is None:
            return None
        added = [t["content"] for t in spec.get("added_tokens") or []]
        return cls(hf_tokenizer, pattern, norm is not None, added)

    def encode(self, text: str) -> list[int] | None:
        """The ids of `text`, or None when the library must encode it (an added token's text)."""
        if any(a in text for a in self._added):
            return None
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        pieces = self._split(text)
        if sum(map(len, pieces)) != len(text):  # the regex left gaps: keep to the library
            return None
        cache, out = self._cache, []
        extend = out.extend
        for piece in pieces:
            ids = cache.get(piece)
            if ids is None:
                if len(cache) >= CACHE_WORDS:
                    cache.clear()
                try:
                    raw = piece.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates: the library's business
                    return None
                mapped = "".join([BYTE_CHARS[b] for b in raw])
                ids = cache[piece] = tuple(t.id for t in self._model.tokenize(mapped))
            extend(ids)
        return out
