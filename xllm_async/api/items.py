"""The item table of generative recommendation: token-id tuples -> item ids.

File format, one item per line, `#` comments and blank lines ignored:

    <item id><TAB><token id> <token id> <token id>

Every item has the same number of tokens. Several items may share one tuple
(semantic ids collide): a beam that spells it answers with all of them, in file
order. Item ids are unique. The file is parsed with numpy over its bytes (no
Python object per line or per item), so a catalogue of millions of items
loads in seconds (perf/RESULTS.md, "The catalogue at scale"); the trie the
engine searches is built from the distinct tuples (execution/item_trie.py).
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np

from ..execution.item_trie import ItemTrie, LeafFilter

ITEMS_PER_CHOICE = 50  # item ids one choice lists for a shared tuple at most (xLLM keeps 50)
MAX_ITEM_ID_BYTES = 256

# Byte classes of the parser.
_OTHER, _DIGIT, _SPACE = 0, 1, 2
_CLASS = np.zeros(256, dtype=np.uint8)
_CLASS[ord("0"):ord("9") + 1] = _DIGIT
_CLASS[[ord(" "), ord("\t"), ord("\r"), ord("\n")]] = _SPACE


class ItemTableError(Exception):
    """The item table file cannot be used; the message names the file, line and value."""


class ItemTable:
    """Items (file order) -> their ids and their tuples (leaves of the trie), and ids -> items."""

    def __init__(self, ids: np.ndarray, id_index: tuple[np.ndarray, np.ndarray], leaf_of: np.ndarray,
                 leaf_items: np.ndarray, trie: ItemTrie, path: str = "", version: str = "",
                 loaded_at: float = 0.0) -> None:
        """ids: each item's id (fixed-width bytes); id_index: their hashes sorted and the items in
        that order (_id_index); leaf_of: each item's leaf (its tuple's number among the sorted
        distinct tuples); leaf_items: the items sorted by leaf, file order within."""
        self.trie = trie
        self.path = path
        self.version = version  # the file's SHA-256, first 16 hex digits
        self.loaded_at = loaded_at
        self.count = len(ids)
        self._ids = ids
        self._hash, by_hash = id_index  # for look-ups by id
        self._by_hash = by_hash.astype(np.int32)
        self._leaf_of = leaf_of.astype(np.int32)
        self._leaf_items = leaf_items.astype(np.int32)
        self._leaf_start = np.searchsorted(leaf_of[leaf_items], np.arange(trie.leaves + 1)).astype(
            np.int32 if self.count < 2**31 else np.int64)

    @property
    def item_length(self) -> int:
        return self.trie.length

    @property
    def shared_tuples(self) -> int:
        """Tuples that more than one item spells."""
        return int(np.count_nonzero(np.diff(self._leaf_start) > 1))

    def summary(self) -> str:
        return (f"{self.count} items, {self.trie.leaves} distinct tuples of {self.item_length} tokens "
                f"({self.shared_tuples} shared by several items)")

    def nbytes(self) -> int:
        return self.trie.nbytes() + sum(a.nbytes for a in (self._ids, self._hash, self._by_hash, self._leaf_of,
                                                           self._leaf_items, self._leaf_start))

    # --- look-ups ---

    def item_id(self, item: int) -> str:
        return self._ids[item].decode("utf-8", "replace")

    def find(self, ids: list[str]) -> tuple[np.ndarray, list[str]]:
        """Item numbers of these ids, and the ids that name no item."""
        if not ids:
            return np.zeros(0, dtype=np.int64), []
        width = self._ids.dtype.itemsize
        raw = [i.encode("utf-8") for i in ids]
        query = np.array([r if len(r) <= width else b"" for r in raw], dtype=f"S{width}")
        hashes = _hashes(query)
        lo = np.searchsorted(self._hash, hashes, "left")
        hi = np.searchsorted(self._hash, hashes, "right")
        found, missing = [], []
        for i, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
            # Equal hashes are checked against the ids themselves (a collision is never a match).
            match = [int(n) for n in self._by_hash[a:b] if self._ids[n] == raw[i]]
            if match:
                found.append(match[0])
            else:
                missing.append(ids[i])
        return np.array(found, dtype=np.int64), missing

    def narrow(self, allowed: np.ndarray | None, excluded: np.ndarray | None) -> ItemFilter:
        """One request's filter from item numbers: only `allowed` items, none of `excluded`."""
        if allowed is not None:
            keep = np.unique(allowed)
            if excluded is not None:
                keep = np.setdiff1d(keep, excluded)
            return ItemFilter(LeafFilter(keep=np.unique(self._leaf_of[keep]).astype(np.int64)), keep, None)
        drop = np.unique(excluded)
        # A tuple is gone only when every item that spells it is excluded.
        candidates, dropped = np.unique(self._leaf_of[drop], return_counts=True)
        left = np.diff(self._leaf_start)[candidates] - dropped
        return ItemFilter(LeafFilter(drop=candidates[left == 0].astype(np.int64)), None, drop)

    def tokens_of(self, item: int) -> list[int]:
        return self.trie.tokens(int(self._leaf_of[item]))

    def tokens_of_items(self, items: np.ndarray) -> list[list[int]]:
        """tokens_of each of these item numbers, in one vectorised walk of the trie."""
        return self.trie.tokens_of_leaves(self._leaf_of[np.asarray(items, dtype=np.int64)]).tolist()

    def items_of(self, leaf: int, narrowed: ItemFilter | None = None) -> list[str]:
        """The ids of the items that spell this leaf (file order), those the filter lets through,
        at most ITEMS_PER_CHOICE."""
        items = self._leaf_items[self._leaf_start[leaf]:self._leaf_start[leaf + 1]]
        if narrowed is not None:
            items = narrowed.filter(items)
        return [self.item_id(int(i)) for i in items[:ITEMS_PER_CHOICE]]

    # --- loading ---

    @classmethod
    def load(cls, path: str, vocab_size: int | None = None, device=None) -> ItemTable:
        """Parse and check the file; vocab_size: the served model's (every token id must be below it)."""
        import torch

        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ItemTableError(f"{path}: {exc.strerror}") from None
        version = hashlib.sha256(data).hexdigest()[:16]
        ids, tuples, lines = _parse(path, data)
        del data
        if vocab_size is not None:
            bad = np.flatnonzero((tuples >= vocab_size).any(axis=1))
            if len(bad):
                value = int(tuples[bad[0]][tuples[bad[0]] >= vocab_size][0])
                raise ItemTableError(f"{path}:{lines[bad[0]]}: token id {value} is beyond the model's vocabulary "
                                     f"(ids 0..{vocab_size - 1})")
        id_index = _id_index(path, ids, lines)
        del lines
        by_tuple = _lexsort(tuples)
        ranked = tuples[by_tuple]
        del tuples
        new = np.ones(len(by_tuple), dtype=bool)
        new[1:] = (ranked[1:] != ranked[:-1]).any(axis=1)
        leaf_of = np.empty(len(by_tuple), dtype=np.int64)
        leaf_of[by_tuple] = np.cumsum(new) - 1
        trie = ItemTrie(ranked[new], device if device is not None else torch.device("cpu"))
        del ranked
        return cls(ids, id_index, leaf_of, by_tuple, trie, os.path.abspath(path), version, time.time())


