"""What validation needs to know about the served model: its name, tokenizer, lengths and the
beam searches it allows."""

from __future__ import annotations

# Text longer than this, in characters, is tokenized with the GIL released and off the event loop:
# tokenizing a prompt of megabytes would otherwise stall every other client for seconds.
LONG_TEXT = 16_384


class BeamLimits:
    """What beam (recommendation) requests may ask for on this server."""

    __slots__ = ("supported", "max_beam_width", "max_num_return_sequences", "default_rounds", "item_length",
                 "max_rounds")

    def __init__(self, supported: bool = True, max_beam_width: int = 128, max_num_return_sequences: int = 128,
                 default_rounds: int = 3, item_length: int = 0, max_rounds: int = 64) -> None:
        self.supported = supported  # the continuous scheduler runs no beam search
        self.max_beam_width = max_beam_width
        self.max_num_return_sequences = max_num_return_sequences
        self.default_rounds = item_length or default_rounds
        self.item_length = item_length  # with an item table: every item id's length in tokens (0: no table)
        self.max_rounds = max_rounds


class ModelInfo:
    """What validation needs to know about the served model and its limits."""

    __slots__ = ("name", "tokenizer", "vocab_size", "max_model_len", "max_n", "beam", "encode")

    def __init__(self, name: str, tokenizer, vocab_size: int, max_model_len: int, max_n: int,
                 beam: BeamLimits | None = None) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_n = max_n
        self.beam = beam or BeamLimits()
        # The Rust tokenizer directly: the Python wrapper costs more than the encoding itself.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            def encode(text: str, special: bool) -> list[int]:
                if len(text) < LONG_TEXT:
                    return backend.encode(text, add_special_tokens=special).ids
                # encode holds the GIL throughout; encode_batch lets the loop and the slots run meanwhile.
                return backend.encode_batch([text], add_special_tokens=special)[0].ids
            self.encode = encode
        else:
            self.encode = lambda text, special: tokenizer.encode(text, add_special_tokens=special)
