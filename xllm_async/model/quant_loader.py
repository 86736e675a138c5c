"""Quantized weights into our model (XLLM_QUANTIZATION, issue 39): every linear's weight rounded
into Q8_0 blocks at load (int8), or a GGUF file's tensors as they ship (gguf). A linear then holds
its blocks (layers.Linear.quant), the LM head too (CausalLM.quant_lm_head); the embedding, the
norms and a plain LM head stay plain tensors (the embedding looks rows up, and item tables and
the tied embedding read the plain head: llama.CausalLM.logits)."""

from __future__ import annotations

import logging
import re

import numpy as np
import torch

from .layers import Linear
from .llama import CausalLM
from .loader import empty_model, fused_offsets
from .quantized import BLOCK, QuantWeight

# GGUF's types kept as blocks; a tensor of any other type is read de-quantized, as a plain weight.
BLOCK_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
# A block's tensor names (llama.cpp's) -> (our name under layers.N, its part of a fused matrix)
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PARTS = {
    "attn_q": ("attn.qkv", 0), "attn_k": ("attn.qkv", 1), "attn_v": ("attn.qkv", 2),
    "attn_output": ("attn.o", None), "ffn_gate": ("mlp.gate_up", 0), "ffn_up": ("mlp.gate_up", 1),
    "ffn_down": ("mlp.down", None), "attn_norm": ("input_norm", None),
    "ffn_norm": ("post_attention_norm", None), "attn_q_norm": ("attn.q_norm", None),
    "attn_k_norm": ("attn.k_norm", None),
}
_TOP = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head"}

Weight = torch.Tensor | QuantWeight
log = logging.getLogger("xllm_async.model")