class ItemFilter:
    """A request's `allowed_item_ids` / `exclude_item_ids` as item numbers and the leaves they leave."""

    __slots__ = ("leaves", "keep", "drop")

    def __init__(self, leaves: LeafFilter, keep: np.ndarray | None, drop: np.ndarray | None) -> None:
        self.leaves = leaves
        self.keep = keep
        self.drop = drop

    def filter(self, items: np.ndarray) -> np.ndarray:
        if self.keep is not None:
            return items[np.isin(items, self.keep)]
        return items[~np.isin(items, self.drop)]


def _lexsort(rows: np.ndarray) -> np.ndarray:
    """The order that sorts these rows of non-negative integers lexicographically; stable, so items
    sharing a tuple keep file order. Neighbouring columns are packed into one 63-bit key where they
    fit (three token ids of a 151k vocabulary do), so the sort compares fewer keys."""
    bits = max(int(rows.max()).bit_length(), 1)
    per_key = max(63 // bits, 1)
    keys = []
    for start in range(0, rows.shape[1], per_key):
        key = np.zeros(len(rows), dtype=np.int64)
        for column in range(start, min(start + per_key, rows.shape[1])):
            key = (key << bits) | rows[:, column]
        keys.append(key)
    return np.lexsort(keys[::-1])


def _hashes(ids: np.ndarray) -> np.ndarray:
    """FNV-1a over each fixed-width id's bytes (NUL padding included), 64 bits, vectorised."""
    chars = ids.view(np.uint8).reshape(len(ids), ids.dtype.itemsize)
    value = np.full(len(ids), 0xCBF29CE484222325, dtype=np.uint64)
    prime = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):
        for k in range(chars.shape[1]):
            value ^= chars[:, k]
            value *= prime
    return value


