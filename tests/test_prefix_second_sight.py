"""The prefix cache keeps a block on its second sight (issue 48, model/seen_blocks.py,
XLLM_PREFIX_CACHE_ADMIT=second, the default): a prompt seen for the first time takes no block of the
store and writes nothing into it, the second time it is kept, the third time it is found, unless its
keys go into a slot's cache anyway (more tokens than one, beam rounds): then it is kept at once; a batch
whose own prompts share a prefix still computes it once; the memory of seen blocks never outgrows
its cap; every answer is the cold one, bit for bit in float32."""

from __future__ import annotations

import pytest
import torch

from xllm_async.config import load_settings
from xllm_async.model.prefix_cache import BLOCK_TOKENS, PrefixStore, chain_keys
from xllm_async.model.seen_blocks import SeenBlocks

from .test_generation import random_prompts
from .test_prefix_cache import beam_rounds, fresh, make_runner, run, store_aside

B = BLOCK_TOKENS


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return make_runner(tiny_model_dir)  # (admit "second": the default)


def test_the_default_is_second_sight_and_all_keeps_every_block(runner, tiny_model_dir):
    assert load_settings([], {}).prefix_cache_admit == "second" and runner.prefix_store.seen is not None
    assert load_settings(["--prefix-cache-admit", "all"], {}).prefix_cache_admit == "all"
    assert load_settings([], {"XLLM_PREFIX_CACHE_ADMIT": "all"}).prefix_cache_admit == "all"
    assert make_runner(tiny_model_dir, admit="all").prefix_store.seen is None


def test_seen_blocks_keep_what_was_seen_before_or_twice_in_a_batch():
    seen = SeenBlocks(100)
    assert seen.admit([[1, 2, 3]]) == set()  # first sight: nothing kept, all remembered
    assert seen.admit([[1, 2, 3, 4]]) == {1, 2, 3}
    assert seen.admit([[5, 6, 7], [5, 6, 8], [9]]) == {5, 6}  # two prompts of one batch share 5 and 6
    assert len(seen) == 9


def test_the_memory_of_seen_blocks_never_outgrows_its_cap_and_forgets_a_chain_from_its_end():
    seen = SeenBlocks(10)
    for start in range(0, 300, 3):
        seen.admit([[start, start + 1, start + 2]])
        assert len(seen) <= 10
    assert all(k in seen for k in range(291, 300))
    # The chain of 288 lost its last blocks first: its first block is remembered longest.
    assert 288 in seen and 289 not in seen and 290 not in seen
    assert seen.admit([[297, 298, 299]]) == {297, 298, 299} and len(seen) == 10


@pytest.mark.parametrize("path", ["one-token", "kept-cache", "join", "beam"])
def test_a_prompt_is_kept_on_its_second_sight_and_found_on_its_third_answering_as_cold(runner, path):
    fresh(runner)
    store = runner.prefix_store
    prompt = random_prompts(60, [150])[0]
    running = random_prompts(61, [20])[0]  # (under "join": the batch its rows join; no full block)

    def prefill(cold: bool = False):
        with store_aside(runner, cold), torch.inference_mode():
            if path == "one-token":
                out = runner.prefill([prompt])
                return out.logits, out.cached
            if path == "kept-cache":
                return run(runner, [prompt], cold=cold)
            if path == "join":
                kv = runner.prefill([running], capacity=200).cache
                out = runner.prefill([prompt], into=kv)
                return out.logits, out.cached
        return beam_rounds(runner, [prompt], cold=cold)

    expected, _ = prefill(cold=True)
    seen = []
    for _ in range(3):
        got, cached = prefill()
        seen.append((cached, store.used))
        assert torch.equal(got, expected)
    if path == "one-token":  # first sight: no block taken, nothing written; second: kept; third: found
        assert seen == [([0], 0), ([0], 4), ([4 * B], 4)]
    else:  # its keys go into a slab anyway: kept on first sight (PrefixStore.admitted's slab_anyway)
        assert seen == [([0], 4), ([4 * B], 4), ([4 * B], 4)]
    assert store.pinned == 0


def test_a_first_sight_miss_that_keeps_no_cache_takes_no_slab_and_no_store_block(runner, monkeypatch):
    fresh(runner)
    store = runner.prefix_store
    taken = []
    take = store._take
    monkeypatch.setattr(store, "_take", lambda: taken.append(1) or take())
    prompts = random_prompts(62, [200, 230, 100])
    with torch.inference_mode():
        out = runner.prefill(prompts)
    assert out.cache is None and out.cached == [0, 0, 0] and not taken and store.used == 0
    assert all(k in store.seen for p in prompts for k in chain_keys(p))


def test_a_batch_sharing_a_prefix_on_its_first_sight_computes_it_once_and_keeps_only_it(runner):
    fresh(runner)
    system = random_prompts(63, [4 * B + 3])[0]
    prompts = [system + q for q in random_prompts(64, [70, 33, 90])]
    with torch.inference_mode(), store_aside(runner):
        expected = runner.prefill(prompts).logits
    with torch.inference_mode():  # (one token each: the store's write is their only one)
        first = runner.prefill(prompts)
        assert first.cached == [0, 4 * B, 4 * B] and torch.equal(first.logits, expected)
        assert runner.prefix_store.used == 4  # the shared blocks; each prompt's own ones wait for their second sight
        second = runner.prefill(prompts)
    assert second.cached == [4 * B] * 3 and runner.prefix_store.used == 4 + 2 + 1 + 2


def test_a_store_keeps_and_evicts_within_its_blocks_and_remembers_as_many(runner):
    kept = runner.prefix_store
    store = runner.prefix_store = PrefixStore(runner.kv_layout, 6, torch.device("cpu"))
    try:
        prompts = random_prompts(65, [100, 130, 70, 160, 100])
        for prompt in prompts + prompts:
            one_token(runner, prompt)
            assert len(store.seen) <= 6
        # Seen again only after more blocks than the store holds: forgotten, never kept.
        assert store.used == 0 and store.pinned == 0
        last = prompts[-1]
        assert one_token(runner, last) == [0] and store.used == 3  # seen just before: kept
        assert one_token(runner, last) == [3 * B]
    finally:
        runner.prefix_store = kept


def one_token(runner, prompt: list[int]) -> list[int]:
    """A one-token prefill of the prompt (no cache kept: the store's write is its only one); its cached tokens."""
    with torch.inference_mode():
        return runner.prefill([prompt]).cached
