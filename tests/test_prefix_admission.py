"""Admission with the prefix cache (engine/budget.py, model/prefix_cache.py): a request costs the
batch only the prompt tokens its prefill computes; its cached prefix is pinned from admission to the
end of its prefill, and unpinned on every path (done, failed, aborted, shut down); requests that
keep no cache (one token, one beam round) find and keep prefixes too."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from xllm_async.config import Settings
from xllm_async.engine.budget import BatchBudget
from xllm_async.engine.params import SamplingParams
from xllm_async.engine.request import EngineRequest
from xllm_async.model.prefix_cache import BLOCK_TOKENS
from xllm_async.runtime.model_runner import ModelRunner
from xllm_async.service import Service

from .client import post
from .conftest import start_together
from .test_generation import random_prompts
from .test_prefix_cache import fresh, make_runner, store_aside
from .test_robustness import open_stream, reset

B = BLOCK_TOKENS


class CountedPrefixes:
    """Stands in for the runner's match_prefix/release_prefix: `cached` tokens of every prompt."""

    def __init__(self, cached: int) -> None:
        self.cached, self.pins = cached, 0

    def match_prefix(self, prompt):
        self.pins += 1
        return SimpleNamespace(tokens=self.cached)

    def release_prefix(self, hit) -> None:
        self.pins -= 1


def test_admission_counts_only_uncached_tokens_and_unpins_a_request_left_waiting():
    requests = [EngineRequest(i, [0] * 2000, SamplingParams(max_tokens=8), None) for i in range(8)]
    assert len(BatchBudget(64, 2100, packed=True).take(deque(requests))) == 1  # whole prompts: one fits
    prefixes = CountedPrefixes(1984)
    waiting = deque(requests)
    batch = BatchBudget(64, 2100, packed=True, prefixes=prefixes).take(waiting)
    assert len(batch) == 8  # 16 tokens each to compute
    assert prefixes.pins == 8 and all(r.prefix is not None for r in batch)
    small = BatchBudget(64, 40, packed=True, prefixes=CountedPrefixes(1984))
    waiting = deque(EngineRequest(i, [0] * 2000, SamplingParams(max_tokens=8), None) for i in range(4))
    assert len(small.take(waiting)) == 2
    assert small.prefixes.pins == 2 and waiting[0].prefix is None  # the third waits unpinned


def test_a_scored_prompt_is_admitted_whole_and_matches_nothing():
    prefixes = CountedPrefixes(1984)
    scored = EngineRequest(0, [0] * 2000, SamplingParams(max_tokens=1, prompt_logprobs=1), None)
    plain = EngineRequest(1, [0] * 2000, SamplingParams(max_tokens=1), None)
    assert BatchBudget(64, 2010, packed=True, prefixes=prefixes).take(deque([scored, plain])) == [scored]
    assert prefixes.pins == 0 and scored.prefix is None


def test_the_slab_a_hit_is_copied_into_counts_even_for_one_token_requests():
    """A one-token request keeps no cache, but its prefill copies its prefix into a slab."""
    requests = [EngineRequest(i, [0] * 100, SamplingParams(max_tokens=1), None) for i in range(4)]
    assert len(BatchBudget(64, 8192, packed=True, kv_tokens=250).take(deque(requests))) == 4
    prefixes = CountedPrefixes(96)
    assert len(BatchBudget(64, 8192, packed=True, kv_tokens=250, prefixes=prefixes).take(deque(requests))) == 2
    assert prefixes.pins == 2
    for req in requests:
        req.prefix = None
    missed = CountedPrefixes(0)  # found nothing: no slab (its blocks go from the forward into the store)
    assert len(BatchBudget(64, 8192, packed=True, kv_tokens=250, prefixes=missed).take(deque(requests))) == 4


# --- the runner: hits from admission, and the paths that keep no cache ---

@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    # (admit "all": these tests are about pins and the keeping paths, each prompt's blocks kept at once)
    return make_runner(tiny_model_dir, admit="all")


