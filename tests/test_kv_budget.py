"""XLLM_KV_CACHE_BYTES shared by the slots' arenas and the prefix store (model/kv_budget.py): with
the share left unset, each slot's cache is as large as with no store, the store holds what the
arenas have not reached and gives it back (evicted, its pages returned) when they reach further,
and every answer stays the cold one."""

from __future__ import annotations

import threading

import torch

from xllm_async.model.prefix_cache import BLOCK_TOKENS, PrefixStore

from .test_generation import random_prompts
from .test_prefix_cache import make_runner, run

B = BLOCK_TOKENS
TOTAL = 32 << 20


def runner_of(model_dir: str, slots: int = 1, share: float | None = None):
    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(model_dir, torch.device("cpu"), "float32")
    runner.set_kv_cache(TOTAL, slots, share, "all")
    return runner


def test_unset_share_gives_each_slot_the_whole_budget_and_the_store_all_of_it(tiny_model_dir):
    off, adaptive, fixed = (runner_of(tiny_model_dir, 2, share) for share in (0.0, None, 0.5))
    assert off.prefix_store is None
    assert adaptive.kv_tokens == off.kv_tokens  # a batch that fits without the store fits with it
    store, budget = adaptive.prefix_store, adaptive._budget
    assert store.size == TOTAL // store.block_bytes
    # All of it but the pages held whole at the end of each layer's run of blocks (block_pool.pool_slack).
    assert store.capacity == (TOTAL - budget.store_slack) // store.block_bytes
    assert fixed.kv_tokens < off.kv_tokens  # (a fixed share is taken from the slots)


def test_an_arena_reaching_further_shrinks_the_store_and_its_blocks_are_forgotten(tiny_model_dir):
    runner = runner_of(tiny_model_dir)
    store = runner.prefix_store
    prompts = random_prompts(21, [4 * B + 3, 6 * B])
    run(runner, prompts, steps=1)  # (kept on first sight: admit all)
    assert store.used == 10
    token_bytes, budget = store.layout.token_bytes, runner._budget
    reached = runner._arena().reached
    assert store.capacity == (TOTAL - reached * token_bytes - budget.page - budget.store_slack) // store.block_bytes
    # A batch whose cache reaches all the budget but 4 blocks' worth: the store keeps at most 4.
    tokens = (TOTAL - budget.page - budget.store_slack - 4 * store.block_bytes) // token_bytes
    runner._arena().view(1, tokens)
    assert store.capacity == 4 and store.used <= 4
    assert all(block < 4 for block in store._index.values())
    expected, _ = run(runner, prompts, steps=2, cold=True)
    again, cached = run(runner, prompts, steps=2)
    assert torch.equal(again, expected)  # whatever was forgotten is computed again, the same


def test_a_block_given_back_reads_as_zeros_and_a_pinned_one_keeps_its_keys(tiny_model_dir):
    runner = runner_of(tiny_model_dir)
    store = runner.prefix_store
    prompt = random_prompts(22, [5 * B])[0]
    run(runner, [prompt], steps=1)
    pool = store._pool.blocks
    held = store.match(prompt)  # (4 blocks: at least the last token is computed)
    assert held.blocks == [0, 1, 2, 3]
    assert pool[:, :, 4].abs().sum() > 0
    store.fit(2)  # blocks 2 and 3 pinned: kept until released; block 4's pages go back now
    assert store.used == 2
    assert pool[:, :, 2:4].abs().sum() > 0
    assert pool[:, :, 4].abs().sum() == 0 or not _whole_pages(store)
    store.release(held)
    assert pool[:, :, 2:4].abs().sum() == 0 or not _whole_pages(store)
    assert store.match(prompt).blocks == [0, 1]


def _whole_pages(store: PrefixStore) -> bool:
    """Whether one block of one layer's keys fills whole pages (else give_back returns none of it)."""
    import mmap

    lay = store.layout
    return (B * lay.kv_heads * lay.head_dim * lay.dtype.itemsize) % mmap.PAGESIZE == 0


