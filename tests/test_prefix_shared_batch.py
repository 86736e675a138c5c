"""A batch whose own prompts share a prefix the store lacks computes it once (issue 48): the prompts
before the first that would find it go first and store it, the rest find it (runtime/cached_prefill.py,
model/shared_prefix.py). Every answer is the cold one, bit for bit in float32."""

from __future__ import annotations

import pytest
import torch

from xllm_async.model.kv_cache import SHARED_SPAN
from xllm_async.model.prefix_cache import BLOCK_TOKENS, PrefixHit, chain_keys
from xllm_async.model.shared_prefix import MIN_SHARED_BLOCKS, shared_split

from .test_generation import random_prompts
from .test_prefix_cache import beam_rounds, fresh, make_runner, run, store_aside

B = BLOCK_TOKENS


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return make_runner(tiny_model_dir)


def misses(prompts: list[list[int]]) -> list[PrefixHit]:
    return [PrefixHit(chain_keys(p), []) for p in prompts]


def test_the_split_falls_on_the_first_prompt_that_would_find_an_earlier_ones_blocks():
    system, other, tail = random_prompts(40, [4 * B, 4 * B, 40])
    prompts = [system + tail, other + tail, system + tail[:10], other]
    assert shared_split(prompts, misses(prompts)) == 2
    # (other: its last block is its last token's, computed anyway)
    assert shared_split(prompts[:2] + [other], misses(prompts[:2] + [other])) == 2
    short = system[:(MIN_SHARED_BLOCKS - 1) * B]
    few = [short + tail, short + tail[:20]]  # too few shared blocks for another forward
    assert shared_split(few, misses(few)) == 2
    # system's blocks in the store already: prompts 0 and 2 found them, and only other's are shared
    found = [PrefixHit(chain_keys(p), [0, 1, 2, 3]) if p[:4 * B] == system else PrefixHit(chain_keys(p), [])
             for p in prompts]
    assert shared_split(prompts, found) == 3
    assert shared_split(prompts[1:2] + prompts[2:3], misses(prompts[1:3])) == 2  # nothing shared


def test_one_token_prompts_sharing_a_prefix_compute_it_once_and_answer_bit_for_bit(runner):
    fresh(runner)
    system, other = random_prompts(41, [5 * B, 3 * B])
    questions = random_prompts(42, [20, 45, 7, 30])
    prompts = [system + questions[0], other + questions[1], system + questions[2], system + questions[3],
               other + questions[0]]
    with torch.inference_mode():
        with store_aside(runner):
            expected = runner.prefill(prompts).logits
        out = runner.prefill(prompts)
    assert out.cached == [0, 0, 5 * B, 5 * B, 3 * B]
    assert torch.equal(out.logits, expected) and runner.prefix_store.pinned == 0


def test_a_batch_that_keeps_its_cache_computes_the_shared_prefix_once_and_steps_bit_for_bit(runner):
    fresh(runner)
    system = random_prompts(43, [4 * B + 3])[0]
    prompts = [system + q for q in random_prompts(44, [10, 33, 1])]
    expected, _ = run(runner, prompts, cold=True)
    got, cached = run(runner, prompts)
    assert cached == [0, 4 * B, 4 * B] and torch.equal(got, expected)


def test_rows_joining_a_running_batch_share_their_prefix_too(runner):
    fresh(runner)
    system = random_prompts(45, [3 * B])[0]
    running, a, b = random_prompts(46, [50, 20, 21])
    with torch.inference_mode():
        kv = runner.prefill([running], capacity=200).cache
        joined = runner.prefill([system + a, system + b], into=kv)
        with store_aside(runner):
            cold_kv = runner.prefill([running], capacity=200).cache
            expected = runner.prefill([system + a, system + b], into=cold_kv).logits
    assert joined.cached == [0, 3 * B] and torch.equal(joined.logits, expected)
    assert kv.rows == 3


@pytest.mark.parametrize("rounds", [1, 3])
def test_beam_prefills_share_their_prompts_prefix(runner, rounds):
    fresh(runner)
    system = random_prompts(47, [3 * B + 5])[0]
    prompts = [system + q for q in random_prompts(48, [12, 9])]
    if rounds == 1:
        with torch.inference_mode():
            with store_aside(runner):
                expected = runner.beam_prefill(prompts, [4, 4], 1).hidden.clone()
            out = runner.beam_prefill(prompts, [4, 4], 1)
        assert out.cached == [0, 3 * B] and torch.equal(out.hidden, expected)
    else:
        expected, _ = beam_rounds(runner, prompts, cold=True)
        got, cached = beam_rounds(runner, prompts)
        assert cached == [0, 3 * B] and torch.equal(got, expected)
    assert runner.prefix_store.pinned == 0


def test_scored_batches_are_not_split(runner):
    """A scored prompt computes every position: its batch prefills in one forward, as before."""
    fresh(runner)
    system = random_prompts(49, [3 * B])[0]
    prompts = [system + [5, 6], system + [7, 8]]
    with torch.inference_mode():
        warm = runner.prefill_scored(prompts, 80, None, [1, None])
        with store_aside(runner):
            cold = runner.prefill_scored(prompts, 80, None, [1, None])
    assert warm.cached == [0, 0] and torch.equal(warm.logits, cold.logits)


@pytest.fixture(scope="module")
def long_runner(tmp_path_factory):
    """The small random Qwen3 (heads 32 wide: our decode kernel takes them, the tiny model's 16 not)
    with room for prompts of a few spans."""
    from xllm_async.testing.random_model import build_qwen3

    folder = build_qwen3(str(tmp_path_factory.mktemp("models") / "small-qwen3"), "small",
                         max_position_embeddings=4 * SHARED_SPAN)
    return make_runner(folder)


@pytest.mark.kernel("decode attention")
def test_rows_that_share_a_system_prompt_read_one_copy_of_it_in_decode_steps_bit_for_bit(long_runner):
    """Rows whose prompts begin with the same SHARED_SPAN multiples read that prefix's keys from the
    first such row's slab (SlabCache.sharing, the decode kernel's and the native step's): the same
    logits at every step as the cold batch, where each row reads its own."""
    runner = long_runner
    S = SHARED_SPAN
    system, other = random_prompts(50, [2 * S + 7, S + 3])
    prompts = [system + q for q in random_prompts(51, [10, 33])] + [other, system[:S] + [9, 9, 9]]
    expected, _ = run(runner, prompts, steps=5, cold=True)
    with torch.inference_mode():
        prefilled = runner.prefill(prompts, capacity=max(map(len, prompts)) + 5)
        kv, logits = prefilled.cache, prefilled.logits
        assert kv.sharing.tolist() == [[0, 0, 2, 0], [0, 2 * S, 0, S]]
        steps = [logits]
        for _ in range(4):
            logits = runner.decode(kv, logits.argmax(-1).tolist())
            steps.append(logits)
    assert torch.equal(torch.stack(steps), expected)
