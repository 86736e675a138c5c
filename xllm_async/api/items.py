"""The item table of generative recommendation: token-id tuples -> item ids.

File format (loaded once at start-up), one item per line, `#` comments:

    <item id><TAB><token id> <token id> <token id>
"""

from __future__ import annotations


class ItemTableError(Exception):
    """The item table file cannot be read; the message names the file and line."""


class ItemTable:
    """Token-id tuples -> item ids; the engine searches only its items (engine/item_trie.py)."""

    def __init__(self, items: dict[tuple[int, ...], str]) -> None:
        self.items = items

    @classmethod
    def load(cls, path: str) -> ItemTable:
        items: dict[tuple[int, ...], str] = {}
        length = 0
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    line = line.strip()
                    if not line or line.startswith("#"):
                        continue
                    item_id, sep, tokens = line.partition("\t")
                    try:
                        key = tuple(int(t) for t in tokens.split())
                    except ValueError:
                        key = ()
                    if not sep or not item_id or not key:
                        raise ItemTableError(f"{path}:{number}: expected '<item id><TAB><token ids>'")
                    if items and len(key) != length:
                        raise ItemTableError(f"{path}:{number}: an item of {len(key)} tokens; the items above "
                                             f"have {length} (every item id must have the same length)")
                    length = len(key)
                    items[key] = item_id
        except OSError as exc:
            raise ItemTableError(f"{path}: {exc.strerror}") from None
        if not items:
            raise ItemTableError(f"{path}: no items")
        return cls(items)

    @property
    def item_length(self) -> int:
        return len(next(iter(self.items)))

    def select(self, beams: list, count: int) -> list[tuple[object, str | None]]:
        """The best `count` beams with their item ids (a constrained search returns only items)."""
        return [(beam, self.items.get(tuple(beam.token_ids))) for beam in beams[:count]]
