"""vLLM's `use_beam_search` on our beam search: the request's fields read (width n, n sequences
back, best first), and the answer's beams ended at their first EOS.

Our beams all run max_tokens rounds with EOS an ordinary token (engine/beam.py): that is vLLM's
beam search with `ignore_eos: true`, whose beams are all as long, so `length_penalty` cannot change
their order and any value is taken. Without `ignore_eos`, vLLM ends a beam at its EOS and ranks the
ended ones by logprob / length^length_penalty; here each beam's answer ends at its first EOS
(finish_reason "stop"), the ranking stays by the whole run's logprob, so only the default
`length_penalty` (1) is taken, and beams equal up to their EOS are answered once."""

from __future__ import annotations

from ..execution.beam import BeamResult
from .fields import Fields, bad
from .model_info import ModelInfo

# Without both, there is no vLLM beam search and no length_penalty to check.
_FIELDS = frozenset(("use_beam_search", "length_penalty"))


class VllmBeamSearch:
    """What a request's use_beam_search asks for."""

    __slots__ = ("width", "stops_at_eos")

    def __init__(self, width: int, stops_at_eos: bool) -> None:
        self.width = width  # n: the beams kept each round and the sequences answered
        self.stops_at_eos = stops_at_eos


def read_use_beam_search(fields: Fields, model: ModelInfo) -> VllmBeamSearch | None:
    """use_beam_search's search, or None without it (then length_penalty only at its default,
    unless our own `beam_width` search takes it)."""
    if _FIELDS.isdisjoint(fields.body):  # (nearly every request: neither sent)
        return None
    if not fields.bool("use_beam_search", False):
        if fields.raw("beam_width") is None:
            _default_length_penalty(fields, "applies to a beam search (`use_beam_search`) only")
        else:
            fields.float("length_penalty", 1.0, -1e6, 1e6)  # (every beam is max_tokens long)
        return None
    for name in ("beam_width", "num_return_sequences"):
        if fields.raw(name) is not None:
            raise bad(name, f"`{name}` is this server's own beam search; `use_beam_search` takes its width "
                            "and sequences from `n`: give one or the other")
    width = fields.int("n", 1, 1, min(model.beam.max_beam_width, model.beam.max_num_return_sequences))
    stops_at_eos = not fields.bool("ignore_eos", False)
    if stops_at_eos:
        _default_length_penalty(fields, "orders beams of different lengths, and the beams here all run "
                                        "`max_tokens` rounds: send `ignore_eos: true` (every beam as long, "
                                        "as vLLM then has them) or leave it out")
    else:
        fields.float("length_penalty", 1.0, -1e6, 1e6)
    return VllmBeamSearch(width, stops_at_eos)


def _default_length_penalty(fields: Fields, why: str) -> None:
    if fields.float("length_penalty", 1.0, -1e6, 1e6) != 1.0:
        raise bad("length_penalty", f"`length_penalty` {why}")


def ended_at_eos(chosen: list[list[tuple]], eos_token_ids: frozenset[int], tokenizer) -> list[list[tuple]]:
    """Per prompt, its (beam, item ids) pairs with each beam cut before its first EOS; a beam
    equal to a better one once cut is left out (so fewer than n may come back)."""
    out = []
    for pairs in chosen:
        seen = set()
        kept = []
        for beam, items in pairs:
            ids = beam.token_ids
            end = next((i for i, token in enumerate(ids) if token in eos_token_ids), None)
            if end is not None:
                ids = ids[:end]
                beam = EndedBeam(ids, tokenizer.decode(ids, skip_special_tokens=True), beam.cumulative_logprob)
            if tuple(ids) not in seen:
                seen.add(tuple(ids))
                kept.append((beam, items))
        out.append(kept)
    return out


class EndedBeam(BeamResult):
    """A beam answered up to its EOS (its score is still the whole run's)."""

    __slots__ = ()
    finish_reason = "stop"
