"""Our Triton kernels for CUDA (model/gpu_kernels.py), run here on the CPU through Triton's
interpreter (TRITON_INTERPRET=1, in a process of its own: the switch is read when Triton loads).

The interpreter keeps the kernels' indexing, masking and arithmetic but not the GPU's bfloat16
rounding (its conversions truncate), so float32 is compared exactly (to float32 noise) and
bfloat16 only loosely; on a GPU, gpu_kernels.check() compares bfloat16 at start-up, and
perf/gpu_seed.sh runs tests/test_graphs.py there, the kernels included."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from .conftest import ROOT

pytest.importorskip("triton", reason="triton (the test extra) runs the GPU kernels' interpreter")

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.nn.functional as F
    from xllm_async.model import gpu_kernels as g

    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    eager_norm, eager_rope = g.eager_rms_norm, g.eager_rope

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
        close = dict(atol=tol, rtol=tol)
        for hidden in (64, 576):  # (576: SmolLM2's, not a power of two)
            x, attn = randn(7, hidden).to(dtype), randn(7, hidden).to(dtype)
            w = (randn(hidden).abs() + 0.5).to(dtype)
            torch.testing.assert_close(g.rms_norm(x, w, 1e-5), eager_norm(x, w, 1e-5), **close)
            total, normed = g.add_rms_norm(attn, x, w, 1e-5)
            torch.testing.assert_close(total, x + attn, **close)
            torch.testing.assert_close(normed, eager_norm(x + attn, w, 1e-5), **close)
        for heads, kv_heads, dim in ((4, 2, 64), (3, 1, 128)):
            # q and k as the model has them: views of the fused projection's output (strided rows)
            qkv = randn(6, (heads + 2 * kv_heads) * dim).to(dtype)
            q = qkv[:, :heads * dim].view(6, heads, dim)
            k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(6, kv_heads, dim)
            cos, sin = randn(6, dim), randn(6, dim)
            w = (randn(dim).abs() + 0.5).to(dtype)
            for t in (q, k):
                for weight in (None, w):
                    torch.testing.assert_close(g.rope(t, cos, sin, weight, 1e-6), eager_rope(t, cos, sin, weight, 1e-6),
                                               **close)
        gate_up = randn(5, 2 * 1536).to(dtype)  # (two column blocks, the last one short)
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(g.silu_mul(gate_up), F.silu(gate) * up, **close)
        assert g.rms_norm(torch.empty(0, 64, dtype=dtype), w[:1].expand(64), 1e-5).shape == (0, 64)

    # The tiny model with them, against its eager code: every call as the model code makes it.
    from xllm_async.model.llama import use_fused_kernels
    from xllm_async.runtime.model_runner import ModelRunner

    plain = ModelRunner(sys.argv[1], torch.device("cpu"), "float32")
    fused = ModelRunner(sys.argv[1], torch.device("cpu"), "float32")
    for runner in (plain, fused):
        for module in runner.model.modules():
            if getattr(module, "fused", None):
                module.fused = None
    use_fused_kernels(fused.model, g.OPS)
    prompts = [[(37 * i + 11 * j) % 150000 + 200 for j in range(n)] for i, n in enumerate([5, 17, 1])]
    with torch.inference_mode():
        a = plain.prefill(prompts).logits
        b = fused.prefill(prompts).logits
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert g.check(torch.device("cpu"), torch.float32)
    print("ok")
""")


def test_triton_kernels_compute_what_the_eager_code_does(tiny_model_dir):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model_dir], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]
