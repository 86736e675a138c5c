"""The model runner: loads a model once and runs batched forwards for every
execution slot. It knows tensors and token ids, not requests.

Two engines sit behind one interface (prefill, decode, the beam calls):
- ModelRunner: our own model code (xllm_async/model) for the Llama family
  (Llama, Qwen2, Qwen3): prompts packed without padding, keys and values written
  in place into each slot's arena, the LM head a separate call;
- TransformersRunner (hf_runner.py): any other causal LM through transformers,
  left-padded, as before.
load_runner() picks one and says which in the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoTokenizer

from ..execution.runner import BeamPrefilled, Prefilled, Runner, TopLogits, top_of_logits
from ..model.cpu_linear import WARM_FROM, pack_linears, packed_weights, warm_onednn
from ..model.forward_context import BeamDecode, Decode, PackedPrefill
from ..model.kv_budget import KvBudget
from ..model.kv_cache import BeamState, KvArena, KvLayout, SlabCache
from ..model.llama import ModelShape, use_fused_kernels
from ..model.prefix_cache import BLOCK_TOKENS, PrefixStore
from ..model.scoring import score_prompt
from .backends import choose_attention, choose_beam_topk, choose_fused, choose_linear, linear_name, on_host
from .cached_prefill import CachedPrefill
from .checkpoint import eos_ids, generation_config, resolve_dtype
from .device import default_kv_cache_bytes, graph_capture
from .graphs import PiecewiseGraphs
from .host_memory import host_tensor, one_intra_op_thread, pack_linear_weights, pack_weights
from .weights import load_weights

log = logging.getLogger("xllm_async.model")

# The prefix store's share of the key/value budget on an accelerator, where memory is allocated
# whole and cannot go back and forth between the store and the slots (set_kv_cache).
ACCELERATOR_PREFIX_SHARE = 0.5


class ModelRunner(CachedPrefill, Runner):
    """Our own model code, loaded once, shared read-only by every execution thread;
    each thread keeps its own key/value arena (allocated once, on first use)."""

    engine = "native"
    hidden_is_logits = False  # the beam calls return final hidden states; logits() is the LM head
    packed = True  # prompts cost their own tokens, not the longest one's
    shares_beam_prompts = True  # a beam search keeps its prompt's cache once (BeamState)
    packs_candidates = True  # score_prefill: a ranking request's candidates in its prompt's forward

    def __init__(self, model_dir: str, device: torch.device, dtype: str = "auto", quantization: str = "none") -> None:
        started = time.monotonic()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.config = AutoConfig.from_pretrained(model_dir)
        self.device = device
        self.dtype = resolve_dtype(dtype, self.config, device)
        log.info("loading weights from %s (%s)", model_dir, self.dtype)
        with one_intra_op_thread():
            # (weights: what they are kept as, quantized or plain: /server_info shows it)
            self.model, self.weights = load_weights(model_dir, self.config, device, self.dtype, quantization)
            packing = choose_linear(device, self.dtype)
            packed = pack_linears(self.model, packing) if packing is not None else 0
            if packed:
                log.info("%d linear layers packed for %s", packed, linear_name(packing, self.dtype))
            fused = choose_fused(device, self.dtype)
            if fused is not None:
                ops, chunk_mlp, name = fused
                use_fused_kernels(self.model, ops, chunk_mlp)
                log.info("norms, rotary and SiLU on %s", name)
        # On CPU, one resident block of huge pages instead of the mapped checkpoint (host_memory.py).
        self._weights_block = pack_weights(self.model) if on_host(device) else None
        # And what a decode step streams, the packed linears, on huge pages too (host_memory.py).
        self._linears_block = pack_linear_weights(packed_weights(self.model)) if on_host(device) else None
        shape = self.model.shape
        # What computes attention, chosen once (attention_backends.py); a test may set another.
        self.attention = choose_attention(device, self.dtype, shape.head_dim, shape.heads // shape.kv_heads)
        self._beam_topk = choose_beam_topk(device, self.dtype)
        self.vocab_size = shape.vocab
        self.picks_greedy = self.model.picks_greedy  # (our packed LM head fused with the argmax)
        self.picks_top = self.model.picks_top  # (and with a top-k)
        self.max_model_len = int(shape.max_positions or 2048)
        generation = generation_config(model_dir)
        self.eos_token_ids = eos_ids(self.tokenizer, generation, self.config)
        self.kv_layout = KvLayout(shape.layers, shape.kv_heads, shape.head_dim, self.dtype)
        self.kv_tokens = 0  # per slot, set by set_kv_cache()
        self.prefix_store: PrefixStore | None = None  # shared by the slots (set_kv_cache)
        self._budget: KvBudget | None = None  # where the store has what the arenas leave (set_kv_cache)
        self._local = threading.local()
        self.load_seconds = time.monotonic() - started
        log.info("model ready in %.1f s: %s on our own model code, %s, vocab %d, context %d",
                 self.load_seconds, shape.family, self.dtype, self.vocab_size, self.max_model_len)

    def warm_up(self, max_rows: int, thread_counts: set[int]) -> None:
        """Compile ahead what a forward of up to max_rows tokens would compile on first meeting it
        (cpu_linear.warm_onednn): nothing unless oneDNN's linear runs here."""
        started = time.monotonic()
        compiled: list[int] = []
        # On a thread of its own: parallel work on the event loop's thread starts an OpenMP team for
        # it, and every slot runs slower after that (host_memory.one_intra_op_thread): c2 0.70x.
        worker = threading.Thread(target=lambda: compiled.append(warm_onednn(self.model, max_rows, thread_counts)),
                                  name="xllm-warm-up")
        worker.start()
        worker.join()
        kernels = compiled[0] if compiled else 0
        if kernels:
            log.info("%d oneDNN kernels for batches of over %d rows compiled in %.1f s", kernels, WARM_FROM,
                     time.monotonic() - started)

    def set_kv_cache(self, total_bytes: int | None, slots: int, prefix_share: float | None = 0.0,
                     prefix_admit: str = "second") -> None:
        """Size every slot's arena: total_bytes (None: the device's default) shared by the slots, and
        the prefix cache's store (model/prefix_cache.py), which keeps a block on its second sight
        (prefix_admit "second": model/seen_blocks.py) or every one ("all"). prefix_share 0: no store;
        a fraction: the store holds that share of the bytes, the slots the rest; None: on a CPU the
        store holds whatever the slots' arenas have not reached (model/kv_budget.py), the slots
        as much as with no store; on an accelerator, where memory is allocated whole, half."""
        total = total_bytes or default_kv_cache_bytes(self.device)
        token_bytes = self.kv_layout.token_bytes
        block_bytes = BLOCK_TOKENS * token_bytes
        adapts = prefix_share is None and on_host(self.device)
        if prefix_share is None and not adapts:
            prefix_share = ACCELERATOR_PREFIX_SHARE
        blocks = total // block_bytes if adapts else int(total * prefix_share) // block_bytes
        self.prefix_store = PrefixStore(self.kv_layout, blocks, self.device, prefix_admit) if blocks else None
        self._budget = KvBudget(total, self.prefix_store) if adapts and blocks else None
        self.kv_tokens = (total - (0 if adapts else blocks * block_bytes)) // slots // token_bytes
        log.info("key/value cache: %d slot(s) x %d tokens (%.0f MiB each, %d bytes a token)", slots,
                 self.kv_tokens, self.kv_tokens * token_bytes / 2**20, token_bytes)
        if blocks:
            log.info("prefix cache: up to %d blocks of %d tokens (%.0f MiB)%s, shared by the slots", blocks,
                     BLOCK_TOKENS, blocks * block_bytes / 2**20,
                     ": what the slots' caches do not reach" if adapts else "")

    def _arena(self) -> KvArena:
        arena = getattr(self._local, "arena", None)
        if arena is None:
            if not self.kv_tokens:
                self.set_kv_cache(None, 1)
            arena = self._local.arena = KvArena(self.kv_layout, self.kv_tokens, self.device,
                                                host_tensor if on_host(self.device) else None,
                                                self._budget.reach if self._budget is not None else None)
        return arena

    def capture_graphs(self, max_rows: int, capture=None) -> PiecewiseGraphs | None:
        """On an execution slot's thread, at start-up: capture the pieces of the forward for
        batches of up to max_rows tokens (runtime/graphs.py); this thread's forwards of that
        size replay them from then on (max_rows 0: none, any this thread had are dropped).
        capture: the device's (graph_capture), or a stand-in (tests run the pieces as they are).
        None where the device has no graphs."""
        self._local.graphs = None
        capture = capture or graph_capture(self.device)
        if capture is None or max_rows < 1:
            return None
        graphs = PiecewiseGraphs(self.model, self.device, max_rows)
        graphs.capture(capture)
        self._local.graphs = graphs
        return graphs

    def _forward(self, tokens: list[int], ctx, between_layers: Callable[[], None] | None) -> torch.Tensor:
        """The model's forward, from this thread's graphs where it has some of that size: the final
        hidden states of the rows that need logits (ctx.last's, where it has one). between_layers:
        called after every layer of an eager forward (the engine's CPU core rule)."""
        graphs = getattr(self._local, "graphs", None)
        if graphs is None or len(tokens) > graphs.max_rows:
            return self.model(self._ids(tokens), ctx, between_layers)
        hidden = graphs.forward(torch.tensor(tokens, dtype=torch.long), ctx)
        last = getattr(ctx, "last", None)
        return hidden if last is None else hidden[last]

    def _ids(self, tokens) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long).to(self.device)

    def prefill(self, prompts: list[list[int]], capacity: int = 0,
                into: SlabCache | None = None, between_layers: Callable[[], None] | None = None,
                hits: list | None = None) -> Prefilled:
        """Run the prompts packed: their last-position logits [rows, vocab] and the cache.

        capacity > 0 keeps their keys in a cache with room for that many tokens a row;
        into appends them as new rows of an existing cache (the continuous scheduler).
        hits: the prompts' match_prefix() hits from admission (a None entry, or none: matched here).
        """
        hidden, cache, _, cached = self._packed(prompts, capacity, into, None, between_layers, hits)
        return Prefilled(self.model.logits(hidden), cache, cached)

    def prefill_scored(self, prompts: list[list[int]], capacity: int, into: SlabCache | None,
                       scored: list[int | None], between_layers: Callable[[], None] | None = None,
                       hits: list | None = None) -> Prefilled:
        """prefill(), and for each prompt i with scored[i] set, its PromptScores with the
        scored[i] likeliest alternatives at every position (None for the others, which may find
        a cached prefix: a scored prompt needs every position's logits, so it computes them all)."""
        hidden, cache, ctx, cached = self._packed(prompts, capacity, into, [k is not None for k in scored],
                                                  between_layers, hits)
        head = self.model.logits
        scores, row = [], 0
        for prompt, top in zip(prompts, scored):
            if top is None:
                scores.append(None)
                row += 1
                continue
            scores.append(score_prompt(head, hidden[row:row + len(prompt) - 1], prompt[1:], top))
            row += len(prompt)
        return Prefilled(head(hidden[ctx.last_kept]), cache, cached, scores)

    def _packed(self, prompts: list[list[int]], capacity: int, into: SlabCache | None,
                whole: list[bool] | None, between_layers: Callable[[], None] | None, held: list | None,
                ) -> tuple[torch.Tensor, SlabCache | None, PackedPrefill, list[int] | None]:
        lengths = [len(p) for p in prompts]
        with self._claimed(prompts, whole, held) as hits:
            cache, first = into, 0
            slab_anyway = bool(capacity) or into is not None
            if slab_anyway or self._slab_for_prefixes(lengths, hits):
                capacity = max(capacity, max(lengths))
                if cache is None:
                    cache = SlabCache(self._arena(), len(prompts), capacity)
                first = cache.add_rows(lengths, capacity)
            hidden, ctx, cached = self._turns(prompts, cache, first, whole, between_layers, hits,
                                              self._admitted(hits, slab_anyway))
        return hidden, cache, ctx, cached

    def decode(self, kv: SlabCache, tokens: list[int], between_layers: Callable[[], None] | None = None,
               ) -> torch.Tensor:
        """Feed one token per row; return the next logits [rows, vocab]."""
        kv.ensure_room()
        hidden = self._forward(tokens, Decode(self.attention, kv), between_layers)
        kv.step()
        return self.model.logits(hidden)

    def decode_greedy(self, kv: SlabCache, tokens: list[int], between_layers: Callable[[], None] | None = None,
                      ) -> list[int]:
        """decode(), and each row's greedy token: where picks_greedy by the LM head's fused pick
        (CausalLM.greedy), which makes no [rows, vocab] logits."""
        kv.ensure_room()
        hidden = self._forward(tokens, Decode(self.attention, kv), between_layers)
        kv.step()
        return self.model.greedy(hidden).tolist()

    def decode_top(self, kv: SlabCache, tokens: list[int], width: int,
                   between_layers: Callable[[], None] | None = None) -> TopLogits:
        """decode(), and each row's `width` largest logits: where picks_top by the LM head's fused
        top-k (CausalLM.top), else from the logits."""
        kv.ensure_room()
        hidden = self._forward(tokens, Decode(self.attention, kv), between_layers)
        kv.step()
        if self.picks_top:
            return TopLogits(*self.model.top(hidden, width), hidden, self.model.packed_lm_head.out_features)
        return top_of_logits(self.model.logits(hidden), width, hidden)

    # --- beam search (execution/beam.py): the prompt's keys once, each beam's own tokens apart ---

    def beam_prefill(self, prompts: list[list[int]], widths: list[int], rounds: int,
                     between_layers: Callable[[], None] | None = None, hits: list | None = None) -> BeamPrefilled:
        """Prefill each prompt once: final hidden states [prompts, hidden] and their BeamState.
        widths: the most beams each request will have; rounds: the most rounds any request runs;
        hits: as prefill()'s.

        Both caches come out of this slot's arena, as admission counted them (BeamRequest):
        the prompts' rows x the longest prompt, then every beam x its rounds after the first."""
        lengths = [len(p) for p in prompts]
        cache = own = None
        with self._claimed(prompts, None, hits) as claimed:
            if rounds > 1 or self._slab_for_prefixes(lengths, claimed):
                arena = self._arena()
                cache = SlabCache(arena, len(prompts), max(lengths))
                cache.add_rows(lengths, max(lengths))
            if rounds > 1:
                # Right after the prompts' rectangle, which never grows: their rows only leave (BeamState.keep).
                own = arena.view(sum(widths), rounds - 1, start=cache.row_capacity * cache.capacity)
            hidden, _, cached = self._turns(prompts, cache, 0, None, between_layers, claimed,
                                            self._admitted(claimed, rounds > 1))
        return BeamPrefilled(hidden, BeamState(cache, lengths, own), cached)

    def beam_decode(self, state: BeamState, tokens: list[int], parents: list[int], widths: list[int],
                    between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """One round: every live beam's last token in; final hidden states [beams, hidden] out.
        parents[i]: the row of the last round that beam i continues; widths: live beams per request."""
        state.follow(parents, widths)
        ctx = BeamDecode(self.attention, state.prompts, state.lengths, state.starts, state.own, state.step,
                         self.device)
        # (from graphs: a view, valid until this thread's next forward)
        hidden = self._forward(tokens, ctx, between_layers)
        state.step += 1
        return hidden

    def score_prefill(self, prompts: list[list[int]], candidates: list[tuple[list[int], list[int]]],
                      between_layers: Callable[[], None] | None = None, hits: list | None = None) -> BeamPrefilled:
        """Each prompt once and its candidates' rows after it in one forward (CandidatePrefill):
        final hidden states of each prompt's last token, then of every candidate row in order.
        candidates[i]: request i's rows as (tokens, parents), parents[r] the row r continues (-1: the prompt)."""
        lengths = [len(p) for p in prompts]
        fed = any(tokens for tokens, _ in candidates)
        cache = None
        with self._claimed(prompts, None, hits) as claimed:
            if fed or self._slab_for_prefixes(lengths, claimed):
                cache = SlabCache(self._arena(), len(prompts), max(lengths))
                cache.add_rows(lengths, max(lengths))
            hidden, _, cached = self._prefill_rows(prompts, cache, 0, None, between_layers, claimed,
                                                   candidates if fed else None, self._admitted(claimed, fed))
        return BeamPrefilled(hidden, None, cached)

    def logits(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None, as_float: bool = True,
               columns: tuple[int, int] | None = None) -> torch.Tensor:
        """The LM head over the whole vocabulary, only these token ids, or the columns [start, end)."""
        return self.model.logits(hidden, tokens, as_float, columns)

    def topk_logsumexp(self):
        """Our beam top-k kernel where logits are bfloat16 on a CPU that has it (execution/runner.py)."""
        return self._beam_topk


def load_runner(model_dir: str, device: torch.device, dtype: str = "auto", engine: str = "auto",
                quantization: str = "none"):
    """Our own model code where it supports the model (engine auto or native), else transformers."""
    from .hf_runner import TransformersRunner

    config = AutoConfig.from_pretrained(model_dir)
    why_not = ModelShape(config).unsupported()
    if engine == "native" and why_not:
        raise ValueError(f"XLLM_ENGINE=native cannot run {model_dir}: {why_not}")
    if engine == "transformers" or why_not:
        if quantization != "none":
            raise ValueError(f"XLLM_QUANTIZATION={quantization} needs our engine, which cannot run {model_dir}: "
                             f"{why_not or 'XLLM_ENGINE=transformers'}")
        log.info("engine: transformers (%s)", why_not or "XLLM_ENGINE=transformers")
        return TransformersRunner(model_dir, device, dtype)
    log.info("engine: native (%s)", config.model_type)
    return ModelRunner(model_dir, device, dtype, quantization)
