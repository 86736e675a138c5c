"""Our fused CPU kernels (xllm_async/model/cpu_kernels.py) against the eager code they replace:
in bfloat16 bit for bit where no sum is involved, within a bfloat16 step where RMSNorm sums in
another order; in float32 within float32 rounding; packed attention (CPUs with AVX512-BF16)
against float32 attention of each prompt alone; and a whole model with them against itself without
them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xllm_async.model import cpu_kernels
from xllm_async.model.attention_backends import CpuKernelAttention, SdpaAttention
from xllm_async.model.layers import apply_rotary

from .conftest import require_kernel
from .test_generation import random_prompts

# On a CPU with AVX512-BF16 (or AMX) a kernel that did not build or verify fails these tests (conftest).
pytestmark = pytest.mark.kernel("elementwise")

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


@pytest.mark.kernel("float32 elementwise")
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_float32_kernels_compute_what_the_eager_float32_code_does(rows):
    """In float32 nothing is rounded: rotary and SiLU x up equal to float32 rounding (our exp is
    within 2 ulps), the norms within float32 summation order; every output float32."""
    x, residual, weight = (randn(rows, 96, seed=s).float() for s in (1, 2, 3))
    weight = weight[0]
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.ops.xllm.rms_norm(x, weight, EPS), F.rms_norm(x, (96,), weight, EPS), **close)
    total, normed = torch.ops.xllm.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(total, residual + x)
    torch.testing.assert_close(normed, F.rms_norm(residual + x, (96,), weight, EPS), **close)
    qkv = randn(rows, 8 * 16, seed=5).float()
    q = qkv[:, 32:].view(rows, 6, 16)
    angles = torch.rand(rows, 8, generator=torch.Generator().manual_seed(6)) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    head_weight = weight[:16].contiguous()
    torch.testing.assert_close(torch.ops.xllm.rope(q, cos, sin, None, 0.0),
                               apply_rotary(q, cos[:, None], sin[:, None]), **close)
    torch.testing.assert_close(torch.ops.xllm.rope(q, cos, sin, head_weight, EPS),
                               apply_rotary(F.rms_norm(q, (16,), head_weight, EPS), cos[:, None], sin[:, None]),
                               **close)
    gate_up = randn(rows, 2 * 48, seed=8).float()
    gate, up = gate_up.chunk(2, dim=-1)
    fused = torch.ops.xllm.silu_mul(gate_up)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, F.silu(gate) * up, **close)
    with pytest.raises(RuntimeError, match="dtype"):  # tensors of two dtypes are refused
        torch.ops.xllm.rms_norm(x, weight.bfloat16(), EPS)


needs_attention_kernel = pytest.mark.kernel("packed attention")


def packed_qkv(lengths: list[int], heads: int, kv_heads: int, dim: int, seed: int = 9,
               dtype: torch.dtype = torch.bfloat16):
    """q, k, v for prompts packed end to end, strided views of one fused projection as in the model."""
    qkv = randn(sum(lengths), (heads + 2 * kv_heads) * dim, seed=seed).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)


# bfloat16's probabilities are rounded before the values, as torch's own kernel does; float32's
# differ from torch's float32 kernel only by sums in another order.
TOLERANCE = {torch.bfloat16: {"atol": 3e-2, "rtol": 1e-2}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


@needs_attention_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim",
                         [(4, 2, 16), (8, 4, 32), (9, 3, 64), (16, 8, 128), (2, 2, 48), (6, 2, 80)])
def test_packed_attention_matches_each_prompt_alone_in_float32(heads, kv_heads, dim, dtype):
    lengths = [1, 15, 16, 17, 33, 130]  # around the kernels' blocks of rows (4, 8, 16, 32) and keys (16, 32, 64)
    q, k, v = packed_qkv(lengths, heads, kv_heads, dim, dtype=dtype)
    scale = dim ** -0.5
    out = torch.ops.xllm.varlen_attention(q, k, v, lengths, scale, False)
    last = torch.ops.xllm.varlen_attention(q, k, v, lengths, scale, True)
    assert out.shape == q.shape and last.shape == (len(lengths), heads, dim)
    start = 0
    for i, n in enumerate(lengths):
        qs, ks, vs = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
        assert out.dtype == dtype and torch.allclose(out[start:start + n].float(), ref, **TOLERANCE[dtype])
        assert torch.equal(last[i], out[start + n - 1])
        start += n


@needs_attention_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prompts_attention_does_not_depend_on_the_batch_around_it(dtype):
    lengths = [40, 7, 300, 64]
    q, k, v = packed_qkv(lengths, 8, 4, 32, dtype=dtype)
    together = torch.ops.xllm.varlen_attention(q, k, v, lengths, 0.2, False)
    alone = torch.ops.xllm.varlen_attention(q[47:347], k[47:347], v[47:347], [300], 0.2, False)
    assert torch.equal(together[47:347], alone)


@needs_attention_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("beams,heads,kv_heads,dim,length", [(5, 4, 2, 16, 37), (128, 8, 4, 64, 300), (3, 9, 3, 64, 1)])
def test_prompt_stage_attention_matches_float32_with_its_log_sum_exp(beams, heads, kv_heads, dim, length, dtype):
    """A beam round's prompt stage: every beam against the request's prompt keys, read in place
    from a cache slab [rows, kv_heads, capacity, dim]; the log-sum-exp is what the merge with
    the beams' own tokens needs."""
    q = randn(beams, heads + 1, dim, seed=10)[:, :heads].to(dtype)  # any beam stride
    slab = randn(3, kv_heads, length + 20, dim, seed=11).to(dtype)
    k, v = slab[1, :, :length], slab[2, :, :length]
    out, lse = torch.ops.xllm.prefix_attention(q, k, v, dim ** -0.5)
    group = heads // kv_heads
    qf = q.float().view(beams, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, beams * group, dim)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * dim ** -0.5
    ref = torch.matmul(scores.softmax(-1), v.float()).view(kv_heads, beams, group, dim).transpose(0, 1)
    ref_lse = scores.logsumexp(-1).view(kv_heads, beams, group).transpose(0, 1)
    assert out.dtype == dtype and torch.allclose(out.float(), ref.reshape(beams, heads, dim), **TOLERANCE[dtype])
    assert torch.allclose(lse, ref_lse.reshape(beams, heads), atol=1e-3, rtol=1e-4)


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_beam_rounds_take_the_prompt_stage_kernel_and_find_the_same_beams(tiny_model_dir, dtype):
    from xllm_async.runtime.model_runner import ModelRunner

    from .test_native_engine import run_beams

    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), dtype)
    runner.set_kv_cache(64 << 20, 1)
    prompts, widths, rounds = random_prompts(18, [30, 12, 50]), [4, 16, 8], [3, 3, 2]
    calls = []
    kernel = runner.attention.prefix_kernel
    assert kernel is not None  # (the tiny model's heads are 16 wide)
    runner.attention = CpuKernelAttention(runner.dtype, prefix=lambda *args: calls.append(args[0].shape[0]) or
                                          kernel(*args))
    ours = run_beams(runner, prompts, widths, rounds)
    assert calls and set(calls) <= set(widths)
    runner.attention = SdpaAttention(runner.dtype)  # torch's kernels
    theirs = run_beams(runner, prompts, widths, rounds)
    # The same beams found, in whatever order: bfloat16 sums in another order move close scores.
    same = sum(len({tuple(t) for t, _ in x} & {tuple(t) for t, _ in y}) for x, y in zip(ours, theirs))
    assert same >= (0.8 if dtype == "bfloat16" else 1) * sum(widths)


