"""Our quantized linear (csrc/quant_linear.cpp, through QuantWeight.linear) against the reference
arithmetic (model/quantized.py): tightly against a reference that rounds the activations to int8
blocks as the kernel does, loosely against the plain float one. On a CPU with AMX a prompt's bfloat16
rows take bfloat16 tiles over the widened blocks instead: bit for bit our bfloat16 linear on the
de-quantized weights."""

import pytest
import torch

from xllm_async.model import cpu_features, cpu_kernels, quantized
from xllm_async.model.quantized import BLOCK, FORMATS, QuantWeight


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """Where this CPU has the instructions (AVX512-BF16, with VNNI), a kernel that did not build or
    verify is a failure, not a skip."""
    if quantized.kernel_verified():
        return
    if cpu_kernels.instruction_sets() and "avx512_vnni" in cpu_features.cpu_flags():
        pytest.fail(f"our quantized linear did not build or verify here: {cpu_kernels.load_failure()}")
    pytest.skip("no AVX512-BF16 and VNNI here: QuantWeight.linear runs the reference")


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x's rows as the kernel sees them: each 32-block rounded to int8 against its largest magnitude."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros(()))
    return ((blocks * inv).round() * (amax / 127)).reshape(x.shape).double()


def expected(weight: QuantWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = rounded_activations(x) @ weight.dequantize(torch.float64).T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_quantized_linear_matches_the_reference(kind, rows, dtype, with_bias):
    torch.manual_seed(rows)
    out_features, in_features = 83, 192  # not a whole tile (16 columns), nor a group of them
    weight = QuantWeight.quantize(torch.randn(out_features, in_features) * 0.1, kind)
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(rows, in_features).to(dtype)
    out = weight.linear(x, bias)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    if dtype == torch.bfloat16 and torch.ops.xllm.quant_linear_widens(rows):
        exact = torch.ops.xllm.linear(x, torch.ops.xllm.pack_linear(weight.dequantize(dtype)), bias, out_features)
        assert torch.equal(out, exact)
        return
    exact = expected(weight, x, bias)
    # float32 sums of exact integer block products; bfloat16 output: its rounding on top
    tight = 2e-5 if dtype == torch.float32 else 8e-3
    assert torch.allclose(out.double(), exact, rtol=tight, atol=tight * exact.abs().max().item())
    plain = weight.reference_linear(x, bias).double()
    assert torch.allclose(out.double(), plain, rtol=0.05, atol=0.05 * plain.abs().max().item())


@pytest.mark.parametrize("kind", FORMATS)
def test_a_prompts_rows_on_amx_are_our_bfloat16_linear_on_the_dequantized_weight(kind):
    """Widened a chunk of groups at a time (1 MiB of bfloat16: a layer of 1,536 inputs widens 5 of its
    12 groups a chunk) and shared out by columns or, for more rows than columns, by rows."""
    if not torch.ops.xllm.quant_linear_widens(64):
        pytest.skip("no AMX here: every row takes the VNNI loop")
    torch.manual_seed(11)
    for rows, out_features, in_features in ((24, 70, 96), (64, 760, 1536), (333, 100, 64)):
        weight = QuantWeight.quantize(torch.randn(out_features, in_features), kind)
        bias = torch.randn(out_features)
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        plain = torch.ops.xllm.pack_linear(weight.dequantize(torch.bfloat16))
        assert torch.equal(weight.linear(x, bias), torch.ops.xllm.linear(x, plain, bias, out_features))
        tail = torch.ops.xllm.linear(x, plain, None, out_features)[:, 64:]
        assert torch.equal(weight.columns(64, out_features).linear(x), tail)


def test_rows_of_any_leading_shape_and_a_wide_layer():
    torch.manual_seed(7)
    weight = QuantWeight.quantize(torch.randn(1000, 64), "q4_1")
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    out = weight.linear(x)
    assert out.shape == (2, 3, 1000)
    assert torch.allclose(out.double(), expected(weight, x.reshape(6, 64), None).view(2, 3, 1000),
                          rtol=8e-3, atol=8e-3 * out.abs().max().item())


def test_zero_blocks_and_zero_rows():
    weight = QuantWeight.quantize(torch.randn(20, 64), "q8_0")
    x = torch.zeros(2, 64)
    x[1, 32:] = 1.0  # one block of zeros, one of ones
    assert torch.equal(weight.linear(x)[0], torch.zeros(20))
    assert torch.allclose(weight.linear(x)[1], weight.reference_linear(x)[1], rtol=1e-5, atol=1e-5)
    assert weight.linear(torch.zeros(0, 64)).shape == (0, 20)


def test_packed_blocks_keep_the_files_bytes():
    for kind in FORMATS:
        weight = QuantWeight.quantize(torch.randn(128, 96), kind)  # two whole groups of tiles: no padding
        assert weight.packed.numel() == weight.nbytes


def test_fused_parts_pack_on_their_own():
    torch.manual_seed(3)
    parts = [QuantWeight.quantize(torch.randn(rows, 64), "q4_0") for rows in (40, 24)]
    fused = QuantWeight.stack(parts)
    x = torch.randn(4, 64)
    assert torch.allclose(fused.linear(x)[:, 40:], parts[1].linear(x), rtol=1e-6, atol=1e-6)


def test_a_bias_or_rows_of_another_length_are_refused():
    weight = QuantWeight.quantize(torch.randn(20, 64), "q4_1")
    with pytest.raises(RuntimeError, match="bias"):
        weight.linear(torch.randn(2, 64), torch.randn(19))
    with pytest.raises(RuntimeError, match="another shape"):
        weight.linear(torch.randn(2, 128))
    with pytest.raises(ValueError, match="inputs"):
        weight.linear(torch.randn(1, 2, 128))


def test_without_a_verified_kernel_linear_is_the_reference(monkeypatch):
    monkeypatch.setattr(quantized, "_kernel_ok", False)
    weight = QuantWeight.quantize(torch.randn(20, 64), "q4_0")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(weight.linear(x), weight.reference_linear(x))


def test_columns_view_the_packed_blocks_and_settle_drops_the_file_layout():
    torch.manual_seed(3)
    weight = QuantWeight.quantize(torch.randn(200, 64), "q4_1")
    x = torch.randn(3, 64)
    whole = weight.linear(x)
    part = weight.columns(64, 190)
    assert part.packed.data_ptr() == weight.packed[1:].data_ptr()  # a view: nothing packed again
    assert torch.equal(part.linear(x), whole[:, 64:190])
    assert torch.equal(weight.columns(10, 70).linear(x), whole[:, 10:70])  # unaligned: its own rows
    weight.settle()
    assert weight.quants is None and torch.equal(weight.linear(x), whole)
    assert torch.equal(weight.columns(128, 200).linear(x), whole[:, 128:])
    with pytest.raises(ValueError, match="settle"):
        weight.rows(slice(0, 8))