def quantize_linears(model: CausalLM, kind: str = "q8_0") -> None:
    """Every linear's weight and the LM head's rounded into `kind` blocks (the linears' plain
    weights dropped). The plain LM head, which CausalLM.logits reads for an item table's tokens,
    takes the rounded values too, so that every path computes the same logits (tied, the
    embedding takes them, as a GGUF file's quantized token table does)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Linear) and module.weight is not None:
                module.quant = _rounded(name, module.weight, kind)
                module.weight = None
        model.quant_lm_head = _rounded("lm_head", model.lm_head, kind)
        model.lm_head.copy_(model.quant_lm_head.dequantize(model.lm_head.dtype))


def _rounded(name: str, weight: torch.Tensor, kind: str) -> QuantWeight:
    if weight.shape[1] % BLOCK:
        raise ValueError(f"cannot quantize {name}: its {weight.shape[1]} inputs are not a multiple of {BLOCK}")
    return QuantWeight.quantize(weight, kind)


def unpermuted_rows(heads: int, rows: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's converter on a Llama q or k weight: it stores each
    head's rows with the two rotary halves interleaved, where our rotary (and Hugging Face's) wants
    them as two halves (transformers' GGUF loader undoes it the same way: reverse_permute)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def read_gguf_tensor(tensor) -> Weight:
    """A GGUF tensor as a QuantWeight (the block types) or a float32 tensor (any other type)."""
    dims = [int(d) for d in reversed(tensor.shape.tolist())]  # GGUF lists the innermost dimension first
    kind = BLOCK_TYPES.get(tensor.tensor_type.name)
    if kind is not None and len(dims) == 2:
        return QuantWeight.from_gguf(kind, tensor.data, dims[1])
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)).reshape(dims)


def _plain(value: Weight) -> torch.Tensor:
    return value.dequantize() if isinstance(value, QuantWeight) else value


def _gguf_target(name: str) -> tuple[str, int | None] | None:
    if name in _TOP:
        return _TOP[name], None
    match = _GGUF_LAYER.fullmatch(name)
    if match is None or match.group(2) not in _PARTS:
        return None
    ours, part = _PARTS[match.group(2)]
    return f"layers.{match.group(1)}.{ours}.{match.group(3)}", part


def load_gguf_model(path: str, config, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Build the model from config.json's shape and fill it from a GGUF file: its linears keep the
    file's blocks (q, k, v and gate, up fused as loader.py fuses plain ones), its other tensors
    load as plain parameters in `dtype`."""
    from gguf import GGUFReader

    model = empty_model(config, device, dtype)
    shape = model.shape
    reader = GGUFReader(path)
    field = reader.fields.get("general.architecture")  # (a string: its bytes are the part data[0] names)
    permuted = field is not None and bytes(field.parts[field.data[0]]) == b"llama"  # (llama.cpp permutes Llama's only)
    parts: dict[str, dict[int | None, Weight]] = {}
    for tensor in reader.tensors:
        target = _gguf_target(tensor.name)
        if target is None:
            continue
        value = read_gguf_tensor(tensor)
        if permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = shape.heads if ".attn_q." in tensor.name else shape.kv_heads
            order = unpermuted_rows(heads, value.out_features if isinstance(value, QuantWeight) else value.shape[0])
            value = value.rows(order) if isinstance(value, QuantWeight) else value[order]
        parts.setdefault(target[0], {})[target[1]] = value
    if "lm_head" not in parts and "embed.weight" in parts:
        parts["lm_head"] = parts["embed.weight"]  # no output tensor: llama.cpp's head is the embedding too
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    filled = set()
    with torch.no_grad():
        for ours, pieces in parts.items():
            if ours == "lm_head" and shape.tied:
                continue
            value = _fused(path, ours, pieces, fused_offsets(shape, ours)) if None not in pieces else pieces[None]
            _fill(path, model, params, modules, ours, value)
            filled.add(ours)
        if shape.tied and isinstance(parts.get("embed.weight", {}).get(None), QuantWeight):
            model.quant_lm_head = parts["embed.weight"][None]
    missing = sorted(set(params) - filled - ({"lm_head"} if shape.tied else set()))
    if missing:
        raise ValueError(f"{path}: the GGUF file lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    return model.eval()


def _fused(path: str, ours: str, pieces: dict[int | None, Weight], offsets: list[int]) -> Weight:
    """The parts of a fused matrix stacked: as blocks where all are blocks of one format."""
    count = len(offsets) - 1
    if sorted(pieces) != list(range(count)):
        raise ValueError(f"{path}: {ours} has {len(pieces)} of its {count} parts")
    values = [pieces[i] for i in range(count)]
    kinds = {v.kind if isinstance(v, QuantWeight) else None for v in values}
    if len(kinds) == 1 and None not in kinds:
        return QuantWeight.stack(values)
    if kinds != {None}:  # (one matrix holds one format: a fused matrix of mixed parts runs plain)
        log.warning("%s: %s's parts are in %s; it runs de-quantized", path, ours,
                    ", ".join(sorted(k or "plain" for k in kinds)))
    return torch.cat([_plain(v) for v in values])


def _fill(path: str, model: CausalLM, params: dict, modules: dict, ours: str, value: Weight) -> None:
    """One of our parameters from the file: a linear's weight as its blocks, the LM head as
    blocks and plain, anything else plain."""
    expected = tuple(params[ours].shape)
    got = (value.out_features, value.in_features) if isinstance(value, QuantWeight) else tuple(value.shape)
    if got != expected:
        raise ValueError(f"{path}: {ours} is {list(got)} in the file, {list(expected)} in config.json")
    module = modules.get(ours.rsplit(".", 1)[0])
    if isinstance(value, QuantWeight) and isinstance(module, Linear) and ours.endswith(".weight"):
        module.quant, module.weight = value, None
        return
    if isinstance(value, QuantWeight) and ours == "lm_head":
        model.quant_lm_head = value
    params[ours].copy_(_plain(value))


def quantized_weights(model: CausalLM) -> list[QuantWeight]:
    """Every quantized weight of the model: its linears' and the LM head's."""
    quants = [m.quant for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    return quants + ([model.quant_lm_head] if model.quant_lm_head is not None else [])


def weight_summary(model: CausalLM) -> dict:
    """What the weights are kept as: bytes of blocks per format, bytes of plain parameters."""
    formats: dict[str, int] = {}
    for quant in quantized_weights(model):
        formats[quant.kind] = formats.get(quant.kind, 0) + quant.nbytes
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"quantized_bytes": formats, "plain_bytes": plain, "weight_bytes": plain + sum(formats.values())}