@pytest.mark.kernel("beam top-k")
@pytest.mark.parametrize("rows,columns,k", [(128, 16384, 128), (3, 4213, 128), (5, 10, 10), (7, 33, 20), (2, 100, 1)])
def test_beam_top_k_and_log_sum_exp_match_torch(rows, columns, k):
    """The k best logits of each row (ties: the lower column first) and its log-sum-exp, as
    torch.topk and torch.logsumexp give them, the row's other values never sorted."""
    logits = randn(rows, columns, seed=12) * 2
    logits[0, 1::7] = logits[0, 0]  # ties
    values, where, lse = cpu_kernels.topk_logsumexp()(logits, k)
    assert torch.equal(values, logits.float().topk(k, dim=-1).values)
    assert torch.equal(logits.float().gather(1, where), values)
    assert (torch.diff(values, dim=1) < 0).logical_or(torch.diff(where, dim=1) > 0).all()
    assert torch.allclose(lse, torch.logsumexp(logits.float(), dim=-1), atol=1e-4)


@pytest.mark.kernel("beam top-k")
@pytest.mark.parametrize("columns", [5000, 300])
def test_beam_top_k_of_equal_values_ranks_by_column(columns):
    """Rows where every value ties (every one reaches the bound: the kernel's sorting path), and
    zeros of both signs, equal as floats: the k best are the lowest columns, in order."""
    logits = torch.full((3, columns), 1.5)
    logits[1] = 0.0
    logits[1, ::2] = -0.0
    logits[2, :] = -2.0
    logits[2, columns // 2:] = 0.25  # the second half ties above the first
    values, where, lse = cpu_kernels.topk_logsumexp()(logits.bfloat16(), 128)
    assert torch.equal(where[0], torch.arange(128)) and torch.equal(where[1], torch.arange(128))
    assert torch.equal(where[2], torch.arange(columns // 2, columns // 2 + 128))
    assert torch.equal(values[2], torch.full((128,), 0.25))
    assert torch.allclose(lse, torch.logsumexp(logits, dim=-1), atol=1e-4)


@pytest.mark.kernel("beam top-k")
@pytest.mark.parametrize("columns,k", [(300, 20), (5000, 128)])
def test_beam_top_k_ranks_nan_first_as_torch_and_fills_every_slot(columns, k):
    """NaN logits (a broken forward's) rank above every number, as torch.topk (beam.py's fallback)
    ranks them, the lower column first, and make the row's log-sum-exp NaN as torch.logsumexp
    does. Every slot holds a column of the row: a row of fewer numbers than k once left slots
    unwritten, token ids read from memory no one wrote."""
    nan = float("nan")
    logits = randn(6, columns, seed=15)
    logits[0, [7, columns - 1]] = nan  # two NaNs among numbers
    logits[1] = nan  # every value NaN
    logits[2, 10:] = nan  # ten numbers, fewer than k
    logits[3, ::3] = nan  # NaNs in every vector
    logits.view(torch.int16)[4, 5] = -64  # a NaN with its sign bit set (0xffc0)
    values, where, lse = cpu_kernels.topk_logsumexp()(logits, k)
    want = logits.float().topk(k, dim=-1).values
    torch.testing.assert_close(values, want, rtol=0, atol=0, equal_nan=True)
    assert ((where >= 0) & (where < columns)).all()
    torch.testing.assert_close(logits.float().gather(1, where), values, rtol=0, atol=0, equal_nan=True)
    for row in range(6):
        nans = logits[row].float().isnan().nonzero().flatten()
        taken = min(k, len(nans))
        assert torch.equal(where[row, :taken], nans[:taken])  # the lowest NaN columns, in order
        assert torch.equal(values[row, taken:].isnan(), torch.zeros(k - taken, dtype=torch.bool))
    assert lse[:5].isnan().all()
    assert torch.allclose(lse[5], torch.logsumexp(logits[5].float(), dim=-1), atol=1e-4)


@pytest.mark.kernel("decode attention")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 4, 32), (16, 8, 128)])
def test_decode_attention_reads_each_rows_slab_as_float32_attention_does(heads, kv_heads, dim, dtype):
    """A decode step: each row's one query against the first `reads` keys of its own cache slab
    (a view of [layers, 2, rows, kv_heads, capacity, dim]), every row in one call; a row's answer
    is the same alone. In float32, within float32 summation order of torch's."""
    slab = randn(2, 6, kv_heads, 300, dim, seed=13).to(dtype)
    keys, values = slab[0], slab[1]
    reads = torch.tensor([37, 256, 1, 300, 123])
    q = randn(5, heads + 1, dim, seed=14)[:, :heads].to(dtype)
    tolerance = dict(atol=3e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    out = cpu_kernels.decode_attention()(q, keys, values, reads, dim ** -0.5)
    qg = q.float().view(5, kv_heads, heads // kv_heads, dim)
    for row, n in enumerate(reads.tolist()):
        ref = F.scaled_dot_product_attention(qg[row:row + 1], keys[row:row + 1, :, :n].float(),
                                             values[row:row + 1, :, :n].float(), scale=dim ** -0.5)
        assert out.dtype == dtype and torch.allclose(out[row].float(), ref.reshape(heads, dim), **tolerance)
        alone = cpu_kernels.decode_attention()(q[row:row + 1], keys[row:row + 1], values[row:row + 1],
                                                reads[row:row + 1], dim ** -0.5)
        assert torch.equal(alone[0], out[row])


@needs_attention_kernel
def test_packed_attention_refuses_what_it_does_not_handle():
    q, k, v = packed_qkv([5, 6], 4, 2, 32)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        torch.ops.xllm.varlen_attention(q.half(), k.half(), v.half(), [5, 6], 1.0, False)
    with pytest.raises(RuntimeError, match="q's dtype"):  # all in one dtype
        torch.ops.xllm.varlen_attention(q.float(), k, v, [5, 6], 1.0, False)
    with pytest.raises(RuntimeError, match="add up"):
        torch.ops.xllm.varlen_attention(q, k, v, [5, 5], 1.0, False)
    q24, k24, v24 = packed_qkv([5, 6], 4, 2, 24)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.xllm.varlen_attention(q24, k24, v24, [5, 6], 1.0, False)


def test_silu_of_large_activations_is_finite_as_eager():
    """exp(-x) overflows to inf for x below about -88: x / inf is -0, never NaN (a reciprocal
    refined by Newton's step made inf * 0 = NaN here once)."""
    gate_up = torch.linspace(-3000, 3000, 2 * 1000).view(20, 100).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    fused = torch.ops.xllm.silu_mul(gate_up)
    assert not fused.isnan().any()
    assert_within_a_step(fused, F.silu(gate) * up)


def test_kernels_refuse_what_they_do_not_handle():
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.xllm.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), EPS)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.xllm.rms_norm(torch.ones(2, 4).bfloat16(), torch.ones(3).bfloat16(), EPS)


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_packed_attention_fills_the_cache_that_decoding_reads(tiny_model_dir, dtype):
    """Prefill with our kernel (into a cache, and as new rows of a cache in use, as the continuous
    scheduler does), then decode: the same tokens as with torch's attention a prompt at a time."""
    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), dtype)
    first, later = random_prompts(41, [9, 70, 33]), random_prompts(42, [50, 4])

    def greedy(steps: int = 4) -> list[list[int]]:
        with torch.inference_mode():
            prefilled = runner.prefill(first, capacity=128)
            logits, cache = prefilled.logits, prefilled.cache
            tokens = [logits.argmax(-1).tolist()]
            logits = runner.decode(cache, tokens[-1])
            more = runner.prefill(later, into=cache).logits
            tokens.append(logits.argmax(-1).tolist() + more.argmax(-1).tolist())
            for _ in range(steps):
                tokens.append(runner.decode(cache, tokens[-1]).argmax(-1).tolist())
        return tokens

    calls = []
    kernel = runner.attention.varlen_kernel
    assert kernel is not None  # (the tiny model's heads are 16 wide)
    runner.attention = CpuKernelAttention(runner.dtype, varlen=lambda *args: calls.append(args[3]) or kernel(*args))
    ours = greedy()
    assert [9, 70, 33] in calls and [50, 4] in calls
    runner.attention = SdpaAttention(runner.dtype)  # torch's kernels
    theirs = greedy()
    if dtype == "float32":  # (sums in another order only)
        assert ours == theirs
    same = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    assert same >= 0.8 * sum(len(x) for x in ours)  # (bfloat16: roundings differ, a random model's ties flip)