def test_a_hit_from_admission_serves_the_prefill_and_stays_pinned_until_released(runner):
    fresh(runner)
    prompt = random_prompts(31, [150])[0]
    with torch.inference_mode():
        runner.prefill([prompt], capacity=160)
        hit = runner.match_prefix(prompt + [5])
        out = runner.prefill([prompt + [5]], capacity=160, hits=[hit])
        logits = out.logits
        assert out.cached == [4 * B] and runner.prefix_store.pinned == 4  # still admission's
        runner.release_prefix(hit)
        with store_aside(runner):
            expected = runner.prefill([prompt + [5]], capacity=160).logits
    assert runner.prefix_store.pinned == 0 and torch.equal(logits, expected)


def test_one_token_prefills_find_and_keep_prefixes_bit_for_bit(runner):
    """capacity 0, into None: no cache to keep, yet a slab to copy a found prefix into."""
    fresh(runner)
    prompts = random_prompts(32, [140, 75])
    with torch.inference_mode():
        with store_aside(runner):
            expected = runner.prefill(prompts).logits
        cold = runner.prefill(prompts)
        warm = runner.prefill(prompts)
    assert cold.cached == [0, 0] and warm.cached == [4 * B, 2 * B]
    assert torch.equal(cold.logits, expected) and torch.equal(warm.logits, expected)
    assert runner.prefix_store.pinned == 0


def test_a_single_beam_round_finds_and_keeps_prefixes_bit_for_bit(runner):
    fresh(runner)
    prompts = random_prompts(33, [140, 75])
    with torch.inference_mode():
        with store_aside(runner):
            expected = runner.beam_prefill(prompts, [4, 4], 1).hidden.clone()
        first = runner.beam_prefill(prompts, [4, 4], 1).cached
        warm = runner.beam_prefill(prompts, [4, 4], 1)
    assert first == [0, 0] and warm.cached == [4 * B, 2 * B]
    assert torch.equal(warm.hidden, expected)


def test_blocks_written_by_the_forward_serve_later_prompts_bit_for_bit(runner):
    """A prefill's new blocks go from its packed rows into the store: without a slab (a miss that
    keeps no cache), and after a hit's skipped tokens, at rows that are not whole blocks apart."""
    fresh(runner)
    stored, own, other = random_prompts(34, [200, 90, 75])
    grown = stored[:100] + own  # 3 blocks of stored, then its own blocks 3 and 4
    with torch.inference_mode():
        assert runner.prefill([stored]).cache is None  # found nothing: no slab
        first = runner.prefill([other, grown])  # grown's new rows packed after other's 75
        later = [grown + [5, 6], other + [7]]
        with store_aside(runner):
            expected = runner.prefill(later).logits
        warm = runner.prefill(later)
    assert first.cached == [0, 3 * B] and warm.cached == [5 * B, 2 * B]
    assert torch.equal(warm.logits, expected) and runner.prefix_store.pinned == 0


def test_a_prefill_that_fails_keeps_none_of_its_blocks(runner, monkeypatch):
    fresh(runner)
    prompt = random_prompts(35, [100])[0]
    forward = runner._forward

    def failing(tokens, ctx, between_layers):
        forward(tokens, ctx, between_layers)  # (every layer wrote its blocks)
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(runner, "_forward", failing)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        runner.prefill([prompt])
    monkeypatch.undo()
    store = runner.prefix_store
    assert store.used == 0 and store.pinned == 0
    with torch.inference_mode():
        assert runner.prefill([prompt]).cached == [0]
        assert runner.prefill([prompt]).cached == [3 * B]


# --- every path through a real service unpins what admission pinned ---

POISON, GATE = 4242, 4243  # in a prompt: its forward raises; its prefill waits for the test's gate


class PathRunner(ModelRunner):
    def __init__(self, model_dir: str) -> None:
        super().__init__(model_dir, torch.device("cpu"))
        self.model_dir = model_dir
        self.entered, self.gate = threading.Event(), threading.Event()
        self.pinned_in_prefill: list[int] = []

    def prefill(self, prompts, capacity=0, into=None, between_layers=None, hits=None):
        self.pinned_in_prefill.append(self.prefix_store.pinned)
        if any(GATE in p for p in prompts):
            self.entered.set()
            self.gate.wait(120)
        return super().prefill(prompts, capacity, into, between_layers, hits)

    def _forward(self, tokens, ctx, between_layers):
        if POISON in tokens:
            raise RuntimeError("injected: the forward failed")
        return super()._forward(tokens, ctx, between_layers)


