"""Our decode attention (csrc/decode_attention.cpp, decode_keys.h) where a row's keys are cut into
spans of kChunk (512) keys merged by their largest scores: against float32 attention for lengths
on both sides of a span's edge and every group size it takes; and a row's answer the same bits
alone or among any other rows, on one thread or two (the cut is a constant, the merge in order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xllm_async.model import cpu_kernels

pytestmark = pytest.mark.kernel("decode attention")

LENGTHS = [1, 63, 64, 65, 128, 129, 300, 511, 512, 513, 1000, 1024, 1025, 1600]
CAPACITY = 1610


def cache(rows: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """q [rows, heads] and a slab view as the cache hands it: [rows, kv_heads, CAPACITY, dim]."""
    g = torch.Generator().manual_seed(seed)
    slab = (torch.randn(2, rows, kv_heads, CAPACITY, dim, generator=g) * 2).to(dtype)
    return slab[0], slab[1]


def queries(rows: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, heads + 1, dim, generator=g) * 2).to(dtype)[:, :heads]  # (strided, as in qkv)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", range(1, 9))
# (16 and 48: heads 16 wider than a multiple of 32, their last 16 values apart)
@pytest.mark.parametrize("kv_heads,dim", [(2, 64), (1, 128), (3, 32), (1, 96), (2, 16), (1, 48), (1, 240)])
def test_rows_across_span_edges_attend_as_float32_attention(group, kv_heads, dim, dtype):
    """Every length in one call: one key, a span less one, a span, a span and one, several spans
    and a short last one; float32 within float32 summation order, bfloat16 within its rounding."""
    heads, rows = group * kv_heads, len(LENGTHS)
    keys, values = cache(rows, kv_heads, dim, dtype, seed=group + dim)
    q = queries(rows, heads, dim, dtype, seed=group)
    reads = torch.tensor(LENGTHS)
    out = cpu_kernels.decode_attention()(q, keys, values, reads, dim ** -0.5)
    assert out.shape == (rows, heads, dim) and out.dtype == dtype
    tolerance = dict(atol=3e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    qg = q.float().reshape(rows, kv_heads, group, dim)
    for row, n in enumerate(LENGTHS):
        want = F.scaled_dot_product_attention(qg[row], keys[row, :, :n].float(), values[row, :, :n].float(),
                                              scale=dim ** -0.5).reshape(heads, dim)
        torch.testing.assert_close(out[row].float(), want, **tolerance, msg=lambda m, n=n: f"{n} keys: {m}")


def test_peaked_scores_merge_without_overflow():
    """Spans whose largest scores differ by far more than float32's exp range: the merge scales each
    span by e^(its peak - the largest), so a span of tiny weights adds nothing rather than NaN."""
    dim, n = 64, 1400
    keys, values = cache(1, 1, dim, torch.float32, seed=3)
    q = queries(1, 2, dim, torch.float32, seed=4)
    keys[0, 0, 700] = q[0, 0] * 40  # one key far above the rest, in the second span
    out = cpu_kernels.decode_attention()(q, keys, values, torch.tensor([n]), 1.0)
    want = F.scaled_dot_product_attention(q[0, :, None].float(), keys[0, :, :n].expand(2, n, dim),
                                          values[0, :, :n].expand(2, n, dim), scale=1.0)[:, 0]
    assert out.isfinite().all()
    torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 0], values[0, 0, 700])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (4, 2, 16), (6, 2, 80)])
def test_a_rows_answer_is_the_same_bits_alone_or_among_any_rows_on_any_threads(threads, heads, kv_heads, dim,
                                                                               dtype):
    """Each length alone on one thread, then inside batches of 2..16 rows of other lengths, at each
    place in the batch, on one thread and on two: bit for bit the same."""
    rows = 16
    keys, values = cache(rows, kv_heads, dim, dtype, seed=7)
    q = queries(rows, heads, dim, dtype, seed=8)
    scale = dim ** -0.5
    others = torch.randint(1, CAPACITY + 1, (rows,), generator=torch.Generator().manual_seed(9))
    attend = cpu_kernels.decode_attention()
    for n in LENGTHS:
        threads(1)
        alone = {row: attend(q[row:row + 1], keys[row:row + 1], values[row:row + 1], torch.tensor([n]), scale)[0]
                 for row in range(rows)}
        for count in range(2, rows + 1):
            place = (n + count) % count  # where in the batch the row sits
            reads = others[:count].clone()
            reads[place] = n
            for t in (1, 2):
                threads(t)
                out = attend(q[:count], keys[:count], values[:count], reads, scale)
                assert torch.equal(out[place], alone[place]), (n, count, place, t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_that_share_a_prefix_read_one_copy_of_it_and_answer_the_same_bits(threads, dtype):
    """SlabCache.sharing: rows 1 and 2 read their first 1,024 keys from row 0's copy, row 4 its first
    512 from row 3's. Where the copies are equal the answers are the same bits as each row reading
    its own, on one thread or two; with the followers' own copies wiped, still the same (they read
    the source's); a source outside the rows, or more shared keys than a row holds, is refused."""
    heads, kv_heads, dim, scale = 9, 3, 64, 0.125
    keys, values = cache(5, kv_heads, dim, dtype, seed=11)
    for row, source, shared in ((1, 0, 1024), (2, 0, 1024), (4, 3, 512)):
        keys[row, :, :shared], values[row, :, :shared] = keys[source, :, :shared], values[source, :, :shared]
    q = queries(5, heads, dim, dtype, seed=12)
    reads = torch.tensor([1100, 1030, 1600, 700, 513])
    sharing = torch.tensor([[0, 0, 0, 3, 3], [0, 1024, 1024, 0, 512]])
    attend = cpu_kernels.decode_attention()
    own = attend(q, keys, values, reads, scale)
    for t in (1, 2):
        threads(t)
        assert torch.equal(attend(q, keys, values, reads, scale, sharing), own)
    for row, shared in ((1, 1024), (2, 1024), (4, 512)):
        keys[row, :, :shared], values[row, :, :shared] = 0, 0
    assert torch.equal(attend(q, keys, values, reads, scale, sharing), own)
    for bad in ([[0, 5, 0, 3, 3], [0, 1024, 1024, 0, 512]], [[0, 0, 0, 3, 3], [0, 1031, 1024, 0, 512]],
                [[0, 0, 0, 3, 4], [0, 1024, 1024, 0, 701]]):
        with pytest.raises(RuntimeError, match="sharing"):
            attend(q, keys, values, reads, scale, torch.tensor(bad))
