"""The item table of generative recommendation: token-id tuples -> item ids.

File format (loaded once at start-up), one item per line, `#` comments:

    <item id><TAB><token id> <token id> <token id>
"""

from __future__ import annotations


class ItemTableError(Exception):
    """The item table file cannot be read; the message names the file and line."""


class ItemTable:
    def __init__(self, items: dict[tuple[int, ...], str], unknown: str = "filter") -> None:
        self.items = items
        self.unknown = unknown  # filter: drop sequences that name no item; flag: keep them with item_id null

    @classmethod
    def load(cls, path: str, unknown: str = "filter") -> ItemTable:
        items: dict[tuple[int, ...], str] = {}
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
                    items[key] = item_id
        except OSError as exc:
            raise ItemTableError(f"{path}: {exc.strerror}") from None
        return cls(items, unknown)

    def select(self, beams: list, count: int) -> list[tuple[object, str | None]]:
        """The best `count` beams with their item ids, unknown ones filtered or flagged."""
        chosen = []
        for beam in beams:
            item_id = self.items.get(tuple(beam.token_ids))
            if item_id is None and self.unknown == "filter":
                continue
            chosen.append((beam, item_id))
            if len(chosen) == count:
                break
        return chosen
