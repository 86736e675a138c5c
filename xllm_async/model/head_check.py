"""The start-up check of our LM head's fused picks (csrc/head_pick.cpp, head_topk.cpp): which dtypes
model/cpu_kernels.py offers them in, each checked here against our linear's own logits."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("xllm_async.cpu_kernels")


def working_head_picks(linear_isa: str | None, float32_linear: bool) -> frozenset:
    """The dtypes our LM head's greedy pick (csrc/head_pick.cpp) takes here, each checked against the
    argmax of our linear's logits (a tie included): bfloat16 where the linear is AVX512-BF16's (on
    AMX its sums are brgemm's, which the pick does not reproduce), float32 where that linear works;
    and (dtype, "top") for those where the top-k pick (csrc/head_topk.cpp) gives the same logits'
    largest, in their stable descending order."""
    if not hasattr(torch.ops.xllm, "linear_argmax"):
        return frozenset()
    picks = set()
    gen = torch.Generator().manual_seed(0)
    for dtype, linear_works in ((torch.bfloat16, linear_isa == "avx512_bf16"), (torch.float32, float32_linear)):
        if not linear_works:
            continue
        weight = torch.randn(130, 32, generator=gen).to(dtype)
        weight[129] = weight[5]  # (rows 5 and 129 tie: the first wins)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        packed = torch.ops.xllm.pack_linear(weight)
        try:
            picked = torch.ops.xllm.linear_argmax(x, packed, 130)
        except RuntimeError as exc:
            log.warning("our LM head pick unusable here in %s: %s", dtype, exc)
            continue
        logits = torch.ops.xllm.linear(x, packed, None, 130).float()
        if torch.equal(picked, logits.argmax(-1)):
            picks.add(dtype)
            # The top-k pick (head_topk.cpp): the stable descending order of the same logits, ties by column.
            values, columns = logits.sort(dim=-1, descending=True, stable=True)
            if not hasattr(torch.ops.xllm, "linear_topk"):
                continue
            try:
                got = torch.ops.xllm.linear_topk(x, packed, 130, 70)
            except RuntimeError as exc:
                log.warning("our LM head top-k unusable here in %s: %s", dtype, exc)
                continue
            if torch.equal(got[0], values[:, :70]) and torch.equal(got[1], columns[:, :70]):
                picks.add((dtype, "top"))
        else:
            log.warning("our LM head pick computed wrong here in %s: greedy steps take the logits", dtype)
    return frozenset(picks)