def test_a_model_answers_the_same_with_and_without_them(tiny_model_dir):
    from xllm_async.runtime.model_runner import ModelRunner

    fused = ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    assert fused.model.fused  # bfloat16 on CPU takes them by default
    eager = ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    for module in eager.model.modules():  # the same model on the eager code
        if getattr(module, "fused", False):
            module.fused = False
    prompts = random_prompts(31, [5, 40, 17, 90])
    with torch.inference_mode():
        a = fused.prefill(prompts).logits
        b = eager.prefill(prompts).logits
    # Logits of a random model differ by the few last-bit roundings of the norms, layer after layer.
    assert torch.allclose(a, b, atol=0.1, rtol=0.05)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
    float32 = ModelRunner(tiny_model_dir, torch.device("cpu"), "float32")
    # float32 takes them where their vector paths exist, and answers as its eager code does
    assert bool(float32.model.fused) == cpu_kernels.wanted(torch.float32)
    if float32.model.fused:
        with torch.inference_mode():
            a = float32.prefill(prompts).logits
            for module in float32.model.modules():
                if getattr(module, "fused", False):
                    module.fused = False
            b = float32.prefill(prompts).logits
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_prefills_mlp_in_chunks_of_rows_answers_as_in_one(tiny_model_dir, monkeypatch, dtype, quantization):
    """A long prefill's MLP runs over chunks of rows (cpu_linear.MLP_CHUNK_BYTES; quantized weights
    QUANT_MLP_CHUNK_BYTES), each row as it would alone, the layer's residual added as each is written."""
    from xllm_async.model import cpu_linear, layers, quantized
    from xllm_async.runtime.model_runner import ModelRunner

    require_kernel("float32 elementwise" if dtype == "float32" else "elementwise")
    if quantization != "none" and not quantized.kernel_verified():
        pytest.skip("our quantized kernel does not serve on this CPU")
    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), dtype, quantization)
    assert runner.model.layers[0].mlp.fused
    prompts = random_prompts(51, [200, 250, 233, 200])  # (the tiny model takes 256 positions)
    rows = []
    fused = layers.GatedMlp.fused_forward
    monkeypatch.setattr(layers.GatedMlp, "fused_forward", lambda self, x: rows.append(x.shape[0]) or fused(self, x))

    def prefill(chunk_bytes: int) -> torch.Tensor:
        monkeypatch.setattr(cpu_linear, "MLP_CHUNK_BYTES", chunk_bytes if quantization == "none" else 1)
        monkeypatch.setattr(layers, "QUANT_MLP_CHUNK_BYTES", chunk_bytes if quantization != "none" else 1)
        rows.clear()
        with torch.inference_mode():
            return runner.prefill(prompts).logits

    chunked = prefill(1)  # chunks of the fewest rows, 256
    # (plain bfloat16 rows reach oneDNN padded, 896, where a layer keeps its copy: AMX, or no kernel of ours)
    padded = runner.model.pad_rows
    tail = 896 % 256 if padded else 883 % 256
    assert rows[:4] == [256, 256, 256, tail]  # (the first layer's; the last layer's MLP sees last tokens only)
    whole = prefill(1 << 40)  # one chunk: 883 rows are within the most a chunk takes (2,048)
    assert rows[0] > 256
    if not padded:  # (one linear kernel for every row count of a chunk)
        assert torch.equal(chunked, whole)
    else:  # (a last chunk of few rows may take our linear where the whole took oneDNN's)
        torch.testing.assert_close(chunked, whole, atol=0.05, rtol=0.02)
        assert (chunked.argmax(-1) == whole.argmax(-1)).all()


