"""The LM head fused with the greedy pick (csrc/head_pick.cpp, issue 49): exactly the token that
argmax_rows picks from our linear's logits, for every row count of a decode step, in bfloat16 and
float32, on ties, NaN and -inf; and a served all-greedy batch picks the same tokens through it as
through the logits."""

from __future__ import annotations

import pytest
import torch

from xllm_async.engine.params import SamplingParams
from xllm_async.engine.request import EngineRequest
from xllm_async.execution import batch as batch_module
from xllm_async.execution.prepare import prepare
from xllm_async.execution.sampling import argmax_rows
from xllm_async.model import cpu_kernels

pytestmark = pytest.mark.kernel("head pick")

DTYPES = [torch.bfloat16, torch.float32]


def picks(dtype: torch.dtype) -> None:
    if not cpu_kernels.head_pick(dtype):  # (bfloat16 on AMX: the linear is brgemm's, the pick is not offered)
        pytest.skip(f"no {dtype} head pick in this build ({cpu_kernels.our_linear()})")


def both(x: torch.Tensor, packed: torch.Tensor, n: int) -> tuple[list[int], list[int]]:
    """(the fused pick, argmax_rows over the linear's logits as the sampler sees them)."""
    logits = torch.ops.xllm.linear(x, packed, None, n).float()
    return torch.ops.xllm.linear_argmax(x, packed, n).tolist(), argmax_rows(logits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, k", [(1, 16), (63, 16), (64, 32), (100, 64), (4097, 576), (49152, 64)])
def test_the_pick_is_the_argmax_of_the_linears_logits_for_every_decode_row_count(dtype, n, k):
    picks(dtype)
    gen = torch.Generator().manual_seed(n * 7 + k)
    packed = torch.ops.xllm.pack_linear(torch.randn(n, k, generator=gen).to(dtype))
    x = torch.randn(40, k, generator=gen).to(dtype)
    for rows in [*range(1, 17), 33, 40]:
        got, want = both(x[:rows], packed, n)
        assert got == want, f"{rows} rows"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_ties_go_to_the_first_index_whatever_the_threads_and_lanes(dtype, threads):
    picks(dtype)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(1000, 32, generator=gen).to(dtype)
    # Equal columns in the same lane and block, other lanes, other blocks and other threads' shares.
    for copy in (16, 48, 64, 200, 517, 640, 999):
        weight[copy] = weight[3]
    weight[900] = weight[700]
    weight[701] = weight[700]
    packed = torch.ops.xllm.pack_linear(weight)
    x = torch.randn(16, 32, generator=gen).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, 17):
            got, want = both(x[:rows], packed, 1000)
            assert got == want
        # Rows made to prefer the copied columns: the first copy wins.
        steered = torch.stack([weight[3], weight[700]]).to(dtype)
        got, want = both(steered, packed, 1000)
        assert got == want
        zero = torch.ops.xllm.pack_linear(torch.zeros(300, 32, dtype=dtype))
        assert torch.ops.xllm.linear_argmax(x[:5], zero, 300).tolist() == [0] * 5  # all equal: the first
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_counts_as_largest_and_minus_infinity_as_smallest_as_numpy_does(dtype):
    picks(dtype)
    weight = torch.zeros(200, 32, dtype=dtype)
    weight[:, 0] = torch.arange(200, dtype=torch.float32) / 256  # rising (exact in bfloat16): the last is largest
    x = torch.ones(3, 32, dtype=dtype)
    assert both(x, torch.ops.xllm.pack_linear(weight), 200) == ([199] * 3, [199] * 3)
    weight[150, 1] = float("nan")
    weight[120, 1] = float("nan")
    assert both(x, torch.ops.xllm.pack_linear(weight), 200) == ([120] * 3, [120] * 3)
    weight = torch.zeros(200, 32, dtype=dtype)
    weight[:, 0] = float("-inf")
    weight[160, 0] = 0  # the one finite logit
    assert both(x, torch.ops.xllm.pack_linear(weight), 200) == ([160] * 3, [160] * 3)
    weight[160, 0] = float("-inf")  # every logit -inf: numpy answers the first
    assert both(x, torch.ops.xllm.pack_linear(weight), 200) == ([0] * 3, [0] * 3)


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def runner(request, tiny_model_dir):
    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), request.param)
    runner.set_kv_cache(32 << 20, 1)
    return runner


def generate(runner, params: list[SamplingParams], prompts: list[list[int]]) -> list[list[int]]:
    requests = [EngineRequest(i, p, sp, None) for i, (p, sp) in enumerate(zip(prompts, params))]
    for req in requests:
        prepare(runner, req)
    batch = batch_module.GenerationBatch(runner, requests)
    with torch.inference_mode():
        batch.prefill()
        while len(batch):
            batch.decode()
    return [req.output_ids for req in requests]


PROMPTS = [[1, 2, 3, 4, 5], [9, 8], [40, 41, 42, 43, 44, 45, 46], [7] * 12, [100, 3, 77]]


def test_a_served_greedy_batch_picks_the_same_tokens_with_and_without_the_fused_pick(runner, monkeypatch):
    picks(runner.dtype)
    assert runner.picks_greedy
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 3, 20, 1, 7)]
    fused_calls = []
    real = runner.model.greedy
    monkeypatch.setattr(runner.model, "greedy", lambda hidden: fused_calls.append(len(hidden)) or real(hidden))
    fused = generate(runner, greedy, PROMPTS)
    # Every step took the pick (the 1-token row ends at its prefill).
    assert fused_calls[0] == 4 and len(fused_calls) == 19
    monkeypatch.setattr(batch_module.GenerationBatch, "_greedy_only", lambda self: False)
    fused_calls.clear()
    assert generate(runner, greedy, PROMPTS) == fused and not fused_calls


def test_a_row_that_needs_the_logits_keeps_the_batch_on_them(runner, monkeypatch):
    greedy = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True) for _ in PROMPTS]
    with_logprobs = [*greedy[:-1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)]
    sampled = [*greedy[:-1], SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)]
    calls = []
    monkeypatch.setattr(runner, "decode_greedy", lambda *a, **kw: calls.append(1) or [])
    for params in (with_logprobs, sampled):
        out = generate(runner, params, PROMPTS)
        assert not calls and all(len(tokens) == 6 for tokens in out)
