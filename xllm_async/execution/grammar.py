"""Structured outputs on the slot side, as vLLM v1 shapes them: xgrammar compiles a grammar from
the tokenizer's vocabulary (cached by its spec), each constrained sequence walks it with its own
matcher, and every step one bitmask for the batch's constrained rows, filled by their matchers,
masks the logits before sampling (our kernel, or xgrammar's where ours did not load). The library
owns the automaton; this module owns only when to compile, where the mask lives and which rows it
covers."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict

import torch
import xgrammar as xgr

log = logging.getLogger("xllm_async.grammar")

# Compiled grammars kept for reuse (from under a kilobyte to a few MB each over a large vocabulary),
# least recently used first out. Failures are kept too: a schema that fails slowly fails fast the next time.
CACHED_GRAMMARS = 128
CACHED_BYTES = 256 << 20
# Threads xgrammar may use inside one compilation: this machine's cores are the model's.
COMPILE_THREADS = 2
# xgrammar's messages start with "[hh:mm:ss] /path/to/file.cc:83: " (and sometimes a failed check).
_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """The library cannot compile this grammar; the message says why."""


class Grammars:
    """The served tokenizer's grammar compiler (built on first use: start-up and servers that never
    constrain an answer pay nothing) and its cache of compiled grammars, keyed by (kind, text).
    compile() blocks: it is called on the engine's compile threads, never on a slot's or the loop's."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width: wider than the tokenizer's vocabulary where padded
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str):
        """The compiled grammar of one spec: kind "json" (a JSON schema's text), "json_object", "regex",
        "choice" (a JSON list of strings) or "grammar" (EBNF / GBNF). Raises GrammarError."""
        key = (kind, text)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
            compiler = self._compiler = self._compiler or self._new_compiler()
        if found is None:
            try:
                found = _compile(compiler, kind, text)
                _check_first_step(found, self._vocab_size)
            except Exception as exc:  # noqa: BLE001  (the library raises RuntimeError and friends)
                found = GrammarError(_LIBRARY_PREFIX.sub("", str(exc)).strip()[:500] or type(exc).__name__)
            with self._lock:
                if key not in self._cache:  # (another thread may have compiled the same spec meanwhile)
                    self._cache[key] = found
                    self._cached_bytes += _size(found)
                while len(self._cache) > CACHED_GRAMMARS or self._cached_bytes > CACHED_BYTES:
                    self._cached_bytes -= _size(self._cache.popitem(last=False)[1])
        if isinstance(found, GrammarError):
            raise GrammarError(str(found))  # (a fresh one: the cached one may be raised on another thread too)
        return found

    def _new_compiler(self):
        try:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop_token_ids or None)
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(f"this server's tokenizer cannot be read by xgrammar ({exc})") from None
        # Our own cache stands in front of it, and keeps failures as well.
        return xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)


def _size(entry) -> int:
    return 0 if isinstance(entry, GrammarError) else entry.memory_size_bytes


def _compile(compiler, kind: str, text: str):
    # Compact JSON (", " and ": " between items, nothing else): with any whitespace allowed a small
    # model can spend its whole budget on newlines before the first key (vLLM's disable_any_whitespace).
    if kind == "json":
        return compiler.compile_json_schema(_bounded_strings_as_patterns(text), any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":  # one alternative per choice, each an EBNF string literal (JSON's escapes)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
    if kind == "grammar":
        return compiler.compile_grammar(text)
    raise GrammarError(f"unknown kind of grammar {kind!r}")


# A JSON string's character, counted by minLength / maxLength as JSON Schema counts them: anything
# but a quote, a backslash or a control character (xgrammar takes no escape in a pattern's string).
_JSON_CHARACTER = r'[^"\\\x00-\x1f]'
_NOT_SCHEMAS = frozenset(("enum", "const", "default", "examples"))  # data, where a schema's words are values


def _bounded_strings_as_patterns(text: str) -> str:
    """The schema with each string's minLength / maxLength said as a pattern. xgrammar 0.2.8 turns a
    bounded string into a repetition of any character but a quote, a backslash, CR and LF: a tab or
    another control character passes (JSON forbids them raw), and its masks are filled without the
    token cache (milliseconds a row). The pattern keeps JSON's rules, and its masks cost what an
    unbounded string's do."""
    schema = json.loads(text)

    def rewrite(node):
        if isinstance(node, list):
            for item in node:
                rewrite(item)
        elif isinstance(node, dict):
            if (node.get("type") == "string" and ("minLength" in node or "maxLength" in node)
                    and "pattern" not in node and "format" not in node):
                low, high = node.pop("minLength", 0), node.pop("maxLength", "")
                node["pattern"] = f"^{_JSON_CHARACTER}{{{low},{high}}}$"
            for key, value in node.items():
                if key not in _NOT_SCHEMAS:
                    rewrite(value)

    rewrite(schema)
    return json.dumps(schema)


def _check_first_step(compiled, vocab_size: int) -> None:
    # A grammar that derives nothing (`root ::= root`) compiles, then masks every token: refuse it here,
    # where the answer is a 400, rather than sample from a row of -inf.
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        raise GrammarError("it admits no text at all")


def new_matcher(compiled):
    """One sequence's walk through a compiled grammar (made at admission, execution/prepare.py)."""
    return xgr.GrammarMatcher(compiled)


def mask_logits(logits: torch.Tensor, matchers: list) -> list[int]:
    """Set to -inf, in place, every logit a row's grammar forbids now; rows without a matcher stay
    as they are. Returns the constrained rows (none: nothing was done)."""
    rows = [row for row, m in enumerate(matchers) if m is not None]
    if not rows:
        return rows
    bitmask = torch.empty(logits.shape[0], (logits.shape[-1] + 31) // 32, dtype=torch.int32)
    for row in rows:
        matchers[row].fill_next_token_bitmask(bitmask, row)
    if logits.device != bitmask.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    ours = _our_kernel() if logits.device.type == "cpu" else None
    if ours is not None:
        ours(logits, bitmask, rows)
    else:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
    return rows


_OURS: list = []  # [the operator], once found


def _our_kernel():
    """Our CPU kernel for the mask (model/csrc/token_bitmask.cpp: the same bits as xgrammar's, a word at
    a time, ~0.01 ms a row where xgrammar's loop takes ~0.3 ms), registered in torch's operator table
    once the runner loaded our library; None where it did not load (xgrammar's kernel serves). Looked up
    by name: this side of the slot threads imports nothing of the model."""
    if not _OURS:
        found = getattr(torch.ops.xllm, "apply_token_bitmask", None)
        if found is None:
            return None
        _OURS.append(found)
    return _OURS[0]


def accept_tokens(matchers: list, rows: list[int], tokens: list[int]) -> set[int]:
    """Each constrained row's matcher takes its sampled token; the rows whose grammar is now
    complete (it accepted a stop token) or at a dead end are returned: they end."""
    ended = set()
    for row in rows:
        matcher = matchers[row]
        if not matcher.accept_token(tokens[row]):  # (its mask allowed nothing: a grammar at a dead end)
            log.warning("a grammar refused the token %d its own mask allowed; its sequence ends", tokens[row])
            ended.add(row)
        elif matcher.is_terminated():
            ended.add(row)
    return ended