def test_without_a_compiler_the_model_runs_its_eager_code_and_says_so(tiny_model_dir, tmp_path, monkeypatch, caplog):
    from xllm_async.runtime.model_runner import ModelRunner

    monkeypatch.setattr(cpu_kernels, "_loaded", None)  # as in a fresh process
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    monkeypatch.setattr(cpu_kernels, "library_path", lambda: str(tmp_path / "cpu_kernels-none.so"))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    with caplog.at_level("WARNING", logger="xllm_async.cpu_kernels"):
        runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    assert not runner.model.fused
    assert "compiling" in cpu_kernels.load_failure() and not any(cpu_kernels.verified().values())
    assert "fused CPU kernels unavailable" in caplog.text
    with torch.inference_mode():
        logits = runner.prefill(random_prompts(3, [6, 11])).logits
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()


def test_a_kernel_that_did_not_verify_fails_its_tests_where_the_cpu_has_the_instructions(monkeypatch):
    """conftest's rule: where this CPU has AVX512-BF16 or AMX, a kernel that did not build or
    verify fails the tests that need it; only a CPU without them skips those tests."""
    monkeypatch.setattr(cpu_kernels, "verified", lambda: {"beam top-k": False})
    monkeypatch.setattr(cpu_kernels, "instruction_sets", lambda: ["avx512_bf16"])
    with pytest.raises(pytest.fail.Exception, match="beam top-k kernel did not build or verify"):
        require_kernel("beam top-k")
    monkeypatch.setattr(cpu_kernels, "instruction_sets", lambda: [])
    with pytest.raises(pytest.skip.Exception, match="no AVX512-BF16"):
        require_kernel("beam top-k")


