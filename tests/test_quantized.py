"""The quantized weight format (model/quantized.py) against gguf's own quantizer and de-quantizer."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

from xllm_async.model.quantized import FORMATS, QuantWeight  # noqa: E402


@pytest.mark.parametrize("kind", FORMATS)
def test_blocks_read_and_made_as_gguf_does(kind):
    torch.manual_seed(0)
    weight = torch.randn(48, 96)
    kind_type = getattr(gguf.GGMLQuantizationType, kind.upper())
    raw = quantize(weight.numpy(), kind_type)
    read = QuantWeight.from_gguf(kind, raw, 96)
    assert read.nbytes == raw.nbytes
    assert np.array_equal(read.dequantize().numpy(), dequantize(raw, kind_type))
    made = QuantWeight.quantize(weight, kind)
    assert torch.equal(made.dequantize(), read.dequantize())
    assert (made.dequantize() - weight).abs().max() < {"q8_0": 0.03, "q4_0": 0.6, "q4_1": 0.4}[kind]


def test_rows_stack_and_reference_linear():
    torch.manual_seed(1)
    parts = [QuantWeight.quantize(torch.randn(rows, 64), "q4_1") for rows in (32, 16, 16)]
    fused = QuantWeight.stack(parts)
    assert fused.out_features == 64 and torch.equal(fused.rows(slice(32, 48)).dequantize(), parts[1].dequantize())
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    expected = x.float() @ fused.dequantize().T
    assert torch.allclose(fused.reference_linear(x).float(), expected, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError):
        QuantWeight.stack([parts[0], QuantWeight.quantize(torch.randn(8, 64), "q8_0")])
