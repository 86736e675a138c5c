"""The LM head fused with a top-k pick (csrc/head_topk.cpp, issue 49) and the sampler over its
candidates (execution/top_sampling.py): the kernel gives exactly the largest of our linear's logits
in torch's stable descending order (ties by column, NaN apart as the greedy pick reports it), for
every row count of a decode step, 1-3 threads, bfloat16 and float32; sampling from the candidates
picks sample()'s very tokens and leaves the generators as it does; a served top-k batch takes the
fused path and gives the same seeded tokens as through the logits."""

from __future__ import annotations

import pytest
import torch

from xllm_async.engine.params import SamplingParams
from xllm_async.engine.request import EngineRequest
from xllm_async.execution import batch as batch_module
from xllm_async.execution import top_sampling
from xllm_async.execution.prepare import prepare
from xllm_async.execution.sampling import sample
from xllm_async.execution.top_sampling import sample_top, width_for
from xllm_async.model import cpu_kernels

pytestmark = pytest.mark.kernel("head pick")

DTYPES = [torch.bfloat16, torch.float32]
PROMPTS = [[1, 2, 3, 4, 5], [9, 8], [40, 41, 42, 43, 44, 45, 46], [7] * 12, [100, 3, 77]]


def tops(dtype: torch.dtype) -> None:
    if not cpu_kernels.head_topk(dtype):  # (bfloat16 on AMX: the linear is brgemm's, the pick is not offered)
        pytest.skip(f"no {dtype} head top-k in this build ({cpu_kernels.our_linear()})")