@pytest.fixture(scope="module")
def small_qwen3_dir(tmp_path_factory) -> str:
    """Heads 32 wide: the tiny model's 16 are narrower than our decode attention takes, so its
    steps never run natively (csrc/small_step.cpp)."""
    from xllm_async.testing.random_model import build_qwen3

    return build_qwen3(str(tmp_path_factory.mktemp("models") / "small-qwen3"), "small", max_position_embeddings=256)


@pytest.fixture(scope="module")
def biased_llama_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A small Llama with a bias on every linear (q/k/v, o, gate/up, down) and no per-head norms:
    the entries a Qwen3 leaves empty; heads 32 wide, as our decode attention takes."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(2)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, initializer_range=0.5, attention_bias=True,
        mlp_bias=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    path = str(tmp_path_factory.mktemp("models") / "biased-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def narrow_llama_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A Llama whose linears end inside a 64-column block (96 wide: the one-team step
    shares such a block between its threads vector by vector) and whose key head serves 3 query
    heads, as SmolLM2's do."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
        intermediate_size=96, max_position_embeddings=256, initializer_range=0.5,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    path = str(tmp_path_factory.mktemp("models") / "narrow-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("model", ["qwen3", "biased llama", "narrow llama"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_small_step_answers_as_the_generic_forward_bit_for_bit(small_qwen3_dir, biased_llama_dir, narrow_llama_dir,
                                                                 monkeypatch, dtype, model, quantization):
    """A decode step of a few rows runs its layers as flat kernel calls: natively, in one call
    (csrc/small_step.cpp), or from Python (llama.SmallStep's loop): the same operations in the same
    order as the generic forward, so the same logits to the last bit; on plain weights packed for
    our linear and on weights kept in GGUF blocks (int8: Q8_0) for our quantized one; natively as
    one OpenMP team for the whole step or as operator calls."""
    from xllm_async.model import llama, quantized
    from xllm_async.runtime.model_runner import ModelRunner

    require_kernel("float32 elementwise" if dtype == "float32" else "elementwise")
    if quantization != "none" and not quantized.kernel_verified():
        pytest.skip("our quantized kernel does not serve on this CPU")
    folder = {"qwen3": small_qwen3_dir, "biased llama": biased_llama_dir, "narrow llama": narrow_llama_dir}[model]
    runner = ModelRunner(folder, torch.device("cpu"), dtype, quantization)
    runner.set_kv_cache(64 << 20, 1)
    small_steps = []
    run = llama.SmallStep.run
    monkeypatch.setattr(llama.SmallStep, "run", lambda self, *a: small_steps.append(1) or run(self, *a))
    prompts = random_prompts(41, [9, 30, 4])
    between = []

    def steps(way: str) -> list[torch.Tensor]:
        monkeypatch.setattr(llama, "EXACT_ROWS", 0 if way == "generic" else 16)
        monkeypatch.setattr(llama, "NATIVE_STEP", way == "native")
        out = []
        with torch.inference_mode():
            prefilled = runner.prefill(prompts, 40)
            logits, kv = prefilled.logits, prefilled.cache
            for _ in range(4):
                tokens = logits.argmax(-1).tolist()
                logits = runner.decode(kv, tokens, between_layers=lambda: between.append(way))
                out.append(logits)
        return out

    generic = steps("generic")
    assert not small_steps
    small = steps("python")
    assert len(small_steps) == 4
    assert all(torch.equal(a, b) for a, b in zip(generic, small))
    layers = runner.model.shape.layers
    assert between.count("generic") == between.count("python") == 4 * layers  # after every layer
    assert runner.model._small.native is not None  # (every linear on our kernel: the native loop can run)
    team_before = torch.ops.xllm.team_steps()
    native = steps("native")
    assert all(torch.equal(a, b) for a, b in zip(generic, native))
    assert between.count("native") == 4  # once a step, after the loop: it ran natively
    # Plain weights on a CPU without AMX: the step ran as one OpenMP team (csrc/team_step.cpp); the
    # operator calls it replaces give the same bits.
    teamed = torch.ops.xllm.team_steps() - team_before
    assert teamed == (4 if quantization == "none" and torch.ops.xllm.linear_isa() == "avx512_bf16" else 0)
    monkeypatch.setattr(llama, "TEAM_STEP", False)
    operators = steps("native")
    assert torch.ops.xllm.team_steps() - team_before == teamed
    assert all(torch.equal(a, b) for a, b in zip(generic, operators))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_of_the_team_step_answers_as_alone_in_batches_of_2_to_16(small_qwen3_dir, dtype):
    """A decode step as one OpenMP team (csrc/team_step.cpp) shares each linear between its threads
    by columns and its attention by (row, key head): a row's logits must not depend on the rows
    beside it, to the bit in float32, its tokens in bfloat16 (issue 49)."""
    from xllm_async.runtime.model_runner import ModelRunner

    require_kernel("float32 elementwise" if dtype == "float32" else "elementwise")
    runner = ModelRunner(small_qwen3_dir, torch.device("cpu"), dtype)
    runner.set_kv_cache(64 << 20, 1)
    others = random_prompts(43, [5 + (i * 7) % 31 for i in range(15)])
    prompt = random_prompts(44, [17])[0]

    def steps(batch: list[list[int]]) -> list[torch.Tensor]:  # the first row's logits, step by step
        out = []
        with torch.inference_mode():
            prefilled = runner.prefill(batch, max(map(len, batch)) + 6)
            logits, kv = prefilled.logits, prefilled.cache
            for _ in range(5):
                logits = runner.decode(kv, logits.argmax(-1).tolist())
                out.append(logits[0].clone())
        return out

    before = torch.ops.xllm.team_steps()
    alone = steps([prompt])
    for size in (2, 5, 16):
        batched = steps([prompt] + others[:size - 1])
        if dtype == "float32":
            assert all(torch.equal(a, b) for a, b in zip(alone, batched)), size
        else:
            assert [int(a.argmax()) for a in alone] == [int(b.argmax()) for b in batched], size
    if torch.ops.xllm.linear_isa() == "avx512_bf16":  # (on AMX the operator calls run it: the same rule)
        assert torch.ops.xllm.team_steps() - before == 4 * 5
