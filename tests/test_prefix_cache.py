"""The prefix cache (model/prefix_cache.py): a prompt that starts with cached blocks prefills only
the rest, and every answer is the cold one: in float32 the same logits bit for bit, in bfloat16
the same tokens; through the real server, usage and metrics say what was cached."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from xllm_async.model.attention_backends import SdpaAttention
from xllm_async.model.prefix_cache import BLOCK_TOKENS, PrefixStore

from .client import post
from .hold import wait_until
from .test_generation import random_prompts
from .test_robustness import aborts, metric, open_stream, reset

B = BLOCK_TOKENS


def make_runner(model_dir: str, dtype: str = "float32", share: float = 0.5, total: int = 64 << 20,
                admit: str = "second"):
    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(model_dir, torch.device("cpu"), dtype)
    runner.set_kv_cache(total, 1, share, admit)
    return runner


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    # (admit "all": these tests are about what a hit serves; tests/test_prefix_second_sight.py, about admission)
    return make_runner(tiny_model_dir, admit="all")


@contextlib.contextmanager
def store_aside(runner, cold: bool = True):
    """Where cold, the runner's store set aside for the block (nothing looked up or kept)."""
    store = runner.prefix_store
    if cold:
        runner.prefix_store = None
    try:
        yield
    finally:
        runner.prefix_store = store


def run(runner, prompts: list[list[int]], steps: int = 4, cold: bool = False):
    """Greedy steps over the prompts as one batch: (logits of every step [steps, rows, vocab],
    each prompt's cached tokens). cold: with the store set aside."""
    with store_aside(runner, cold), torch.inference_mode():
        prefilled = runner.prefill(prompts, capacity=max(map(len, prompts)) + steps)
        logits, kv, cached = prefilled.logits, prefilled.cache, prefilled.cached
        out = [logits]
        for _ in range(steps - 1):
            logits = runner.decode(kv, logits.argmax(-1).tolist())
            out.append(logits)
    return torch.stack(out), cached


def fresh(runner, admit: str | None = None) -> None:
    """An empty store of the same size, keeping blocks as the old one did (or as `admit` says)."""
    store = runner.prefix_store
    admit = admit or ("second" if store.seen is not None else "all")
    runner.prefix_store = PrefixStore(store.layout, store.size, store.device, admit)


