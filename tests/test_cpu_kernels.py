"""Our fused bfloat16 CPU kernels (xllm_async/model/cpu_kernels.py) against the eager code they
replace: bit for bit where no sum is involved, within a bfloat16 step where RMSNorm sums in
another order; and a whole bfloat16 model with them against itself without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xllm_async.model import cpu_kernels
from xllm_async.model.layers import apply_rotary

from .test_generation import random_prompts

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the fused CPU kernels could not be built here")

EPS = 1e-6


def eager_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), weight.shape, None, EPS).to(x.dtype)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).bfloat16()


def assert_within_a_step(fused: torch.Tensor, eager: torch.Tensor) -> None:
    """Equal but for a few values one bfloat16 step apart (a sum in another order)."""
    step = eager.float().abs().clamp_min(1e-3) * 2 ** -7
    assert ((fused.float() - eager.float()).abs() <= step).all()
    assert (fused != eager).float().mean() < 0.01


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_add_norm_match_the_eager_code(rows):
    x, residual, weight = randn(rows, 96, seed=1), randn(rows, 96, seed=2), randn(96, seed=3)
    assert_within_a_step(torch.ops.xllm.rms_norm(x, weight, EPS), eager_norm(x, weight))
    total, normed = torch.ops.xllm.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(total, residual + x)
    assert_within_a_step(normed, eager_norm(residual + x, weight))
    heads = randn(rows, 160, seed=4)[:, 32:].view(rows, 4, 32)  # a strided view, as q in the fused qkv
    assert_within_a_step(torch.ops.xllm.rms_norm(heads, weight[:32].contiguous(), EPS),
                         eager_norm(heads, weight[:32]))


@pytest.mark.parametrize("rows", [1, 5, 257])
def test_rotary_and_silu_match_the_eager_code_bit_for_bit(rows):
    qkv = randn(rows, 8 * 16, seed=5)
    q = qkv[:, 32:].view(rows, 6, 16)  # strided: a view of the fused projection
    angles = torch.rand(rows, 8, generator=torch.Generator().manual_seed(6)) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    eager = apply_rotary(q, cos.bfloat16()[:, None], sin.bfloat16()[:, None])
    assert torch.equal(torch.ops.xllm.rope(q, cos, sin, None, 0.0), eager)
    weight = randn(16, seed=7)
    with_norm = apply_rotary(eager_norm(q, weight), cos.bfloat16()[:, None], sin.bfloat16()[:, None])
    assert_within_a_step(torch.ops.xllm.rope(q, cos, sin, weight, EPS), with_norm)
    gate_up = randn(rows, 2 * 48, seed=8)
    gate, up = gate_up.chunk(2, dim=-1)
    fused, eager = torch.ops.xllm.silu_mul(gate_up), F.silu(gate) * up
    assert_within_a_step(fused, eager)  # (exp is ours: equal but for rare last-bit roundings)


def test_kernels_refuse_what_they_do_not_handle():
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.xllm.rms_norm(torch.ones(2, 4), torch.ones(4), EPS)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.xllm.rms_norm(torch.ones(2, 4).bfloat16(), torch.ones(3).bfloat16(), EPS)


def test_a_bfloat16_model_answers_the_same_with_and_without_them(tiny_model_dir):
    from xllm_async.runtime.model_runner import ModelRunner

    fused = ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    assert fused.model.fused  # bfloat16 on CPU takes them by default
    eager = ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    for module in eager.model.modules():  # the same model on the eager code
        if getattr(module, "fused", False):
            module.fused = False
    prompts = random_prompts(31, [5, 40, 17, 90])
    with torch.inference_mode():
        a, _ = fused.prefill(prompts)
        b, _ = eager.prefill(prompts)
    # Logits of a random model differ by the few last-bit roundings of the norms, layer after layer.
    assert torch.allclose(a, b, atol=0.1, rtol=0.05)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
    float32 = ModelRunner(tiny_model_dir, torch.device("cpu"), "float32")
    assert not float32.model.fused  # float32 keeps the eager code (compared with transformers)


def test_without_a_compiler_the_model_runs_its_eager_code_and_says_so(tiny_model_dir, tmp_path, monkeypatch, caplog):
    from xllm_async.runtime.model_runner import ModelRunner

    monkeypatch.setattr(cpu_kernels, "_loaded", None)  # as in a fresh process
    monkeypatch.setattr(cpu_kernels, "library_path", lambda: str(tmp_path / "cpu_kernels-none.so"))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    with caplog.at_level("WARNING", logger="xllm_async.cpu_kernels"):
        runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    assert not runner.model.fused
    assert "fused CPU kernels unavailable" in caplog.text
    with torch.inference_mode():
        logits, _ = runner.prefill(random_prompts(3, [6, 11]))
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()
