"""Which weights our model runs on (XLLM_QUANTIZATION), loaded once: plain (the folder's
safetensors), int8 (those rounded into Q8_0 blocks at load) or gguf (the model's GGUF file's own
blocks, as shipped). Quantized linears run on QuantWeight.linear, on the CPU only for now."""

from __future__ import annotations

import logging
import os

import torch

from ..model.llama import CausalLM
from ..model.loader import load_model
from ..model.quant_loader import load_gguf_model, quantize_linears, quantized_weights, weight_summary
from .backends import on_host
from .default_model import gguf_source

log = logging.getLogger("xllm_async.model")

QUANTIZATIONS = ("none", "int8", "gguf")


def load_weights(model_dir: str, config, device: torch.device, dtype: torch.dtype,
                 quantization: str = "none") -> tuple[CausalLM, dict]:
    """The model with its weights as XLLM_QUANTIZATION says, and what they are kept as
    (quant_loader.weight_summary, with "quantization" and, for gguf, "gguf_file")."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"XLLM_QUANTIZATION={quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
    if quantization != "none" and not on_host(device):
        raise ValueError(f"XLLM_QUANTIZATION={quantization} runs on the CPU only for now, not on {device}")
    source = None
    if quantization == "gguf":
        try:
            source = gguf_source(model_dir)
        except FileNotFoundError as exc:
            raise ValueError(f"XLLM_QUANTIZATION=gguf: {exc}") from None
        log.info("weights from %s, its quantized blocks as shipped", source)
        model = load_gguf_model(source, config, device, dtype)
    else:
        model = load_model(model_dir, config, device, dtype)
        if quantization == "int8":
            quantize_linears(model, "q8_0")
    summary = {"quantization": quantization, **weight_summary(model)}
    for quant in quantized_weights(model):
        quant.settle()  # packed once, now; the file's layout dropped where our kernel serves
    if source is not None:
        summary["gguf_file"] = os.path.basename(source)
    if quantization != "none":
        blocks = ", ".join(f"{kind} {size / 1e6:.1f} MB" for kind, size in sorted(summary["quantized_bytes"].items()))
        log.info("weights: %s blocks (%s), plain %.1f MB (embedding, norms, plain LM head)",
                 quantization, blocks, summary["plain_bytes"] / 1e6)
    return model, summary
