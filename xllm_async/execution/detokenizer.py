"""Incremental detokenisation: text deltas that never split a multi-byte character."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing token list a piece at a time.

    Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding
    them alone gives U+FFFD. We decode a short window (from the last emitted
    boundary) and hold the delta back until it no longer ends in U+FFFD.
    """

    __slots__ = ("_decode", "_tokens", "_prefix", "_read")

    def __init__(self, tokenizer) -> None:
        self._decode = tokenizer.decode
        self._tokens: list[int] = []
        self._prefix = 0  # start of the window we decode
        self._read = 0  # tokens up to here are already emitted as text

    def push(self, token: int) -> str:
        tokens = self._tokens
        tokens.append(token)
        decode = self._decode
        before = decode(tokens[self._prefix:self._read], skip_special_tokens=True) if self._read > self._prefix else ""
        after = decode(tokens[self._prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix = self._read
            self._read = len(tokens)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (the sequence ended): emitted as decoded."""
        if self._read == len(self._tokens):
            return ""
        before = self._decode(self._tokens[self._prefix:self._read], skip_special_tokens=True)
        after = self._decode(self._tokens[self._prefix:], skip_special_tokens=True)
        self._prefix = self._read = len(self._tokens)
        return after[len(before):]
