"""Checkpoint names -> our fused parameters. The Llama family's safetensors
hold q/k/v and gate/up as separate matrices; we stack them once at load."""

from __future__ import annotations

import glob
import os
import re

import torch
from safetensors import safe_open

from .layers import RotaryEmbedding
from .llama import CausalLM, ModelShape

# checkpoint name (after "model.") -> (our name, rows slot): slot says which part of a fused matrix it fills
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_RENAMES = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", None),
    "self_attn.o_proj.weight": ("attn.o.weight", None),
    "self_attn.o_proj.bias": ("attn.o.bias", None),
    "self_attn.q_norm.weight": ("attn.q_norm.weight", None),
    "self_attn.k_norm.weight": ("attn.k_norm.weight", None),
    "self_attn.q_proj.weight": ("attn.qkv.weight", 0),
    "self_attn.k_proj.weight": ("attn.qkv.weight", 1),
    "self_attn.v_proj.weight": ("attn.qkv.weight", 2),
    "self_attn.q_proj.bias": ("attn.qkv.bias", 0),
    "self_attn.k_proj.bias": ("attn.qkv.bias", 1),
    "self_attn.v_proj.bias": ("attn.qkv.bias", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up.weight", 1),
    "mlp.down_proj.weight": ("mlp.down.weight", None),
    "mlp.gate_proj.bias": ("mlp.gate_up.bias", 0),
    "mlp.up_proj.bias": ("mlp.gate_up.bias", 1),
    "mlp.down_proj.bias": ("mlp.down.bias", None),
}


def _target(name: str) -> tuple[str, int | None] | None:
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed.weight", None
    if name == "norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head", None
    match = _LAYER.fullmatch(name)
    if match and match.group(2) in _RENAMES:
        ours, part = _RENAMES[match.group(2)]
        return f"layers.{match.group(1)}.{ours}", part
    return None


def fused_offsets(shape: ModelShape, name: str) -> list[int]:
    """Row offsets of the parts of a fused parameter."""
    if ".qkv." in name:
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        return [0, q, q + kv, q + 2 * kv]
    return [0, shape.intermediate, 2 * shape.intermediate]


def empty_model(config, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The model of config.json's shape, its weights allocated but not yet filled."""
    shape = ModelShape(config)
    with torch.device("meta"):
        model = CausalLM(shape)
    model = model.to_empty(device=device).to(dtype)
    if shape.tied:
        model.lm_head = model.embed.weight
    model.rotary = RotaryEmbedding(shape.head_dim, shape.max_positions, shape.rope_theta,
                                   shape.rope_scaling).to(device)
    return model


def load_model(model_dir: str, config, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Build the model from config.json's shape and fill it from the folder's safetensors."""
    model = empty_model(config, device, dtype)
    shape = model.shape
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    with torch.no_grad():
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    target = _target(name)
                    if target is None or (target[0] == "lm_head" and shape.tied):
                        continue
                    ours, part = target
                    param = params[ours]
                    tensor = f.get_tensor(name)
                    if part is None:
                        param.copy_(tensor)
                    else:
                        offsets = fused_offsets(shape, ours)
                        param[offsets[part]:offsets[part + 1]].copy_(tensor)
                    filled.add(f"{ours}#{part}")
    expected = {f"{n}#{p}" for n in params if n != "lm_head" or not shape.tied
                for p in ([None] if not (".qkv." in n or ".gate_up." in n) else
                          range(3 if ".qkv." in n else 2))}
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    return model.eval()
