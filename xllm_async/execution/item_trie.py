"""The item table as a token trie in flat arrays: which tokens may follow a
prefix, so that a beam search only ever takes paths that spell an item.

Nodes of one depth are numbered in sorted order (by parent, then token), as
xLLM's rec_vocab_dict keeps its prefixes: the children of node n at depth d are
the nodes first_child[d][n] .. first_child[d][n + 1] - 1 at depth d + 1, and a
node's leaves (the distinct token tuples, depth L) are one contiguous range.
Per depth that is two integer arrays; no Python object per node. A round builds
the allowed-token mask for its live beams only (expand), over the tokens that
occur at that depth (`vocab[d]`: the LM head is computed over those rows of the
output embedding only). Its size at 1.52M items: perf/RESULTS.md, "The catalogue at scale".

A request may narrow the table (LeafFilter: only these leaves, or all but
these): a node is then allowed only while one of its leaves is, so the search
equals a search over a table that lacks the filtered items.
"""

from __future__ import annotations

import numpy as np
import torch


class LeafFilter:
    """The leaves (distinct token tuples) one request may reach: `keep` only these, or all but
    `drop`; each a sorted int64 array of leaf numbers."""

    __slots__ = ("keep", "drop")

    def __init__(self, keep: np.ndarray | None = None, drop: np.ndarray | None = None) -> None:
        if keep is not None and drop is not None:
            keep, drop = np.setdiff1d(keep, drop), None
        self.keep = keep
        self.drop = drop

    def alive(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """For nodes whose leaves are [lo, hi): whether any of those leaves may be reached."""
        if self.keep is not None:
            return np.searchsorted(self.keep, hi) > np.searchsorted(self.keep, lo)
        return (hi - lo) > (np.searchsorted(self.drop, hi) - np.searchsorted(self.drop, lo))

    def count(self, leaves: int) -> int:
        """How many of a table's `leaves` leaves this filter lets through."""
        return len(self.keep) if self.keep is not None else leaves - len(self.drop)


class Expansion:
    """One round's allowed continuations of some beams: `mask` [rows, len(vocab[d])] (a torch bool
    tensor on the device) and `child` (numpy, the same shape): the node each allowed (row, column)
    leads to; other entries are undefined."""

    __slots__ = ("mask", "child", "counts")

    def __init__(self, mask: torch.Tensor, child: np.ndarray, counts: np.ndarray) -> None:
        self.mask = mask
        self.child = child
        self.counts = counts  # allowed tokens per row: 1 means the row has no choice


class ItemTrie:
    """Distinct token tuples of one length L (the leaves), as a trie; depth 0 is the root."""

    def __init__(self, leaves: np.ndarray, device: torch.device) -> None:
        """leaves: [n, L] integer token tuples, sorted lexicographically, no two equal."""
        count, self.length = leaves.shape
        if count == 0 or self.length == 0:
            raise ValueError("an item trie needs at least one item of at least one token")
        self.leaves = count
        self.first_child: list[np.ndarray] = []  # per depth d < L: [nodes(d) + 1] into depth d + 1
        self.column: list[np.ndarray] = [np.zeros(1, np.int32)]  # per depth d >= 1: each node's column in vocab[d-1]
        self.vocab: list[torch.Tensor] = []  # per depth d < L: the tokens a round at depth d may pick, sorted
        new = np.zeros(count, dtype=bool)  # rows that start a new node at the depth being built
        new[0] = True
        node = np.zeros(count, dtype=np.int64)  # each row's node at the previous depth
        index = np.int32 if count < 2**31 else np.int64  # node numbers: half the bytes where they fit
        for depth in range(self.length):
            tokens = leaves[:, depth]
            new = new.copy()
            new[1:] |= tokens[1:] != tokens[:-1]
            parents = node[new]  # the parent of each node of depth + 1, in node order (sorted)
            node = np.cumsum(new) - 1
            chosen = tokens[new]
            present = np.zeros(int(chosen.max()) + 1, dtype=bool)  # token ids are below the vocabulary's size
            present[chosen] = True
            vocab = np.flatnonzero(present)
            column = (np.cumsum(present) - 1)[chosen]
            self.first_child.append(np.searchsorted(parents, np.arange(len(self.column[-1]) + 1)).astype(index))
            self.column.append(column.astype(np.int32))
            self.vocab.append(torch.from_numpy(vocab.astype(np.int64)).to(device))
        self.device = device

    @classmethod
    def of(cls, tuples, device: torch.device) -> ItemTrie:
        """From token tuples in any order, repeats allowed (tests, tools)."""
        rows = np.asarray(list(tuples), dtype=np.int64)
        if rows.ndim != 2:
            raise ValueError("items of mixed lengths")
        return cls(np.unique(rows, axis=0), device)

    def nodes(self, depth: int) -> int:
        return len(self.column[depth])

    def tokens(self, leaf: int) -> list[int]:
        """The token tuple of a leaf, walking up: a node's parent is the last node whose children
        start at or before it."""
        tokens = []
        node = leaf
        for depth in range(self.length - 1, -1, -1):
            tokens.append(int(self.vocab[depth][int(self.column[depth + 1][node])]))
            node = int(np.searchsorted(self.first_child[depth], node, side="right")) - 1
        return tokens[::-1]

    def tokens_of_leaves(self, leaves: np.ndarray) -> np.ndarray:
        """tokens() of many leaves at once, [len(leaves), L]: each depth one vectorised step for
        all of them (a /v1/score request's 1,000 item_ids took 0.3-0.7 s a leaf at a time)."""
        nodes = np.asarray(leaves, dtype=np.int64)
        out = np.empty((len(nodes), self.length), dtype=np.int64)
        for depth in range(self.length - 1, -1, -1):
            out[:, depth] = self.vocab[depth].cpu().numpy()[self.column[depth + 1][nodes]]
            nodes = np.searchsorted(self.first_child[depth], nodes, side="right") - 1
        return out

    def leaf_range(self, depth: int, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[lo, hi) of each node's leaves: its first child's first child ... down to depth L."""
        lo, hi = nodes, nodes + 1
        for d in range(depth, self.length):
            lo, hi = self.first_child[d][lo], self.first_child[d][hi]
        return lo, hi

    def expand(self, depth: int, nodes: np.ndarray, leaves: LeafFilter | None = None) -> Expansion:
        """The allowed continuations of beams at these nodes of `depth` (rows in order)."""
        first = self.first_child[depth]
        starts, ends = first[nodes], first[nodes + 1]
        counts = ends - starts
        rows = np.repeat(np.arange(len(nodes)), counts)
        # Each row's children, concatenated: start + 0, 1, ... per row.
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        children = np.repeat(starts, counts) + offsets
        if leaves is not None:
            alive = leaves.alive(*self.leaf_range(depth + 1, children))
            rows, children = rows[alive], children[alive]
            counts = np.bincount(rows, minlength=len(nodes))
        columns = self.column[depth + 1][children]
        width = len(self.vocab[depth])
        mask = np.zeros((len(nodes), width), dtype=bool)
        mask[rows, columns] = True
        child = np.empty((len(nodes), width), dtype=np.int64)
        child[rows, columns] = children
        return Expansion(torch.from_numpy(mask).to(self.vocab[depth].device), child, counts)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.first_child, *self.column)) + sum(
            v.numel() * v.element_size() for v in self.vocab)
