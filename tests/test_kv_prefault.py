"""XLLM_KV_PREFAULT=on (model/block_pool.py BlockPool.populate): the prefix store's blocks backed with
memory at start-up, every page of those it may hold resident before any request, and then the store
works as it does taken lazily: its answers the cold ones, pages given back when the slots' caches
reach further."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from xllm_async.config import load_settings
from xllm_async.model import block_pool

from .client import post
from .conftest import ServerProcess
from .test_generation import random_prompts
from .test_kv_budget import TOTAL, runner_of
from .test_prefix_cache import run


def resident(address: int, length: int) -> list[bool]:
    """Whether each page of [address, address + length) is in memory (mincore(2))."""
    page = mmap.PAGESIZE
    low = address // page * page
    pages = (address + length - low + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert mincore(low, pages * page, vector) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vector]


def block_pages(store, blocks: range) -> list[bool]:
    """Residency of the pages under these blocks of every layer's keys and values."""
    pool = store._pool.blocks
    return [page for layer in range(pool.shape[0]) for part in range(2)
            for page in resident(pool[layer, part, blocks.start].data_ptr(), len(blocks) * store.block_bytes
                                 // (pool.shape[0] * 2))]


@pytest.mark.parametrize("way", ["madvise", "touch"])
def test_populate_backs_every_block_the_store_may_hold_and_answers_stay_cold(tiny_model_dir, monkeypatch, way):
    if way == "touch":  # (a kernel before 5.14 refuses the advice: a byte a page, touched here)
        monkeypatch.setattr(block_pool, "MADV_POPULATE_WRITE", 12345)
    lazy, eager = runner_of(tiny_model_dir), runner_of(tiny_model_dir)
    eager.prefix_store.populate()
    store = eager.prefix_store
    assert all(block_pages(store, range(store.capacity)))
    assert lazy.prefix_store._pool is None  # (taken lazily: nothing until the first store)
    prompts = random_prompts(31, [5 * 32 + 7, 3 * 32])
    cold, _ = run(eager, prompts, steps=3, cold=True)
    first, cached = run(eager, prompts, steps=3)
    again, cached_again = run(eager, prompts, steps=3)
    assert cached == [0, 0] and cached_again == [5 * 32, 2 * 32]
    assert torch.equal(first, cold) and torch.equal(again, cold)
    # An arena reaching further still takes the store's blocks back, their pages returned.
    token_bytes, budget = store.layout.token_bytes, eager._budget
    eager._arena().view(1, (TOTAL - budget.page - budget.store_slack - 4 * store.block_bytes) // token_bytes)
    assert store.capacity == 4
    assert not any(block_pages(store, range(8, store.size - 8)))


def test_the_setting_is_off_unless_asked_for():
    assert load_settings([], {}).kv_prefault == "off"
    assert load_settings(["--kv-prefault", "on"], {}).kv_prefault == "on"
    assert load_settings([], {"XLLM_KV_PREFAULT": "on"}).kv_prefault == "on"


def test_a_server_started_with_it_backs_its_store_and_serves_from_it(tiny_model_dir):
    server = ServerProcess(["--model", tiny_model_dir, "--served-model-name", "tiny"],
                           {"XLLM_KV_PREFAULT": "on", "XLLM_KV_CACHE_BYTES": "48M"})
    try:
        assert "its store backed with memory" in server.log()
        prompt = random_prompts(32, [4 * 32 + 5])[0]
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 1}
        first, second = (post(server.port, "/v1/completions", body) for _ in range(2))
        assert first[0] == second[0] == 200
        assert second[1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4 * 32}
        assert second[1]["choices"][0]["logprobs"] == first[1]["choices"][0]["logprobs"]
    finally:
        server.stop()
