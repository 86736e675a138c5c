"""The transformers engine: any Hugging Face causal LM our own model code does
not cover, loaded once, batched forwards over left-padded key/value caches.
Same contract as model_runner.ModelRunner (execution/runner.py Runner), with one
difference it declares: its beam calls' rows are the logits themselves
(hidden_is_logits), since transformers runs the LM head inside its forward.

Left padding keeps every row's last real token in the last column, so a
prefill computes logits for that one position only, and a decode step is one
new column for all rows. Rows can be dropped (select) or batches joined (merge)
between steps, which is all the continuous scheduler needs.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ..execution.runner import BeamPrefilled, Prefilled, Runner, TopLogits, top_of_logits
from ..model.scoring import score_prompt
from .backends import on_host
from .checkpoint import eos_ids, resolve_dtype
from .device import default_kv_cache_bytes
from .host_memory import pack_weights

log = logging.getLogger("xllm_async.model")


class KvCache:
    """Key/value cache of a batch plus its attention mask and next positions."""

    __slots__ = ("cache", "mask", "next_pos")

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask  # [rows, columns] 1 = real token, 0 = left padding
        self.next_pos = next_pos  # [rows] position id of each row's next token

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), then drop padding columns no row needs."""
        index = torch.tensor(rows, device=self.mask.device)
        self.mask = self.mask.index_select(0, index)
        self.next_pos = self.next_pos.index_select(0, index)
        real = self.mask.any(dim=0).nonzero()
        start = int(real[0]) if len(real) else 0
        if start:
            self.mask = self.mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]

    def merge(self, other: KvCache) -> None:
        """Append other's rows below ours, left-padding the shorter side."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(other.mask, width, 1)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, width, 2), _pad_left(theirs.keys, width, 2)])
            mine.values = torch.cat([_pad_left(mine.values, width, 2), _pad_left(theirs.values, width, 2)])


def _token_bytes(config, dtype: torch.dtype) -> int:
    """One token's keys and values over every layer, as the config describes the attention (a
    model whose cache is smaller than that, as with sliding windows, is counted at the most)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class TransformersRunner(Runner):
    """One model, loaded once, shared read-only by every execution thread."""

    engine = "transformers"
    # The beam calls' rows are logits [rows, vocab] (float32), not hidden states: transformers'
    # forward ends with its own LM head, so logits() here only selects columns of them.
    hidden_is_logits = True
    packed = False  # left-padded: a batch costs rows x its longest prompt
    shares_beam_prompts = False  # every beam holds a copy of its prompt's cache (_CopiedBeams)
    packs_candidates = False  # ranking requests feed their candidates in rounds (beam_decode)
    picks_greedy = False  # the logits come out of transformers' forward: decode_greedy saves nothing
    picks_top = False  # (and decode_top likewise)
    kv_tokens = 0  # until set_kv_cache: no budget
    caches_prefixes = False  # no prefix cache: every prompt is computed whole
    prefix_store = None

    def __init__(self, model_dir: str, device: torch.device, dtype: str = "auto") -> None:
        started = time.monotonic()
        log.info("loading tokenizer from %s", model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        log.info("loading weights from %s (dtype %s)", model_dir, dtype)
        config = AutoConfig.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=resolve_dtype(dtype, config, device), attn_implementation="sdpa"
        )
        log.info("moving weights to %s", device)
        self.model = model.to(device).eval()
        # On CPU, one resident block of huge pages instead of the mapped checkpoint (host_memory.py).
        self._weights_block = pack_weights(self.model) if on_host(device) else None
        self.device = device
        self.dtype = self.model.dtype
        self.config = config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_model_len = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self.eos_token_ids = eos_ids(self.tokenizer, getattr(model, "generation_config", None), model.config)
        self.pad_id = 0
        self.kv_tokens = 0  # set_kv_cache: what admission lets a slot's caches hold
        self.token_bytes = _token_bytes(config, self.dtype)
        plain = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.weights = {"quantization": "none", "quantized_bytes": {}, "plain_bytes": plain, "weight_bytes": plain}
        self.load_seconds = time.monotonic() - started
        log.info("model ready in %.1f s: %s, %s, vocab %d, context %d",
                 self.load_seconds, config.model_type, self.dtype, self.vocab_size, self.max_model_len)

    def warm_up(self, max_rows: int, thread_counts: set[int]) -> None:
        """Nothing to compile ahead: transformers runs torch's own operators."""

    def capture_graphs(self, max_rows: int, capture=None) -> None:
        """No graphs: transformers' forward runs eagerly."""
        return None

    def topk_logsumexp(self) -> None:
        return None

    def match_prefix(self, prompt: list[int]):
        """Never asked: admission matches prefixes only where caches_prefixes (False here)."""
        raise NotImplementedError("the transformers engine has no prefix cache")

    def release_prefix(self, hit) -> None:
        """Never asked, as match_prefix()."""
        raise NotImplementedError("the transformers engine has no prefix cache")

    def set_kv_cache(self, total_bytes: int | None, slots: int, prefix_share: float = 0.0,
                     prefix_admit: str = "second") -> None:
        """transformers' caches grow by concatenation, with no arena: the budget is what admission
        counts (XLLM_KV_CACHE_BYTES, or the device's default, shared by the slots), so that no
        request makes them grow past it."""
        total = total_bytes or default_kv_cache_bytes(self.device)
        if prefix_share:
            log.info("prefix cache: none on the transformers engine (XLLM_PREFIX_CACHE applies to ours)")
        self.kv_tokens = total // slots // self.token_bytes
        log.info("key/value cache budget: %d slot(s) x %d tokens (%d bytes a token, from the config)", slots,
                 self.kv_tokens, self.token_bytes)

    def prefill(self, prompts: list[list[int]], capacity: int = 0, into: KvCache | None = None,
                between_layers=None, hits=None) -> Prefilled:
        """Run the prompts: their last-position logits [rows, vocab] and, if asked (capacity > 0 or
        into), their cache (into: merged below into's rows). between_layers is never called here:
        transformers' forward has no place for it (cores move between steps). No prefix cache."""
        _, logits, kv = self._run(prompts, capacity, into, False)
        return Prefilled(logits, kv)

    def prefill_scored(self, prompts: list[list[int]], capacity: int, into: KvCache | None,
                       scored: list[int | None], between_layers=None, hits=None) -> Prefilled:
        """prefill(), and for each prompt i with scored[i] set, its PromptScores (as ModelRunner's).
        transformers computes every position's logits of the batch, [rows, longest, vocab]."""
        every, logits, kv = self._run(prompts, capacity, into, True)
        width = every.shape[1]
        scores = [None if top is None else
                  score_prompt(lambda rows: rows.float(), every[i, width - len(p):width - 1], p[1:], top)
                  for i, (p, top) in enumerate(zip(prompts, scored))]
        return Prefilled(logits, kv, None, scores)

    def _run(self, prompts: list[list[int]], capacity: int, into: KvCache | None, every_position: bool):
        keep_cache = bool(capacity) or into is not None
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        pad = [self.pad_id] * width
        # One tensor from one nested list: a copy per row costs more than the whole list.
        ids = torch.tensor([pad[:width - n] + p for n, p in zip(lengths, prompts)], dtype=torch.long)
        mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=self.config) if keep_cache else None
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         cache=cache, use_cache=keep_cache, logits_to_keep=0 if every_position else 1)
        logits = out.logits[:, -1, :].float()
        if not keep_cache:
            return out.logits, logits, None
        kv = KvCache(cache, mask, positions[:, -1] + 1)
        if into is None:
            return out.logits, logits, kv
        into.merge(kv)
        return out.logits, logits, into

    def decode(self, kv: KvCache, tokens: list[int], between_layers=None) -> torch.Tensor:
        """Feed one token per row; return the next logits [rows, vocab]."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        kv.mask = torch.cat([kv.mask, kv.mask.new_ones((len(tokens), 1))], dim=1)
        out = self.model(input_ids=ids, attention_mask=kv.mask, position_ids=kv.next_pos.unsqueeze(1),
                         cache=kv.cache, use_cache=True)
        kv.next_pos = kv.next_pos + 1
        return out.logits[:, -1, :].float()

    def decode_greedy(self, kv: KvCache, tokens: list[int], between_layers=None) -> list[int]:
        """decode()'s logits' argmax (transformers makes them inside its forward: picks_greedy is False,
        so the engine takes decode() and its sampler instead)."""
        return self.decode(kv, tokens, between_layers).argmax(-1).tolist()

    def decode_top(self, kv: KvCache, tokens: list[int], width: int, between_layers=None) -> TopLogits:
        """decode()'s logits' largest (picks_top is False: the engine takes decode() instead)."""
        logits = self.decode(kv, tokens, between_layers)
        return top_of_logits(logits, width, logits)

    # --- beam search: the prompt's cache copied to every beam (our own engine shares it) ---

    def score_prefill(self, prompts: list[list[int]], candidates: list[tuple[list[int], list[int]]],
                      between_layers=None, hits=None) -> BeamPrefilled:
        raise NotImplementedError("transformers' forward takes no staged attention: candidates go in rounds")

    def beam_prefill(self, prompts: list[list[int]], widths: list[int], rounds: int, between_layers=None,
                     hits=None) -> BeamPrefilled:
        """The prompts' last logits [prompts, vocab] as the rows (hidden_is_logits), and their state."""
        out = self.prefill(prompts, capacity=1 if rounds > 1 else 0)
        return BeamPrefilled(out.logits, _CopiedBeams(out.cache, len(prompts)))

    def beam_decode(self, state, tokens: list[int], parents: list[int], widths: list[int],
                    between_layers=None) -> torch.Tensor:
        """One round: the beams' next logits [beams, vocab] as the rows (hidden_is_logits)."""
        state.kv.select(parents)  # copies each parent's whole cache row, prompt included
        state.widths = widths
        return self.decode(state.kv, tokens)

    def logits(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None, as_float: bool = True,
               columns: tuple[int, int] | None = None) -> torch.Tensor:
        """The beam calls' rows are the logits already (hidden_is_logits, float32 whatever as_float
        says): the whole of them, only these token ids' columns, or the columns [start, end)."""
        if columns is not None:
            return hidden[:, columns[0]:columns[1]]
        return hidden if tokens is None else hidden.index_select(1, tokens)


class _CopiedBeams:
    """Beam caches as whole rows, one per beam (one per prompt after the prefill)."""

    __slots__ = ("kv", "widths")

    def __init__(self, kv: KvCache | None, prompts: int) -> None:
        self.kv = kv
        self.widths = [1] * prompts

    @property
    def starts(self) -> list[int]:
        return list(itertools.accumulate(self.widths, initial=0))

    def keep(self, requests: list[int]) -> None:
        starts = self.starts
        rows = [b for r in requests for b in range(starts[r], starts[r + 1])]
        self.widths = [self.widths[r] for r in requests]
        if rows and self.kv is not None:
            self.kv.select(rows)