@pytest.fixture(scope="module")
def path_runner(tiny_model_dir):
    return PathRunner(tiny_model_dir)


async def start_service(runner, scheduler: str, **extra) -> Service:
    runner.entered.clear()
    runner.gate.clear()
    # (admit "all": these tests are about pins, each history kept on its first request)
    settings = Settings(model=runner.model_dir, port=0, scheduler=scheduler, prefix_cache="on", kv_cache_bytes=64 << 20,
                        prefix_cache_admit="all", access_log="off", **extra)
    service = Service(settings, runner=runner)
    await service.start()
    return service


def complete(port: int, prompt: list[int], max_tokens: int = 4):
    return post(port, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                          "ignore_eos": True})


SCHEDULERS = ["fixed_steps", "continuous"]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
async def test_done_and_failed_prefills_leave_no_pin(path_runner, scheduler):
    service = await start_service(path_runner, scheduler)
    store = path_runner.prefix_store
    history = random_prompts(34, [150])[0]
    try:
        assert (await asyncio.to_thread(complete, service.http.port, history))[0] == 200
        status, body, _ = await asyncio.to_thread(complete, service.http.port, history + [7])
        assert status == 200 and body["usage"]["prompt_tokens_details"] == {"cached_tokens": 4 * B}
        assert path_runner.pinned_in_prefill[-1] == 4  # pinned by admission, before the prefill
        assert store.pinned == 0
        status, body, _ = await asyncio.to_thread(complete, service.http.port, history + [POISON])
        assert "injected" in str(body) and path_runner.pinned_in_prefill[-1] == 4
        assert store.pinned == 0
        # Concurrent ones: batches, and under continuous, rows joining a running batch.
        answers = await asyncio.gather(*(asyncio.to_thread(complete, service.http.port, history + [n], 3 + n)
                                         for n in range(6)))
        assert all(status == 200 for status, _, _ in answers) and store.pinned == 0
    finally:
        path_runner.gate.set()
        await service.shutdown()


@pytest.mark.parametrize("scheduler", SCHEDULERS)
async def test_a_request_aborted_after_admission_leaves_no_pin(path_runner, scheduler):
    service = await start_service(path_runner, scheduler)
    store = path_runner.prefix_store
    history = random_prompts(35, [150])[0]
    try:
        await asyncio.to_thread(complete, service.http.port, history)
        sock = await asyncio.to_thread(open_stream, service.http.port,
                                       {"prompt": history + [GATE], "max_tokens": 20, "stream": True}, {})
        assert await asyncio.to_thread(path_runner.entered.wait, 120)  # admitted, held before its forward
        assert store.pinned == 4
        reset(sock)
        for _ in range(12000):  # until the engine has the abort: bounded, never timed
            if not service.engine.unfinished:
                break
            await asyncio.sleep(0.01)
        assert not service.engine.unfinished
        path_runner.gate.set()
        for _ in range(12000):
            if not store.pinned and service.engine.scheduler.busy_slots == 0:
                break
            await asyncio.sleep(0.01)
        assert store.pinned == 0
    finally:
        path_runner.gate.set()
        await service.shutdown()


@pytest.mark.parametrize("scheduler", SCHEDULERS)
async def test_a_shutdown_with_requests_in_prefill_and_waiting_leaves_no_pin(path_runner, scheduler):
    service = await start_service(path_runner, scheduler, drain_timeout=0.1, concurrent_execute_stream_num=1)
    store = path_runner.prefix_store
    history = random_prompts(36, [150])[0]
    await asyncio.to_thread(complete, service.http.port, history)
    held = asyncio.create_task(asyncio.to_thread(complete, service.http.port, history + [GATE], 20))
    assert await asyncio.to_thread(path_runner.entered.wait, 120)
    waiting = asyncio.create_task(asyncio.to_thread(complete, service.http.port, history + [8]))
    for _ in range(12000):
        if service.engine.scheduler.num_waiting:
            break
        await asyncio.sleep(0.01)
    assert store.pinned == 4
    stopping = asyncio.create_task(service.shutdown())
    for _ in range(12000):  # until the drain time is over and the unfinished are answered
        if not service.engine.unfinished:
            break
        await asyncio.sleep(0.01)
    path_runner.gate.set()  # the held prefill goes on, and the slot stops after it
    await stopping
    await asyncio.gather(held, waiting, return_exceptions=True)
    assert store.pinned == 0