def test_slots_reaching_at_once_leave_the_store_within_what_is_left(tiny_model_dir):
    runner = runner_of(tiny_model_dir, slots=2)
    store = runner.prefix_store
    run(runner, random_prompts(23, [8 * B]), steps=1)
    views = [runner.kv_tokens // 3, runner.kv_tokens // 2]
    arenas = []  # (held: an arena is counted as long as it lives, its slot's thread)
    threads = [threading.Thread(target=lambda n=n: arenas.append(runner._arena()) or arenas[-1].view(1, n))
               for n in views]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    budget = runner._budget
    left = (TOTAL - (runner._arena().reached + sum(views)) * store.layout.token_bytes - 3 * budget.page
            - budget.store_slack)
    assert store.capacity == left // store.block_bytes  # (this thread's arena, and the two slots')


def test_a_fixed_share_never_changes(tiny_model_dir):
    runner = make_runner(tiny_model_dir, share=0.5, total=TOTAL, admit="all")
    store = runner.prefix_store
    before = store.capacity
    runner._arena().view(1, runner.kv_tokens)
    assert store.capacity == before


def test_rows_that_end_leave_their_places_to_the_last_and_every_row_keeps_its_keys():
    from xllm_async.execution.batch import fill_order
    from xllm_async.model.kv_cache import KvArena, KvLayout, SlabCache

    assert fill_order([0, 1, 3, 4, 5, 6, 7]) == [0, 1, 7, 3, 4, 5, 6]  # one row moves, into the gap
    assert fill_order([4, 5, 6, 7]) == [4, 5, 6, 7] and fill_order([1, 2, 3]) == [3, 1, 2]
    assert fill_order([0, 1]) == [0, 1] and fill_order([]) == []
    cache = SlabCache(KvArena(KvLayout(2, 2, 8, torch.float32), 8 * 40, torch.device("cpu")), 8, 40)
    lengths = [5, 40, 1, 17, 33, 2, 9, 26]
    cache.add_rows(lengths, 40)
    cache.slabs.copy_(torch.randn_like(cache.slabs))
    before = cache.slabs.clone()
    for rows in (fill_order([0, 2, 3, 6, 7]), [4, 0, 3], [2, 0]):  # (the last two: orders of any kind)
        expected = [(before[:, :, row, :, :lengths[row]], lengths[row]) for row in rows]
        cache.select(rows)
        assert cache.rows == len(rows) and cache.lengths[:len(rows)].tolist() == [n for _, n in expected]
        for place, (keys, n) in enumerate(expected):
            assert torch.equal(cache.slabs[:, :, place, :, :n], keys)
        before, lengths = cache.slabs.clone(), [n for _, n in expected]


def test_rows_with_a_prefix_in_common_read_the_first_such_rows_copy_wherever_the_rows_move():
    """SlabCache.mark / sharing: a row reads its longest marked prefix from the first row that has it;
    when rows end and others move into their places, the sources follow; a row alone shares nothing,
    nor do rows whose marks are equal but whose tokens are not."""
    from xllm_async.model.kv_cache import SHARED_SPAN, KvArena, KvLayout, SlabCache

    cache = SlabCache(KvArena(KvLayout(1, 1, 8, torch.float32), 8 * 2000, torch.device("cpu")), 8, 2000)
    cache.add_rows([1100, 600, 1500, 1200, 40], 2000)
    assert cache.sharing is None
    system, other = list(range(2 * SHARED_SPAN)), list(range(1, 2 * SHARED_SPAN + 1))
    prompts = [system + [7], system[:SHARED_SPAN] + [8], other, system + [9], [5] * 40]
    cache.mark(0, prompts, [[11, 12], [11], [21, 22], [11, 12], []])
    assert cache.sharing.tolist() == [[0, 0, 2, 0, 4], [0, SHARED_SPAN, 0, 2 * SHARED_SPAN, 0]]
    cache.select([1, 2, 3, 4])  # (row 0 ended: its followers read row 1's copy now, as far as it goes)
    assert cache.sharing.tolist() == [[0, 1, 0, 3], [0, 0, SHARED_SPAN, 0]]
    cache.add_rows([1300], 2000)  # (a row whose prompt is not marked shares nothing)
    assert cache.sharing.tolist() == [[0, 1, 0, 3, 4], [0, 0, SHARED_SPAN, 0, 0]]
    cache.select([2])
    assert cache.sharing is None
    # (keys that collide for different tokens share nothing: a prompt never reads another's keys)
    cache.add_rows([1100], 2000)
    cache.mark(1, [other + [9]], [[11, 12]])
    cache.mark(0, [system + [9]], [[11, 12]])
    assert cache.sharing is None