def _id_index(path: str, ids: np.ndarray, lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ids' hashes sorted and the items in that order; an id that appears twice stops the load.
    Equal hashes (a repeated id, or rarely a collision) are compared as ids, within their run."""
    hashes = _hashes(ids)
    order = np.argsort(hashes, kind="stable")
    hashes = hashes[order]
    for i in np.flatnonzero(hashes[1:] == hashes[:-1]).tolist():
        b = order[i + 1]
        j = i
        while j >= 0 and hashes[j] == hashes[i + 1]:
            a = order[j]
            if ids[a] == ids[b]:  # not merely a collision of hashes
                a, b = min(a, b), max(a, b)
                raise ItemTableError(f"{path}:{lines[b]}: item id '{ids[b].decode('utf-8', 'replace')}' "
                                     f"appears again (first on line {lines[a]})")
            j -= 1
    return hashes, order


def _parse(path: str, data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The file's bytes -> (item ids [n] fixed-width bytes, token tuples [n, L] int64, line numbers [n])."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if not len(raw):
        raise ItemTableError(f"{path}: no items")
    if raw[-1] != 10:
        raw = np.concatenate([raw, np.array([10], dtype=np.uint8)])
    ends = np.flatnonzero(raw == 10)  # each line's newline
    starts = np.concatenate([[0], ends[:-1] + 1])
    first = starts.copy()  # each line's first character (its end if it has none)
    for line in np.flatnonzero(_CLASS[raw[starts]] == _SPACE).tolist():  # blank or indented: rare, one by one
        text = bytes(raw[starts[line]:ends[line]])
        first[line] = starts[line] + len(text) - len(text.lstrip())
    content = (first < ends) & (raw[first] != ord("#"))
    lines = np.flatnonzero(content)
    if not len(lines):
        raise ItemTableError(f"{path}: no items")
    first, ends = first[lines], ends[lines]
    tabs = np.flatnonzero(raw == 9)
    at = np.searchsorted(tabs, first)
    tab = np.where(at < len(tabs), tabs[np.minimum(at, max(len(tabs) - 1, 0))] if len(tabs) else 0, ends)
    no_tab = np.flatnonzero(tab >= ends)
    if len(no_tab):
        raise ItemTableError(f"{path}:{lines[no_tab[0]] + 1}: expected '<item id><TAB><token ids>'")
    # The token part of each line: tab + 1 .. newline (a running sum of 0s and 1s marks it).
    marks = np.zeros(len(raw) + 1, dtype=np.int8)
    marks[tab + 1] = 1
    marks[ends] -= 1
    region = np.cumsum(marks[:-1], dtype=np.int8).view(bool)
    del marks
    kind = _CLASS[raw]
    other = np.flatnonzero(region & (kind == _OTHER))
    if len(other):
        line = np.searchsorted(ends, other[0])
        text = bytes(raw[tab[line] + 1:ends[line]]).decode("utf-8", "replace").strip()
        raise ItemTableError(f"{path}:{lines[line] + 1}: token ids must be non-negative integers, got '{text}'")
    digit = region & (kind == _DIGIT)
    del region, kind
    edge = np.flatnonzero(np.diff(digit.view(np.int8), prepend=np.int8(0), append=np.int8(0)))
    del digit
    begin, stop = edge[0::2], edge[1::2]  # each token's digits: [begin, stop)
    line_of = np.searchsorted(ends, begin)
    per_line = np.bincount(line_of, minlength=len(lines))
    length = int(per_line[0])
    odd = np.flatnonzero(per_line != length)
    if length == 0 or len(odd):
        line = odd[0] if length else 0
        if per_line[line] == 0:
            raise ItemTableError(f"{path}:{lines[line] + 1}: expected '<item id><TAB><token ids>'")
        raise ItemTableError(f"{path}:{lines[line] + 1}: an item of {per_line[line]} tokens; the items above have "
                             f"{length} (every item id must have the same length)")
    digits = stop - begin
    if digits.max() > 12:
        line = line_of[np.argmax(digits)]
        raise ItemTableError(f"{path}:{lines[line] + 1}: a token id of {digits.max()} digits")
    values = np.zeros(len(begin), dtype=np.int64)
    for k in range(int(digits.max())):
        has = digits > k
        values[has] += (raw[stop[has] - 1 - k].astype(np.int64) - 48) * 10 ** k
    # Item ids: the first character up to the tab, trailing spaces dropped (rare: one by one).
    id_end = tab.copy()
    for line in np.flatnonzero(_CLASS[raw[tab - 1]] == _SPACE).tolist():
        id_end[line] = first[line] + len(bytes(raw[first[line]:tab[line]]).rstrip())
    sizes = id_end - first
    if sizes.max() > MAX_ITEM_ID_BYTES:
        line = int(np.argmax(sizes))
        raise ItemTableError(f"{path}:{lines[line] + 1}: an item id of {sizes.max()} bytes "
                             f"(at most {MAX_ITEM_ID_BYTES})")
    width = int(sizes.max())
    chars = np.zeros((len(lines), width), dtype=np.uint8)
    for k in range(width):
        has = sizes > k
        chars[has, k] = raw[first[has] + k]
    return chars.view(f"S{width}").ravel(), values.reshape(len(lines), length), lines + 1
