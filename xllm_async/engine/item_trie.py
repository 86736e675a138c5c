"""The item table as a token trie: which tokens may follow a prefix, so that a
beam search only ever takes paths that spell an item.

Built once at start-up. Per depth d it holds the tokens that occur there
(`vocab[d]`, a device tensor: the LM head is computed over those rows of the
output embedding only) and, for every trie node at that depth, a row of a
boolean mask over vocab[d] (built once, gathered per round for the live beams).
Semantic ids (a few codebooks of 256 codes) give small tables: 5,000 items of
3 codes hold masks of 1 + 256 + 5,000 rows of at most 256 columns.
"""

from __future__ import annotations

import torch


class ItemTrie:
    """Items of one length L as a trie; node 0 is the root (depth 0)."""

    def __init__(self, items, device: torch.device) -> None:
        items = [tuple(key) for key in items]
        lengths = {len(key) for key in items}
        if len(lengths) != 1:
            raise ValueError(f"items of mixed lengths {sorted(lengths)}")
        self.length = lengths.pop()
        self.children: list[dict[int, int]] = [{}]  # node -> {token: child node}
        self.depth_of: list[int] = [0]
        for key in sorted(set(items)):
            node = 0
            for depth, token in enumerate(key):
                child = self.children[node].get(token)
                if child is None:
                    child = len(self.children)
                    self.children[node][token] = child
                    self.children.append({})
                    self.depth_of.append(depth + 1)
                node = child
        # A node with one child leaves its beam no choice: renormalised over the allowed tokens
        # that token's log-probability is 0 whatever the model says (BeamSearchBatch._forced).
        self.single: list[bool] = [len(c) == 1 for c in self.children]
        self.vocab: list[torch.Tensor] = []
        self.row_of: list[int] = [0] * len(self.children)  # node -> its row in its depth's mask
        self.masks: list[torch.Tensor] = []
        for depth in range(self.length):
            nodes = [n for n, d in enumerate(self.depth_of) if d == depth]
            tokens = sorted({t for n in nodes for t in self.children[n]})
            column = {t: i for i, t in enumerate(tokens)}
            mask = torch.zeros(len(nodes), len(tokens), dtype=torch.bool)
            for row, node in enumerate(nodes):
                self.row_of[node] = row
                mask[row, [column[t] for t in self.children[node]]] = True
            self.vocab.append(torch.tensor(tokens, dtype=torch.long, device=device))
            self.masks.append(mask.to(device))

    def allowed(self, depth: int, nodes: list[int]) -> torch.Tensor:
        """[len(nodes), len(vocab[depth])] True where the token continues an item."""
        rows = torch.tensor([self.row_of[n] for n in nodes], device=self.masks[depth].device)
        return self.masks[depth].index_select(0, rows)

    def step(self, node: int, token: int) -> int:
        return self.children[node][token]
