"""What a model folder says that both runners read the same way: the dtype to
run in, the ids that end a generation, its generation config."""

from __future__ import annotations

import torch

from .backends import preferred_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, config, device: torch.device) -> torch.dtype:
    """auto: the device's preferred dtype where it has one (on CPU the fastest the CPU has),
    elsewhere the checkpoint's own."""
    if name != "auto":
        return DTYPES[name]
    preferred = preferred_dtype(device)
    if preferred is not None:
        return preferred
    own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return DTYPES.get(str(own).removeprefix("torch."), torch.float32)


def eos_ids(tokenizer, *sources) -> frozenset[int]:
    ids: set[int] = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def generation_config(model_dir: str):
    """The folder's generation_config.json (None where it has none)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None
