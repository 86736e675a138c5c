"""The model runner: loads a Hugging Face causal LM once and runs batched
forwards over left-padded key/value caches. It knows tensors, not requests.

Left padding keeps every row's last real token in the last column, so a
prefill computes logits for that one position only, and a decode step is one
new column for all rows. Rows can be dropped (select) or batches joined (merge)
between steps, which is all the continuous scheduler needs.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from .host_memory import pack_weights

log = logging.getLogger("xllm_async.model")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class ModelRunner:
    """One model, loaded once, shared read-only by every execution thread."""

    def __init__(self, model_dir: str, device: torch.device, dtype: str = "auto") -> None:
        started = time.monotonic()
        log.info("loading tokenizer from %s", model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        log.info("loading weights from %s (dtype %s)", model_dir, dtype)
        config = AutoConfig.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=_DTYPES.get(dtype, "auto"), attn_implementation="sdpa"
        )
        log.info("moving weights to %s", device)
        self.model = model.to(device).eval()
        # On CPU, one resident block of huge pages instead of the mapped checkpoint (host_memory.py).
        self._weights_block = pack_weights(self.model) if device.type == "cpu" else None
        self.device = device
        self.dtype = self.model.dtype
        self.config = config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_model_len = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self.eos_token_ids = self._eos_ids(model)
        self.pad_id = 0
        self.load_seconds = time.monotonic() - started
        log.info("model ready in %.1f s: %s, %s, vocab %d, context %d",
                 self.load_seconds, config.model_type, self.dtype, self.vocab_size, self.max_model_len)

    def _eos_ids(self, model) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config):
            eos = getattr(source, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def prefill(self, prompts: list[list[int]], keep_cache: bool) -> tuple[torch.Tensor, KvCache | None]:
        """Run the prompts; return last-position logits [rows, vocab] and, if asked, their cache."""
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
                         cache=cache, use_cache=keep_cache, logits_to_keep=1)
        logits = out.logits[:, -1, :].float()
        if not keep_cache:
            return logits, None
        return logits, KvCache(cache, mask, positions[:, -1] + 1)

    def decode(self, kv: KvCache, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row; return the next logits [rows, vocab]."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        kv.mask = torch.cat([kv.mask, kv.mask.new_ones((len(tokens), 1))], dim=1)
        out = self.model(input_ids=ids, attention_mask=kv.mask, position_ids=kv.next_pos.unsqueeze(1),
                         cache=kv.cache, use_cache=True)
        kv.next_pos = kv.next_pos + 1
        return out.logits[:, -1, :].float()
