"""What a request needs on the slot side before and around its prefill: its detokenizer and
random generator, made at admission (so that whatever they make fail fails it alone), and its
prefix-cache hit, released when its prefill is over."""

from __future__ import annotations

import contextlib

from ..engine.request import EngineRequest, QueuedRequest
from .detokenizer import IncrementalDetokenizer
from .grammar import new_matcher
from .sampling import make_generator
from .token_controls import row_controls


def prepare(runner, request: QueuedRequest) -> None:
    """Build what stepping the request needs from its own fields, before it joins a batch
    (Engine.submit, on the loop): a generation request's detokenizer and its own random generator
    (seeded from its `seed`), its token controls' tensors and, with a compiled grammar, its own
    matcher; a beam search needs nothing."""
    if isinstance(request, EngineRequest):
        params = request.params
        request.bind(IncrementalDetokenizer(runner.tokenizer), runner.eos_token_ids, runner.max_model_len)
        request.generator = make_generator(params, runner.device, request.index)
        if params.controls is not None:  # (the stop ids' set only for the rows that have controls)
            stop_ids = params.stop_token_ids if params.ignore_eos else runner.eos_token_ids | params.stop_token_ids
            request.controls = row_controls(params.controls, request.prompt_ids, request.output_ids, stop_ids)
        if request.grammar is not None:
            request.matcher = new_matcher(request.grammar)


_NO_PREFIXES = contextlib.nullcontext()  # (shared: it holds nothing, and yields None)


def admitted_prefixes(runner, requests: list[QueuedRequest]):
    """Their prefill's block: yields each request's prefix-cache hit from admission (None where the
    runner caches no prefixes: then nothing else runs), and unpins them after it, whether it
    returned or raised."""
    return _unpinned_after(runner, requests) if runner.caches_prefixes else _NO_PREFIXES


@contextlib.contextmanager
def _unpinned_after(runner, requests: list[QueuedRequest]):
    try:
        yield [req.prefix for req in requests]
    finally:
        for req in requests:
            if req.prefix is not None:
                runner.release_prefix(req.prefix)
                req.prefix = None