@pytest.mark.parametrize("length", [150, 5 * B], ids=["a-partial-last-block", "whole-blocks"])
def test_a_repeated_prompt_prefills_all_but_its_last_block_and_answers_bit_for_bit(runner, length):
    fresh(runner)
    prompt = random_prompts(1, [length])[0]
    expected, _ = run(runner, [prompt], cold=True)
    first, cached = run(runner, [prompt])
    assert cached == [0] and torch.equal(first, expected)
    again, cached = run(runner, [prompt])
    assert cached == [(length - 1) // B * B]  # at least its last token computed, for its logits
    assert torch.equal(again, expected)


def test_partial_hits_and_a_prefix_of_a_cached_prompt_answer_bit_for_bit(runner):
    fresh(runner)
    stored = random_prompts(2, [200])[0]
    run(runner, [stored])
    other = random_prompts(3, [90, 40])
    prompts = [stored[:100] + other[0],  # the first 3 blocks, then its own
               stored[:70],  # a prefix of the stored prompt: 2 blocks
               other[1],  # nothing cached
               stored[:B + 1]]  # one block and one token
    expected, _ = run(runner, prompts, cold=True)
    got, cached = run(runner, prompts)
    assert cached == [3 * B, 2 * B, 0, B]
    assert torch.equal(got, expected)


def test_rows_joining_a_running_batch_find_their_prefix_too(runner):
    """The continuous scheduler's joiners: new rows of an existing cache."""
    fresh(runner)
    prompts = random_prompts(4, [120, 70])
    run(runner, prompts)
    joiner = prompts[0][:100] + [7, 8, 9]
    with torch.inference_mode():
        kv = runner.prefill([prompts[1]], capacity=200).cache
        joined = runner.prefill([joiner], into=kv)
        with store_aside(runner):
            cold_kv = runner.prefill([prompts[1]], capacity=200).cache
            expected = runner.prefill([joiner], into=cold_kv).logits
    assert joined.cached == [3 * B] and torch.equal(joined.logits, expected)


def test_slots_share_the_store(runner):
    """A prefix stored by one slot's thread (its own arena) serves another's."""
    fresh(runner)
    prompt = random_prompts(5, [130])[0]
    found = []
    writer = threading.Thread(target=lambda: run(runner, [prompt]))
    writer.start()
    writer.join()
    reader = threading.Thread(target=lambda: found.append(run(runner, [prompt])))
    reader.start()
    reader.join()
    expected, _ = run(runner, [prompt], cold=True)
    assert found[0][1] == [4 * B] and torch.equal(found[0][0], expected)


def test_scored_prompts_compute_every_position_and_score_as_cold(runner):
    fresh(runner)
    prompts = random_prompts(6, [100, 100])
    run(runner, prompts)
    with torch.inference_mode():
        warm = runner.prefill_scored(prompts, 110, None, [2, None])
        with store_aside(runner):
            cold = runner.prefill_scored(prompts, 110, None, [2, None])
    assert warm.cached == [0, 3 * B]  # the scored one computes its every position; the other finds its blocks
    assert torch.equal(warm.logits, cold.logits)
    assert warm.scores[0].logprobs == cold.scores[0].logprobs and warm.scores[1] is None


def beam_rounds(runner, prompts: list[list[int]], cold: bool = False):
    """A beam search's hidden states (the prefill's, then two rounds of 3 beams a prompt, fed fixed
    tokens) and each prompt's cached tokens."""
    with store_aside(runner, cold), torch.inference_mode():
        prefilled = runner.beam_prefill(prompts, [3] * len(prompts), 3)
        state, cached = prefilled.state, prefilled.cached
        outs = [prefilled.hidden.clone()]
        widths = [3] * len(prompts)
        for parents in ([r for r in range(len(prompts)) for _ in range(3)],
                        [3 * r + (b + 1) % 3 for r in range(len(prompts)) for b in range(3)]):
            tokens = [1000 + 7 * i + len(outs) for i in range(len(parents))]
            outs.append(runner.beam_decode(state, tokens, parents, widths).clone())
    return torch.cat(outs), cached


def test_beam_searches_find_their_prompts_prefix_and_step_bit_for_bit(runner):
    fresh(runner)
    history = random_prompts(15, [150, 60])
    beam_rounds(runner, history)
    grown = [history[0] + [11, 12, 13], history[1][:50]]
    expected, _ = beam_rounds(runner, grown, cold=True)
    got, cached = beam_rounds(runner, grown)
    assert cached == [4 * B, B]
    assert torch.equal(got, expected)


@pytest.mark.kernel("packed attention")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cached_kernel_gives_each_query_the_sums_of_the_whole_prompts_prefill(dtype):
    from xllm_async.model import cpu_kernels

    torch.manual_seed(0)
    lengths, skips, heads, kv_heads, dim = [70, 33, 5, 100], [64, 0, 4, 32], 4, 2, 64
    q, k, v = (torch.randn(sum(lengths), n, dim, dtype=dtype) for n in (heads, kv_heads, kv_heads))
    whole = cpu_kernels.varlen_attention()(q, k, v, lengths, 0.125, False)
    slabs = torch.zeros(2, len(lengths), kv_heads, 128, dim, dtype=dtype)  # keys, values: cache rows
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for row, (start, n) in enumerate(zip(starts, lengths)):
        slabs[0, row, :, :n] = k[start:start + n].transpose(0, 1)
        slabs[1, row, :, :n] = v[start:start + n].transpose(0, 1)
    rows = torch.cat([torch.arange(start + skip, start + n) for start, n, skip in zip(starts, lengths, skips)])
    new = [n - skip for n, skip in zip(lengths, skips)]
    cached = cpu_kernels.cached_attention()
    assert torch.equal(cached(q[rows], slabs[0], slabs[1], new, lengths, 0.125, False), whole[rows])
    last = torch.tensor([start + n - 1 for start, n in zip(starts, lengths)])
    assert torch.equal(cached(q[rows], slabs[0], slabs[1], new, lengths, 0.125, True), whole[last])


def test_a_tiny_store_evicts_the_least_recently_used_and_never_a_pinned_block(runner):
    kept = runner.prefix_store
    store = runner.prefix_store = PrefixStore(runner.kv_layout, 6, torch.device("cpu"), "all")
    try:
        first, second, third = random_prompts(7, [100, 100, 100])  # 3 blocks each
        run(runner, [first])
        run(runner, [second])
        hit = store.match(first)  # pinned while "copied": first's blocks are the most recent too
        assert hit.tokens == 3 * B
        run(runner, [third])  # needs 3 blocks: only second's may go
        store.release(hit)
        for prompt, tokens in ((second, 0), (third, 3 * B)):
            found = store.match(prompt)
            store.release(found)
            assert found.tokens == tokens
        expected, _ = run(runner, [first + [5, 6]], cold=True)
        got, cached = run(runner, [first + [5, 6]])
        assert cached == [3 * B] and torch.equal(got, expected)
        for prompt in random_prompts(8, [150, 180, 90, 70]):  # more than the store holds
            run(runner, [prompt])
        whole = random_prompts(9, [6 * B + 1])[0]  # all 6 blocks: none was left pinned
        run(runner, [whole])
        assert run(runner, [whole])[1] == [6 * B]
    finally:
        runner.prefix_store = kept


def test_slots_storing_and_finding_at_once_never_see_another_prompts_keys():
    """Four threads look up, copy and store prompts that share prefixes, in a store too small for
    them all: every hit's keys are its own prompt's (here a token's keys are its id)."""
    from xllm_async.model.kv_cache import KvLayout

    store = PrefixStore(KvLayout(1, 1, 16, torch.float32), 12, torch.device("cpu"))
    roots = random_prompts(17, [3 * B, 3 * B])
    prompts = [roots[i % 2][:(1 + i % 3) * B] + random_prompts(18 + i, [B + 5])[0] for i in range(12)]
    wrong: list[str] = []

    def slot(seed: int) -> None:
        slabs = torch.zeros(1, 2, 1, 1, 8 * B, 16)
        rng = torch.Generator().manual_seed(seed)
        for _ in range(60):
            prompt = prompts[int(torch.randint(len(prompts), (1,), generator=rng))]
            slabs.zero_()
            (hit,) = store.claim([prompt], slabs, 0)
            found = slabs[0, 0, 0, 0, :hit.tokens, 0].tolist()
            if found != [float(t) for t in prompt[:hit.tokens]]:
                wrong.append(f"a hit of {hit.tokens} tokens holds another prompt's keys")
            slabs[:, :, 0, 0, :len(prompt)] = torch.tensor(prompt, dtype=torch.float32)[:, None]  # "the prefill"
            store.keep(prompt, hit, slabs, 0)
            store.release_all([hit])

    threads = [threading.Thread(target=slot, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong and store.used <= 12
    whole = random_prompts(19, [12 * B + 1])[0]  # every block free to take again: no pin was left behind
    slabs = torch.zeros(1, 2, 1, 1, 13 * B, 16)
    store.keep(whole, store.match(whole, look=False), slabs, 0)
    hit = store.match(whole)
    assert hit.tokens == 12 * B


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchs_attention_takes_a_cached_prefix_too(tiny_model_dir, dtype):
    """(bfloat16: its queries and keys padded to ATTENTION_MULTIPLE, the padding masked.)"""
    runner = make_runner(tiny_model_dir, str(dtype).removeprefix("torch."), admit="all")
    runner.attention = SdpaAttention(dtype)
    prompts = random_prompts(9, [120, 75])
    run(runner, prompts)
    extended = [prompts[0] + [3, 4, 5], prompts[1][:70]]
    expected, _ = run(runner, extended, cold=True)
    got, cached = run(runner, extended)
    assert cached == [3 * B, 2 * B]
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_bfloat16_gives_the_same_tokens(tiny_model_dir):
    runner = make_runner(tiny_model_dir, "bfloat16", admit="all")
    prompts = random_prompts(10, [140, 90])
    run(runner, prompts)
    extended = [prompts[0][:130] + [3, 4, 5, 6], prompts[1] + [9]]
    expected, _ = run(runner, extended, steps=8, cold=True)
    got, cached = run(runner, extended, steps=8)
    assert cached == [4 * B, 2 * B]
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# --- through the real server ---

def complete(cold_server, prompt: list[int], **extra) -> dict:
    status, body, _ = post(cold_server.port, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                            "ignore_eos": True, "logprobs": 2, **extra})
    assert status == 200, body
    return body


def test_served_answers_report_cached_tokens_and_equal_the_cold_ones(cached_server, cold_server):
    prompt = random_prompts(11, [150])[0]
    cold = complete(cold_server, prompt)  # a server without the cache
    assert "prompt_tokens_details" not in cold["usage"]
    queries, hits = (metric(cached_server, f"xllm:prefix_cache_{n}", f"xllm:prefix_cache_{n}_total")
                     for n in ("queries", "hits"))
    # Six tokens: its keys go into a slot's cache anyway, so kept on first sight and found on its second.
    first, second, third = (complete(cached_server, prompt) for _ in range(3))
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in (first, second, third)] == [0, 4 * B, 4 * B]
    for answer in (first, second, third):
        assert answer["choices"][0]["text"] == cold["choices"][0]["text"]
        assert answer["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    assert metric(cached_server, "xllm:prefix_cache_queries", "xllm:prefix_cache_queries_total") == queries + 450
    assert metric(cached_server, "xllm:prefix_cache_hits", "xllm:prefix_cache_hits_total") == hits + 8 * B
    # What of XLLM_KV_CACHE_BYTES the slots' caches have not reached (model/kv_budget.py).
    assert 0 < metric(cached_server, "xllm:prefix_cache_bytes") <= 64 << 20
    assert 0 < metric(cached_server, "xllm:prefix_cache_usage_ratio") < 1


def test_concurrent_requests_on_a_shared_prefix_answer_as_cold(cached_server, cold_server):
    from concurrent.futures import ThreadPoolExecutor

    system = random_prompts(12, [100])[0]
    prompts = [system + q for q in random_prompts(13, [5, 17, 33, 8, 21, 2])]
    with ThreadPoolExecutor(6) as pool:
        warm = [answer for _ in range(3) for answer in pool.map(lambda p: complete(cached_server, p), prompts)]
    for prompt, answer in zip(prompts * 3, warm):
        cold = complete(cold_server, prompt)
        assert answer["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    # By the third wave every prompt's own full blocks are stored too.
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in warm[12:]] == [
        (len(p) - 1) // B * B for p in prompts]


def test_an_aborted_requests_prompt_serves_the_next_request(cached_server, cold_server):
    prompt = random_prompts(14, [140])[0]
    aborts_before = aborts(cached_server)
    with cached_server.hold("decode"):  # its prefill (and the store) done, the decode waits
        sock = open_stream(cached_server.port, {"prompt": prompt, "max_tokens": 50, "ignore_eos": True}, headers={})
        data = b""
        while b"data: " not in data:
            data += sock.recv(65536)
        reset(sock)
        wait_until(lambda: aborts(cached_server) == aborts_before + 1, what="the abort")
    answer = complete(cached_server, prompt + [5, 6, 7])
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 4 * B}
    assert answer["choices"][0]["logprobs"] == complete(cold_server, prompt + [5, 6, 7])["choices"][0]["logprobs"]


def test_served_beam_searches_report_cached_tokens_and_equal_the_cold_ones(cached_server, cold_server, request):
    if "continuous" in request.node.callspec.id:
        pytest.skip("the continuous scheduler runs no beam searches")
    history = random_prompts(16, [200])[0]
    body = {"beam_width": 4, "num_return_sequences": 4, "max_tokens": 3}
    cold = post(cold_server.port, "/v1/completions", {"prompt": history + [9], **body})[1]
    first, second = (post(cached_server.port, "/v1/completions", {"prompt": history, **body})[1] for _ in range(2))
    grown = post(cached_server.port, "/v1/completions", {"prompt": history + [9], **body})[1]
    # Three rounds: the prompt's keys go into a slot's cache anyway, so kept on first sight.
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 6 * B}
    assert grown["usage"]["prompt_tokens_details"] == {"cached_tokens": 6 * B}
    assert grown["choices"] == cold["choices"]