def check(x: torch.Tensor, packed: torch.Tensor, n: int, width: int) -> None:
    """linear_topk against the linear's logits (as the sampler sees them): the stable descending
    order's first `width` of each row's non-NaN values, its first NaN column apart."""
    logits = torch.ops.xllm.linear(x, packed, None, n).float()
    values, columns, nans = torch.ops.xllm.linear_topk(x, packed, n, width)
    nan = torch.isnan(logits)
    assert nans.tolist() == [int(r.nonzero()[0]) if r.any() else -1 for r in nan]
    for row in range(len(x)):
        real = ~nan[row]
        want_v, order = logits[row][real].sort(descending=True, stable=True)
        want_c = real.nonzero().flatten()[order]
        got = min(width, len(want_v))
        assert torch.equal(values[row, :got], want_v[:width]), f"row {row}"
        assert torch.equal(columns[row, :got], want_c[:width]), f"row {row}"
        assert (columns[row, got:] == -1).all() and (values[row, got:] == float("-inf")).all()
        if not nan[row].any():  # and torch.topk's values (its order among equals is its own)
            assert torch.equal(values[row], logits[row].topk(width).values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, k, width", [(64, 16, 1), (100, 64, 100), (4097, 576, 65), (49152, 64, 128)])
def test_the_top_is_the_linears_largest_for_every_decode_row_count(dtype, n, k, width):
    tops(dtype)
    gen = torch.Generator().manual_seed(n * 7 + k)
    packed = torch.ops.xllm.pack_linear(torch.randn(n, k, generator=gen).to(dtype))
    x = torch.randn(16, k, generator=gen).to(dtype)
    for rows in range(1, 17):
        check(x[:rows], packed, n, width)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_ties_rank_by_column_whatever_the_threads_and_lanes(dtype, threads):
    tops(dtype)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(1000, 32, generator=gen).to(dtype)
    for copy in (16, 48, 64, 200, 517, 640, 999):  # the same lane and block, other lanes, blocks, threads
        weight[copy] = weight[3]
    weight[900] = weight[700]
    weight[701] = weight[700]
    packed = torch.ops.xllm.pack_linear(weight)
    x = torch.cat([torch.randn(14, 32, generator=gen).to(dtype), torch.stack([weight[3], weight[700]])])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for width in (1, 5, 64):
            check(x, packed, 1000, width)
        zero = torch.ops.xllm.pack_linear(torch.zeros(300, 32, dtype=dtype))  # all equal: the first columns
        assert torch.ops.xllm.linear_topk(x[:3], zero, 300, 70)[1].tolist() == [list(range(70))] * 3
        # Values equal to the list's last arrive after it is full, in every thread's share: they stay out.
        coarse = torch.ops.xllm.pack_linear((torch.randn(3000, 32, generator=gen) * 2).round().to(dtype) / 4)
        check(torch.ones(4, 32, dtype=dtype), coarse, 3000, 100)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_is_reported_apart_and_minus_infinity_ranks_last(dtype):
    tops(dtype)
    weight = torch.zeros(200, 32, dtype=dtype)
    weight[:, 0] = torch.arange(200, dtype=torch.float32) / 256  # rising (exact in bfloat16)
    x = torch.ones(3, 32, dtype=dtype)
    weight[150, 1] = float("nan")
    weight[120, 1] = float("nan")
    check(x, torch.ops.xllm.pack_linear(weight), 200, 10)
    assert torch.ops.xllm.linear_topk(x, torch.ops.xllm.pack_linear(weight), 200, 1)[2].tolist() == [120] * 3
    weight[:, 1] = float("-inf")  # every logit -inf but one
    weight[160, 1] = 0
    check(x, torch.ops.xllm.pack_linear(weight), 200, 4)
    weight[:, 1] = float("nan")  # every logit NaN: an empty list
    values, columns, nans = torch.ops.xllm.linear_topk(x, torch.ops.xllm.pack_linear(weight), 200, 4)
    assert nans.tolist() == [0] * 3 and (columns == -1).all()


def candidates(logits: torch.Tensor, width: int):
    values, columns = logits.sort(dim=-1, descending=True, stable=True)
    return values[:, :width].contiguous(), columns[:, :width].contiguous(), torch.full((len(logits),), -1)


@pytest.mark.parametrize("ours", [True, False], ids=["our draws", "torch's draws"])
@pytest.mark.parametrize("vocab", [130, 1000, 49152])
def test_sampling_from_the_candidates_picks_samples_tokens_and_leaves_its_generators_so(vocab, ours, monkeypatch):
    """Bit for bit, ties included (bfloat16 logits tie often; some rows tie past every candidate and
    take the logits), for temperature, top-k, top-p and min-p together, step after step; the
    exponentials drawn by our kernel (its columns only) or by torch (the whole row)."""
    monkeypatch.setattr(top_sampling, "_exact_draws", ours and top_sampling._check_draws())
    assert top_sampling._exact_draws == ours
    whole = []
    for trial in range(24 if vocab < 49152 else 8):
        gen = torch.Generator().manual_seed(trial)
        rows = 1 + trial % 4
        logits = (torch.randn(rows, vocab, generator=gen) * (0.5, 3.0, 10.0)[trial % 3]).bfloat16().float()
        if trial % 5 == 0:
            logits[:, :200] = logits.amax(-1, keepdim=True)  # the largest, tied past the candidates
        params = [SamplingParams(temperature=(0.0, 0.7, 1.0, 1.3)[(trial + r) % 4], top_k=1 + (trial * 7 + r) % 64,
                                 top_p=(1.0, 0.9, 0.5)[(trial + r) % 3], min_p=(0.0, 0.05)[r % 2], seed=trial + r)
                  for r in range(rows)]
        ours = [None if p.greedy else torch.Generator().manual_seed(p.seed) for p in params]
        theirs = [None if p.greedy else torch.Generator().manual_seed(p.seed) for p in params]
        for _ in range(3):
            want, _ = sample(logits.clone(), params, theirs)
            got = sample_top(*candidates(logits, width_for(params, vocab)), params, ours, vocab,
                             lambda rows, logits=logits: whole.extend(rows) or logits[rows].clone())
            assert got == want
            assert all(a is None or torch.equal(a.get_state(), b.get_state()) for a, b in zip(ours, theirs))
    assert whole  # (the ties past the candidates were met)


def test_our_draws_are_torchs_and_leave_the_generator_as_it_does():
    assert top_sampling._check_draws()  # (what sample_top relies on at first use)
    ours, theirs = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    columns = torch.tensor([49151, 5, 700, 5, 0])
    drawn, zeros = torch.ops.xllm.exponential_at(ours, 49152, columns)
    assert torch.equal(drawn, torch.empty(49152).exponential_(generator=theirs)[columns]) and len(zeros) == 0
    assert torch.equal(ours.get_state(), theirs.get_state())


def test_a_zero_draw_wins_as_numpys_argmax_lets_it(monkeypatch):
    """A draw of 0 (u = 0: once in 2^53) makes sample()'s race 0/0 (NaN: the first wins) or p/0 (inf)."""
    vocab = 300
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    order = logits[0].argsort(descending=True).tolist()
    real = torch.Tensor.exponential_
    monkeypatch.setattr(top_sampling, "_exact_draws", False)  # (both sides draw through torch's, patched)
    for zero_at in ([order[200], order[0]], [order[1], order[0]], [order[3]]):
        def patched(self, *args, zero_at=zero_at, **kwargs):
            real(self, *args, **kwargs)
            self[zero_at] = 0.0
            return self
        monkeypatch.setattr(torch.Tensor, "exponential_", patched)
        params = [SamplingParams(temperature=1.0, top_k=5, seed=1)]
        want, _ = sample(logits.clone(), params, [torch.Generator().manual_seed(1)])
        got = sample_top(*candidates(logits, width_for(params, vocab)), params, [torch.Generator().manual_seed(1)],
                         vocab, lambda rows: logits[rows].clone())
        assert got == want


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


def test_a_served_top_k_batch_takes_the_fused_pick_and_the_seeded_tokens_of_the_logits(runner, monkeypatch):
    tops(runner.dtype)
    assert runner.picks_top
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),  # (greedy rows ride along)
              SamplingParams(max_tokens=20, temperature=1.2, top_k=64, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=1.0, top_k=1, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.5, top_k=8, min_p=0.1, seed=9, ignore_eos=True)]
    fused_calls = []
    real = runner.model.top
    monkeypatch.setattr(runner.model, "top",
                        lambda hidden, width: fused_calls.append(len(hidden)) or real(hidden, width))
    fused = generate(runner, params, PROMPTS)
    assert fused_calls[0] == 4 and len(fused_calls) == 19  # every step took the top-k pick
    monkeypatch.setattr(batch_module.GenerationBatch, "_top_only", lambda self: False)
    fused_calls.clear()
    assert generate(runner, params, PROMPTS) == fused and not fused_calls
    # A row with log-probabilities keeps the batch on the logits (while it runs: it outlives the others).
    params[0] = SamplingParams(max_tokens=25, temperature=0.8, top_k=40, seed=5, ignore_eos=True, logprobs=1)
    monkeypatch.undo()
    monkeypatch.setattr(runner.model, "top", lambda hidden, width: fused_calls.append(1) or real(hidden, width))
    generate(runner, params, PROMPTS)
    assert not fused_calls
