"""The packed attention operators split a batch with few sequences into pieces of queries
(csrc/attention_rows.h, query_pieces), so that every thread has work when one long prompt's few
key heads are all there is. A query's sums must not depend on the piece it fell in, nor on the
threads: with one thread nothing is split, and the outputs must be the same bit for bit."""

from __future__ import annotations

import pytest
import torch

from .test_cpu_kernels import packed_qkv, randn

pytestmark = pytest.mark.kernel("packed attention")


def with_threads(count: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths,heads,kv_heads", [([700], 9, 3), ([520, 9], 8, 2), ([333], 4, 4), ([65, 700], 6, 1)])
def test_a_long_prompts_pieces_give_what_one_thread_gives(lengths, heads, kv_heads, dtype):
    q, k, v = packed_qkv(lengths, heads, kv_heads, 64, dtype=dtype)
    run = lambda: torch.ops.xllm.varlen_attention(q, k, v, lengths, 0.125, False)  # noqa: E731
    whole = with_threads(1, run)
    for threads in (2, 3):
        assert torch.equal(with_threads(threads, run), whole)
    last = with_threads(2, lambda: torch.ops.xllm.varlen_attention(q, k, v, lengths, 0.125, True))
    ends = torch.tensor(lengths).cumsum(0) - 1
    assert torch.equal(last, whole[ends])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_lengths,kv_lengths", [([64], [1088]), ([640], [700]), ([64, 3, 64], [1088, 40, 100])])
def test_pieces_after_a_cached_prefix_give_what_one_thread_gives(q_lengths, kv_lengths, dtype):
    heads, kv_heads, dim, capacity = 9, 3, 64, max(kv_lengths) + 5
    keys = randn(len(q_lengths), kv_heads, capacity, dim, seed=3).to(dtype)
    values = randn(len(q_lengths), kv_heads, capacity, dim, seed=4).to(dtype)
    q = randn(sum(q_lengths), heads, dim, seed=5).to(dtype)
    run = lambda: torch.ops.xllm.varlen_attention_cached(q, keys, values, q_lengths, kv_lengths, 0.125, False)  # noqa: E731
    whole = with_threads(1, run)
    for threads in (2, 3):
        assert torch.equal(with_threads(threads, run), whole)
    # and each prompt's queries as varlen_attention gives the same tokens of the whole prompt
    for row, (n, seen) in enumerate(zip(q_lengths, kv_lengths)):
        start = sum(q_lengths[:row])
        k = keys[row, :, :seen].transpose(0, 1).contiguous()
        v = values[row, :, :seen].transpose(0, 1).contiguous()
        full_q = torch.cat([randn(seen - n, heads, dim, seed=6).to(dtype), q[start:start + n]])
        full = with_threads(2, lambda q=full_q, k=k, v=v, n=seen: torch.ops.xllm.varlen_attention(q, k, v, [n], 0.125,
                                                                                                  False))
        assert torch.equal(whole[start:start + n], full[seen - n:])