# --- through the real server: every kind of request uses the cache and answers as cold ---

GREEDY = {"temperature": 0, "ignore_eos": True, "logprobs": 2}


def ask(server, prompt: list[int], **fields) -> dict:
    status, body, _ = post(server.port, "/v1/completions", {"prompt": prompt, **fields})
    assert status == 200, body
    return body


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_served_one_token_requests_find_their_prefix_and_answer_as_cold(cached_server, cold_server):
    prompt = random_prompts(41, [150])[0]
    cold = ask(cold_server, prompt, max_tokens=1, **GREEDY)
    first, second, third = (ask(cached_server, prompt, max_tokens=1, **GREEDY) for _ in range(3))
    assert (cached_tokens(first), cached_tokens(second), cached_tokens(third)) == (0, 0, 4 * B)  # kept on its second
    assert first["choices"] == second["choices"] == third["choices"] == cold["choices"]


def test_served_single_round_beams_find_their_prefix_and_answer_as_cold(cached_server, cold_server, request):
    if "continuous" in request.node.callspec.id:
        pytest.skip("the continuous scheduler runs no beam searches")
    history = random_prompts(42, [150])[0]
    body = {"beam_width": 4, "num_return_sequences": 4, "max_tokens": 1}
    cold = ask(cold_server, history + [9], **body)
    ask(cached_server, history, **body)
    ask(cached_server, history, **body)  # (its blocks kept on their second sight)
    grown = ask(cached_server, history + [9], **body)
    assert cached_tokens(grown) == 4 * B and grown["choices"] == cold["choices"]


def test_served_scored_prompts_compute_whole_score_as_cold_and_store_their_blocks(cached_server, cold_server):
    prompt = random_prompts(43, [150])[0]
    body = {"max_tokens": 2, "echo": True, **GREEDY}
    cold = ask(cold_server, prompt, **body)
    first, again = (ask(cached_server, prompt, **body) for _ in range(2))
    assert (cached_tokens(first), cached_tokens(again)) == (0, 0)  # every position's logits computed
    assert first["choices"] == again["choices"] == cold["choices"]
    assert cached_tokens(ask(cached_server, prompt + [5], max_tokens=2, **GREEDY)) == 4 * B  # stored by the first


@pytest.fixture(scope="module")
def item_servers(tiny_model_dir, tmp_path_factory):
    """Two servers with one item table, the prefix cache on and off."""
    from .test_beam_search import ITEMS

    table = tmp_path_factory.mktemp("items") / "items.tsv"
    table.write_text("".join(f"sku-{i}\t{' '.join(map(str, key))}\n" for i, key in enumerate(ITEMS)))
    started = start_together(*((["--model", tiny_model_dir, "--item-table", str(table)],
                                {"XLLM_PREFIX_CACHE": cache, "XLLM_KV_CACHE_BYTES": "64M"}) for cache in ("on", "off")))
    yield started
    for server in started:
        server.stop()


def test_item_table_beams_on_a_growing_cached_history_answer_as_without_the_cache(item_servers):
    """Generative recommendation: a user's next request is their history plus a few interactions."""
    on, off = item_servers
    history = random_prompts(44, [200])[0]
    body = {"beam_width": 8, "num_return_sequences": 4, "max_tokens": 3}
    for grown in (history, history + [11, 12, 13], history + [11, 12, 13, 14, 15]):
        cached, cold = ask(on, grown, **body), ask(off, grown, **body)
        assert cached["choices"] == cold["choices"]
        assert all("item_id" in choice for choice in cached["choices"])
    assert cached_tokens(cached) == (len(grown) - 1) // B * B
