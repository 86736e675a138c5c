"""Our kernel applying a structured output's token mask (model/csrc/token_bitmask.cpp) against
xgrammar's own: the same bits in every dtype, on every kind of 32-token word (all kept, all
forbidden, mixed), a vocabulary that is not a multiple of 32, and any subset of rows."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from xllm_async.execution import grammar
from xllm_async.model import cpu_kernels


def masks(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    bitmask[1] = -1  # every token kept (free text)
    bitmask[2] = 0  # every token forbidden
    bitmask[3, ::2] = 0  # words of both kinds in one row
    bitmask[3, 1::4] = -1
    return bitmask


@pytest.mark.kernel("token bitmask")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 49155, 70])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [3, 0], [5], []])
def test_our_mask_is_xgrammars_bit_for_bit(dtype, vocab, rows):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    logits[4, 7] = float("-inf")  # already forbidden stays forbidden, kept or not
    bitmask = masks(6, vocab, seed=vocab + len(rows))
    theirs, ours = logits.clone(), logits.clone()
    if rows:
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
    torch.ops.xllm.apply_token_bitmask(ours, bitmask, rows)
    assert torch.equal(theirs, ours)
    untouched = [r for r in range(6) if r not in rows]
    assert torch.equal(ours[untouched], logits[untouched])


@pytest.mark.kernel("token bitmask")
def test_the_grammar_step_masks_with_our_kernel_once_loaded(monkeypatch):
    """mask_logits takes our operator where the library loaded (xgrammar's is not called)."""
    cpu_kernels.available()
    monkeypatch.setattr(grammar.xgr, "apply_token_bitmask_inplace", lambda *a, **k: pytest.fail("xgrammar's kernel"))

    class KeepsEven:
        def fill_next_token_bitmask(self, bitmask, row):
            bitmask[row] = 0x55555555

    logits = torch.zeros(3, 64)
    assert grammar.mask_logits(logits, [None, KeepsEven(), None]) == [1]
    assert torch.equal(logits[[0, 2]], torch.zeros(2, 64))
    assert torch.isinf(logits[1, 1::2]).all() and torch.equal(logits[1, ::2], torch.zeros(32))


@pytest.mark.kernel("token bitmask")
def test_our_kernel_refuses_what_it_does_not_handle():
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.xllm.apply_token_bitmask(torch.zeros(2, 64), bitmask, [2])
    with pytest.raises(RuntimeError, match="fewer bits"):
        torch.ops.xllm.apply_token_bitmask(torch.zeros(2, 65), bitmask, [0])
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.xllm.apply_token_bitmask(torch.zeros(2, 64), bitmask.long(), [0])
