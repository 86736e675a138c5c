"""Our own model code (xllm_async/model) against transformers, in float32:
packed prompts of mixed lengths, the cache written in place, rows joining and
leaving, and beams that share their prompt's cache against beams that copy it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xllm_async.engine.budget import BatchBudget
from xllm_async.engine.params import SamplingParams
from xllm_async.engine.request import BeamRequest, EngineRequest
from xllm_async.execution.beam import BeamSearchBatch
from xllm_async.model.llama import ModelShape

from .conftest import require_kernel
from .test_generation import random_prompts


@pytest.fixture(scope="module")
def native(tiny_model_dir):
    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "float32")
    runner.set_kv_cache(64 << 20, 1)
    return runner


@pytest.fixture(scope="module")
def copied(tiny_model_dir):
    from xllm_async.runtime.hf_runner import TransformersRunner

    return TransformersRunner(tiny_model_dir, torch.device("cpu"), "float32")


def reference_logits(reference, sequence: list[int]) -> torch.Tensor:
    return reference.model(torch.tensor([sequence])).logits[0, -1].float()


def test_packed_prefill_and_decode_equal_transformers_on_mixed_lengths(native, reference):
    prompts = random_prompts(11, [3, 40, 1, 17, 17, 17, 64])
    with torch.inference_mode():
        prefilled = native.prefill(prompts, capacity=80)
        logits, kv = prefilled.logits, prefilled.cache
        sequences = [list(p) for p in prompts]
        for step in range(3):
            for row, seq in enumerate(sequences):
                torch.testing.assert_close(logits[row], reference_logits(reference, seq), atol=2e-4, rtol=2e-4)
            tokens = logits.argmax(-1).tolist()
            sequences = [s + [t] for s, t in zip(sequences, tokens)]
            logits = native.decode(kv, tokens)
        # Rows leave (the last live row moves into the hole) and the rest step on exactly.
        keep = [4, 0, 6]
        kv.select(keep)
        sequences = [sequences[r] for r in keep]
        tokens = [logits[r].argmax().item() for r in keep]
        sequences = [s + [t] for s, t in zip(sequences, tokens)]
        logits = native.decode(kv, tokens)
        for row, seq in enumerate(sequences):
            torch.testing.assert_close(logits[row], reference_logits(reference, seq), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("engine", ["native", "copied"])
def test_prompt_scores_are_the_models_log_probabilities_of_each_next_token(engine, native, copied, reference):
    runner = {"native": native, "copied": copied}[engine]
    prompts = random_prompts(12, [5, 40, 1, 17, 2])
    scored = [3, None, 0, 0, 20]  # scored and plain rows mixed, a one-token prompt among them
    with torch.inference_mode():
        plain = runner.prefill(prompts, capacity=60).logits
        prefilled = runner.prefill_scored(prompts, 60, None, scored)
        logits, kv, scores = prefilled.logits, prefilled.cache, prefilled.scores
        torch.testing.assert_close(logits, plain, atol=2e-4, rtol=2e-4)  # the next token's logits as ever
        assert kv is not None and scores[1] is None
        for prompt, top, score in zip(prompts, scored, scores):
            if top is None:
                continue
            expected = torch.log_softmax(reference.model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
            assert len(score.logprobs) == len(score.ranks) == len(score.top) == len(prompt) - 1
            for position, token in enumerate(prompt[1:]):
                row = expected[position]
                assert abs(score.logprobs[position] - float(row[token])) < 2e-4
                # (random weights: many values lie within rounding of the token's; the rank may fall among them)
                above, near = int((row > row[token] + 1e-4).sum()), int((row > row[token] - 1e-4).sum())
                assert above < score.ranks[position] <= near + 1
                assert [v for _, v in score.top[position]] == pytest.approx(row.topk(top).values.tolist(), abs=2e-4)
        # The cache holds the prompts as prefill's does: decoding from it gives the same logits.
        tokens = logits.argmax(-1).tolist()
        torch.testing.assert_close(runner.decode(kv, tokens), runner.decode(runner.prefill(prompts, 60).cache, tokens),
                                   atol=2e-4, rtol=2e-4)


def test_rows_joining_a_running_cache_grow_it_in_place(native, reference):
    first, second = random_prompts(12, [5, 9]), random_prompts(13, [30, 2, 12])
    with torch.inference_mode():
        prefilled = native.prefill(first, capacity=12)
        logits, kv = prefilled.logits, prefilled.cache
        tokens = logits.argmax(-1).tolist()
        sequences = [p + [t] for p, t in zip(first, tokens)]
        logits = native.decode(kv, tokens)
        prefilled = native.prefill(second, capacity=40, into=kv)  # wider and more rows: the cache reshapes
        joined, kv2 = prefilled.logits, prefilled.cache
        assert kv2 is kv and kv.rows == 5 and kv.capacity >= 40
        tokens = logits.argmax(-1).tolist() + joined.argmax(-1).tolist()
        sequences = [s + [t] for s, t in zip(sequences, tokens[:2])] + [p + [t] for p, t in zip(second, tokens[2:])]
        logits = native.decode(kv, tokens)
        for row, seq in enumerate(sequences):
            torch.testing.assert_close(logits[row], reference_logits(reference, seq), atol=2e-4, rtol=2e-4)


def run_beams(runner, prompts, widths, rounds, trie=None, digits: int | None = 3):
    requests = [BeamRequest(i, p, w, r, None, trie) for i, (p, w, r) in enumerate(zip(prompts, widths, rounds))]
    batch = BeamSearchBatch(runner, requests)
    results = {}
    with torch.inference_mode():
        items = batch.prefill()
        while True:
            for req, delta in items:
                results[req.index] = [(b.token_ids, b.cumulative_logprob if digits is None else
                                       round(b.cumulative_logprob, digits)) for b in delta.beams]
            if not batch:
                break
            items = batch.decode()
    return [results[i] for i in range(len(prompts))]


def assert_same_beams(found, expected, tolerance: float = 1e-4) -> None:
    """Two engines' beams: the same token sequences in the same order, scores equal to float32
    noise (their attention sums in different orders)."""
    assert [[tokens for tokens, _ in beams] for beams in found] == [[tokens for tokens, _ in beams]
                                                                   for beams in expected]
    for beams, others in zip(found, expected):
        for (_, score), (_, other) in zip(beams, others):
            assert abs(score - other) <= tolerance, (score, other)


def test_shared_prompt_beams_equal_copied_prompt_beams(native, copied):
    """Requests of different widths and rounds in one batch, some finishing early."""
    prompts = random_prompts(14, [25, 7, 60, 3])
    widths, rounds = [8, 16, 3, 5], [3, 2, 4, 1]
    assert_same_beams(run_beams(native, prompts, widths, rounds, digits=None),
                      run_beams(copied, prompts, widths, rounds, digits=None))


def test_beams_over_the_vocabulary_in_column_blocks_equal_one_block(native, copied, monkeypatch):
    """Without a table a round walks the vocabulary in blocks (top-k and log-sum-exp per block):
    blocks of 1,000 columns, a last one shorter, give what one block of all 151,669 gives."""
    import xllm_async.execution.beam as beam

    prompts = random_prompts(16, [25, 7, 40])
    widths, rounds = [8, 16, 3], [3, 2, 3]
    monkeypatch.setattr(beam, "LOGITS_BLOCK_COLUMNS", 1 << 20)
    whole = run_beams(native, prompts, widths, rounds)
    monkeypatch.setattr(beam, "LOGITS_BLOCK_COLUMNS", 1000)
    assert run_beams(native, prompts, widths, rounds) == whole
    assert_same_beams(run_beams(copied, prompts, widths, rounds), whole, 1e-3)  # whole: rounded to 3 digits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_beam_search_answers_the_same_alone_and_in_any_batch(tiny_model_dir, dtype):
    """A request's beams must not depend on which requests share its batch, in bfloat16 too,
    where logits tie often: the vocabulary's blocks and each request's top-k are its own."""
    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), dtype)
    runner.set_kv_cache(64 << 20, 1)
    prompts = random_prompts(17, [30, 12, 50, 8])
    widths, rounds = [4, 16, 8, 16], [3, 3, 3, 3]
    alone = [run_beams(runner, [p], [w], [r])[0] for p, w, r in zip(prompts, widths, rounds)]
    assert run_beams(runner, prompts, widths, rounds) == alone
    assert run_beams(runner, prompts[1::2], widths[1::2], rounds[1::2]) == alone[1::2]  # one width


def test_item_constrained_beams_agree_on_both_engines(native, copied):
    from xllm_async.execution.item_trie import ItemTrie

    from .test_beam_search import ITEMS

    trie = ItemTrie.of(ITEMS, torch.device("cpu"))
    prompts = random_prompts(15, [20, 33])
    found = run_beams(native, prompts, [16, 8], [3, 3], trie, digits=None)
    assert_same_beams(found, run_beams(copied, prompts, [16, 8], [3, 3], trie, digits=None))
    assert all(tuple(tokens) in set(ITEMS) for beams in found for tokens, _ in beams)
    assert [len(beams) for beams in found] == [16, 8]


def test_item_trie_rejects_mixed_lengths_and_masks_by_prefix():
    from xllm_async.execution.item_trie import ItemTrie, LeafFilter

    with pytest.raises(ValueError):
        ItemTrie.of([(1, 2), (3,)], torch.device("cpu"))
    trie = ItemTrie.of([(4, 2), (1, 3), (1, 2), (1, 2)], torch.device("cpu"))
    assert trie.leaves == 3 and trie.vocab[0].tolist() == [1, 4] and trie.vocab[1].tolist() == [2, 3]
    root = trie.expand(0, np.array([0]))
    assert root.mask.tolist() == [[True, True]] and root.counts.tolist() == [2]
    one, four = root.child[0, 0], root.child[0, 1]
    second = trie.expand(1, np.array([one, four]))
    assert second.mask.tolist() == [[True, True], [True, False]] and second.counts.tolist() == [2, 1]
    assert [second.child[0, 0], second.child[0, 1], second.child[1, 0]] == [0, 1, 2]  # the leaves, sorted
    # A filter removes a node once none of its leaves is left: (1, 2) and (1, 3) gone leave 1 no child.
    gone = trie.expand(0, np.array([0]), LeafFilter(drop=np.array([0, 1])))
    assert gone.mask.tolist() == [[False, True]] and gone.counts.tolist() == [1]
    only = trie.expand(1, np.array([one]), LeafFilter(keep=np.array([1])))
    assert only.mask.tolist() == [[False, True]]


def test_budget_counts_packed_tokens_a_beam_prompt_once_and_the_cache_rectangle():
    params = SamplingParams(max_tokens=100)
    reqs = [EngineRequest(i, [0] * n, params, None) for i, n in enumerate([300, 20, 20, 20])]
    from collections import deque

    # Packed: 300 + 20 + 20 fit 350 tokens; padded they would cost 3 x 300.
    assert BatchBudget(8, 350, packed=True).take(deque(reqs)) == reqs[:3]
    assert BatchBudget(8, 350, packed=False).take(deque(reqs)) == reqs[:1]
    # The cache holds rows x the longest row's prompt + max_tokens: 2 x 400 fit 900, 3 x 400 do not.
    assert BatchBudget(8, 10_000, packed=True, kv_tokens=900).take(deque(reqs)) == reqs[:2]
    wide = [BeamRequest(i, [0] * 1000, 64, 3, None) for i in range(3)]
    assert len(BatchBudget(256, 8192, packed=True).take(deque(wide))) == 3  # 3 x (1000 + 128), not 3 x 64,000


def test_budget_counts_every_beam_x_its_rounds_against_the_cache():
    from collections import deque

    # Alone, each needs its prompt's row (100) and 8 beams x 4 own tokens: 132.
    beams = [BeamRequest(i, [0] * 100, 8, 5, None) for i in range(2)]
    assert BatchBudget(256, 8192, packed=True, kv_tokens=300).take(deque(beams)) == beams  # 200 + 16 x 4
    assert BatchBudget(256, 8192, packed=True, kv_tokens=250).take(deque(beams)) == beams[:1]  # the other waits
    budget = BatchBudget(256, 8192, packed=True, kv_tokens=131)
    assert budget.cache_alone(beams[0]) == 132 and budget.never_fits(beams[0])
    assert not BatchBudget(256, 8192, packed=True, kv_tokens=132).never_fits(beams[0])
    # A single round is scored from the prefill alone: no cache at all.
    assert BatchBudget(256, 8192, kv_tokens=1).cache_alone(BeamRequest(0, [0] * 100, 8, 1, None)) == 0


def test_beam_caches_come_out_of_the_slots_arena(tiny_model_dir):
    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "float32")
    runner.set_kv_cache(runner.kv_layout.token_bytes * 300, 1)
    with torch.inference_mode():
        state = runner.beam_prefill([[1] * 20, [2] * 30], [16, 8], 5).state
        buffer = runner._arena()._buffer
        assert state.own.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        # After the prompts' 2 x 30 tokens: 24 beams x 4 rounds.
        assert state.own.shape[2:5:2] == (24, 4)
        assert state.own.storage_offset() == 60 * runner.kv_layout.token_elements
        with pytest.raises(MemoryError):  # 30 + 72 x 4 > 300: refused, nothing allocated beside the arena
            runner.beam_prefill([[1] * 30], [72], 5)


def test_families_we_run_and_those_left_to_transformers():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    assert ModelShape(LlamaConfig(num_hidden_layers=1)).unsupported() is None
    shape = ModelShape(Qwen2Config(num_hidden_layers=1))
    assert shape.unsupported() is None and shape.qkv_bias and not shape.qk_norm
    assert "mistral" in ModelShape(MistralConfig(num_hidden_layers=1)).unsupported()
    scaled = LlamaConfig(num_hidden_layers=1, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert "yarn" in (ModelShape(scaled).unsupported() or "yarn")


def _packings() -> list[str]:
    """The packed linears this machine can run: "ours" only where our kernel (AMX or AVX512-BF16)
    loaded and works."""
    from xllm_async.model import cpu_kernels

    kinds = ["ours"] if cpu_kernels.our_linear() is not None else []
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        kinds.append("onednn")
    return kinds


def _require_packing(kind: str) -> None:
    """Ours: failed, not skipped, where this CPU has the instructions and it did not verify (conftest)."""
    if kind == "ours":
        require_kernel("linear")
    elif kind not in _packings():
        pytest.skip(f"no {kind} linear on this machine")


@pytest.mark.kernel("linear")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_our_linear_refuses_a_bias_of_another_length(dtype):
    """It reads n bias values: a shorter bias was read past its end, a longer one taken in part."""
    if dtype == torch.float32:
        require_kernel("float32 linear")
    packed = torch.ops.xllm.pack_linear(torch.ones(40, 32, dtype=dtype))
    x = torch.ones(3, 32, dtype=dtype)
    assert torch.equal(torch.ops.xllm.linear(x, packed, torch.ones(40), 40), torch.full((3, 40), 33, dtype=dtype))
    for bias in (torch.ones(39), torch.ones(41), torch.ones(1), torch.ones(2, 20)):
        with pytest.raises(RuntimeError, match="bias"):
            torch.ops.xllm.linear(x, packed, bias.to(dtype), 40)
    with pytest.raises(RuntimeError, match="bias"):  # (checked whatever the rows)
        torch.ops.xllm.linear(x[:0], packed, torch.ones(3), 40)


@pytest.mark.parametrize("kind", ["ours", "onednn"])
def test_packed_linears_compute_what_plain_ones_do(kind):
    """Every row count (a block of 32 rows and its tail, groups of 4 rows and their tails, and
    beyond our linear's rows), a last column block part padding, a bias, rows in three dimensions:
    within bfloat16 rounding of the plain layer's float32 product."""
    from xllm_async.model.cpu_linear import OUR_MAX_ROWS, pack_linears
    from xllm_async.model.layers import Linear

    _require_packing(kind)
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True).bfloat16()
    with torch.inference_mode():
        beyond_ours = max(OUR_MAX_ROWS.values()) + 3  # (AMX: oneDNN's copy; 300 rows: ours where it takes all)
        inputs = [torch.randn(rows, 64).bfloat16() for rows in (1, 2, 3, 5, 32, 33, 100, beyond_ours, 300)]
        plain = [F.linear(x.float(), layer.weight.float(), layer.bias.float()) for x in inputs]
        assert pack_linears(layer, kind) == 1 and layer.weight is None
        for x, want in zip(inputs, plain):
            torch.testing.assert_close(layer(x).float(), want, atol=0.05, rtol=0.02)
        x = torch.randn(2, 3, 64).bfloat16()
        assert torch.equal(layer(x), layer(x.view(6, 64)).view(2, 3, 96))


def test_our_float32_linear_computes_what_the_plain_one_does(tiny_model_dir):
    """Float32 layers on our AVX512 loop: every row count (groups of 6 rows and each tail, a block
    of 32 and past it), an odd input width, a last column block part padding, a bias: equal to the
    plain layer within float32 summation order. A float32 model gets it, with no oneDNN copy and
    no padded rows."""
    from xllm_async.model.cpu_linear import pack_linears
    from xllm_async.model.layers import Linear
    from xllm_async.runtime.model_runner import ModelRunner

    require_kernel("float32 linear")
    torch.manual_seed(0)
    layer = Linear(63, 100, bias=True)
    with torch.inference_mode():
        inputs = [torch.randn(rows, 63) for rows in (1, 2, 3, 4, 5, 6, 7, 11, 32, 33, 100, 300)]
        plain = [F.linear(x, layer.weight, layer.bias) for x in inputs]
        assert pack_linears(layer, "ours") == 1 and layer.weight is None and layer.packed.onednn is None
        for x, want in zip(inputs, plain):
            torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "float32")
    assert runner.model.packed_lm_head.kind == "ours" and not runner.model.pad_rows
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None and m.packed.onednn is None for m in layers)


def test_our_logits_over_a_block_of_columns_are_those_of_the_whole_vocabulary(tiny_model_dir):
    """A beam round walks the vocabulary in blocks of columns: from a 64-column boundary the packed
    head serves them; elsewhere the plain head does. Either way they are the whole logits' columns."""
    from xllm_async.runtime.model_runner import ModelRunner

    require_kernel("linear")
    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    assert runner.model.packed_lm_head.kind == "ours"
    hidden = torch.randn(7, runner.model.shape.hidden).bfloat16()
    with torch.inference_mode():
        whole = runner.logits(hidden, as_float=False)
        vocab = whole.shape[1]
        for start, end in [(0, 64), (128, 1000), (64 * (vocab // 64), vocab)]:
            assert torch.equal(runner.logits(hidden, as_float=False, columns=(start, end)), whole[:, start:end])
        odd = runner.logits(hidden, as_float=False, columns=(5, 300))  # not a block's start: plain head
        torch.testing.assert_close(odd.float(), whole[:, 5:300].float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("table", ["mixed", "every prefix one item"])
def test_beams_with_one_way_to_end_skip_the_last_forward_and_score_the_same(native, monkeypatch, table):
    """Last round with a table: a beam whose two codes leave one item is not fed (its token's
    renormalised log-probability is 0); the answers equal feeding every beam."""
    from xllm_async.execution.item_trie import ItemTrie

    from .test_beam_search import ITEMS

    items = ITEMS if table == "mixed" else list({key[:2]: key for key in ITEMS}.values())
    trie = ItemTrie.of(items, torch.device("cpu"))
    prompts = random_prompts(18, [20, 33, 9])
    widths = [16, 8, 1]
    fed = []
    feed = native.beam_decode
    monkeypatch.setattr(native, "beam_decode", lambda state, tokens, *rest, **kw: fed.append(len(tokens)) or
                        feed(state, tokens, *rest, **kw))
    skipping = run_beams(native, prompts, widths, [3, 3, 3], trie)
    rounds_skipping = list(fed)
    monkeypatch.setattr(BeamSearchBatch, "_forced", lambda self, expansions: None)
    assert run_beams(native, prompts, widths, [3, 3, 3], trie) == skipping
    assert fed[len(rounds_skipping):] == [25, 25]  # every beam fed in both rounds
    if table == "mixed":
        assert rounds_skipping[0] == 25 and 0 < rounds_skipping[1] < 25
    else:
        assert rounds_skipping == [25]  # the last round fed nothing
    assert all(tuple(tokens) in set(items) for beams in skipping for tokens, _ in beams)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_decode_answers_the_same_alone_and_beside_rows_of_other_lengths(tiny_model_dir, dtype):
    """A row's decode steps must not depend on the rows beside it, in bfloat16 too: each run of
    equal-length rows attends over its own keys, never over the batch's longest with a mask."""
    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), dtype)
    runner.set_kv_cache(64 << 20, 1)
    prompts = random_prompts(19, [30, 12, 50, 8, 12])

    def greedy(batch: list[list[int]], steps: int = 12) -> list[list[int]]:
        with torch.inference_mode():
            prefilled = runner.prefill(batch, max(map(len, batch)) + steps)
            logits, kv = prefilled.logits, prefilled.cache
            out = [[t] for t in logits.argmax(-1).tolist()]
            for _ in range(steps - 1):
                logits = runner.decode(kv, [seq[-1] for seq in out])
                for seq, t in zip(out, logits.argmax(-1).tolist()):
                    seq.append(t)
        return out

    alone = [greedy([p])[0] for p in prompts]
    assert greedy(prompts) == alone


def test_decode_logits_are_the_same_bits_on_one_thread_and_on_two(tiny_model_dir):
    """A slot's step runs on its share of the cores or on all of them (StreamBinding.share_cores,
    by whether the other slots are busy): its answer must not follow. torch's fused attention sums
    a decode's keys differently by thread count (it did for the tiny model's 16-wide heads, and a
    served test comparing logprobs failed now and then); our decode kernel cuts them by a constant."""
    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "float32")
    runner.set_kv_cache(64 << 20, 1)
    prompts = random_prompts(23, [105, 117, 133])
    before = torch.get_num_threads()

    def steps(threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            prefilled = runner.prefill(prompts, 150)
            logits, out = prefilled.logits, [prefilled.logits]
            for _ in range(6):
                logits = runner.decode(prefilled.cache, logits.argmax(-1).tolist())
                out.append(logits)
        return torch.stack(out)

    try:
        assert torch.equal(steps(1), steps(2))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_our_linear_shares_its_tiles_out_and_answers_the_same_bits_on_any_thread_count(dtype):
    """csrc/blocked_linear.h: threads take equal runs of (row block, column block) tiles, by rows
    where the rows outnumber the columns, else by columns; 9 column blocks (SmolLM2's o and down
    projections) no longer leave one thread 5 and the other 4. Whoever makes a tile, its sums are the
    same: every row count, split either way, on 1, 2 and 3 threads."""
    require_kernel("float32 linear" if dtype == torch.float32 else "linear")
    torch.manual_seed(0)
    weight, bias = torch.randn(576, 200).to(dtype), torch.randn(576).to(dtype)  # 9 column blocks
    packed = torch.ops.xllm.pack_linear(weight)
    before = torch.get_num_threads()
    try:
        for rows in (1, 8, 33, 64, 448, 577, 1000):  # (577 on: more rows than columns, split by rows)
            x = torch.randn(rows, 200).to(dtype)
            outs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outs.append(torch.ops.xllm.linear(x, packed, bias, 576))
            assert all(torch.equal(outs[0], out) for out in outs[1:]), rows
            torch.testing.assert_close(outs[0].float(), F.linear(x.float(), weight.float(), bias.float()),
                                       atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=0.02)
    finally:
        torch.set_num_threads(before)


def test_padded_row_counts_are_few_and_waste_at_most_a_quarter():
    from xllm_async.model.cpu_linear import EXACT_ROWS, padded_rows

    assert [padded_rows(n) for n in (1, 9, EXACT_ROWS)] == [1, 9, EXACT_ROWS]  # few clients' decode: exact
    sizes = {padded_rows(n) for n in range(1, 8193)}
    assert len(sizes) <= EXACT_ROWS + 4 * 9  # 4 sizes a doubling from 16 to 8,192
    for n in range(EXACT_ROWS + 1, 8193):
        padded = padded_rows(n)
        assert n <= padded < n * 5 / 4 + 1 and padded_rows(padded) == padded


@pytest.mark.parametrize("kind", ["ours", "onednn"])
def test_bfloat16_rows_reach_the_packed_linear_and_answer_as_alone(tiny_model_dir, monkeypatch, kind):
    """oneDNN compiles a kernel per row count: packed prompts (and decode steps of more than
    EXACT_ROWS rows) go through the layers padded, and the padding changes no answer. Our linear
    takes up to its OUR_MAX_ROWS on AMX, more going to oneDNN's copy; on AVX512-BF16 it takes every
    row count, unpadded, and no layer keeps oneDNN's weight."""
    from xllm_async.model import cpu_kernels, cpu_linear
    from xllm_async.runtime import model_runner

    _require_packing(kind)
    monkeypatch.setattr(model_runner, "choose_linear", lambda device, dtype: kind)
    runner = model_runner.ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    runner.set_kv_cache(64 << 20, 1)
    seen: list[int] = []  # the rows of every packed linear call
    namespace, name = (torch.ops.xllm, "linear") if kind == "ours" else (torch.ops.mkldnn, "_linear_pointwise")
    kernel = getattr(namespace, name)
    monkeypatch.setattr(namespace, name, lambda x, *rest: seen.append(x.shape[0]) or kernel(x, *rest))
    beyond: list[int] = []  # the rows of every oneDNN linear call past our linear
    if kind == "ours":
        onednn = torch.ops.mkldnn._linear_pointwise
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                            lambda x, *rest: beyond.append(x.shape[0]) or onednn(x, *rest))

    def greedy(batch: list[list[int]], steps: int = 3) -> list[list[int]]:
        with torch.inference_mode():
            prefilled = runner.prefill(batch, max(map(len, batch)) + steps)
            logits, kv = prefilled.logits, prefilled.cache
            assert logits.shape[0] == len(batch)
            out = [[t] for t in logits.argmax(-1).tolist()]
            for _ in range(steps - 1):
                logits = runner.decode(kv, [seq[-1] for seq in out])
                assert logits.shape[0] == len(batch)
                for seq, t in zip(out, logits.argmax(-1).tolist()):
                    seq.append(t)
        return out

    prompts = random_prompts(23, [3 + (i % 7) for i in range(70)])  # 70 rows decode
    tokens = sum(map(len, prompts))
    batched = greedy(prompts)
    if kind == "ours" and not cpu_linear.keeps_onednn_copy():  # (AVX512-BF16: ours alone, rows as they are)
        assert not beyond and not runner.model.pad_rows and tokens in seen and 70 in seen
        assert all(m.packed.onednn is None for m in runner.model.modules() if getattr(m, "packed", None))
        assert batched == [greedy([p])[0] for p in prompts]
        return
    layer_rows = seen if kind == "onednn" else beyond
    assert max(layer_rows) > cpu_linear.EXACT_ROWS and all(cpu_linear.padded_rows(n) == n for n in layer_rows)
    assert cpu_linear.padded_rows(tokens) != tokens and tokens not in layer_rows and 70 not in layer_rows  # padded
    assert batched == [greedy([p])[0] for p in prompts]
    if kind == "ours":  # a prompt alone (3-9 rows) on ours, more rows than ours takes on oneDNN's; the
        # LM head (no second copy) takes the batch's 70 last rows on ours, as they are, whatever ours takes
        most = cpu_linear.OUR_MAX_ROWS[cpu_kernels.our_linear()]
        assert beyond and min(beyond) > most and 70 in seen and {n for n in seen if n > most} <= {70}


def test_bfloat16_attention_reaches_the_kernel_in_multiples_of_16_tokens(monkeypatch):
    """torch's fused CPU attention compiles a kernel per odd length in bfloat16 and keeps it for
    good (attention_backends.ATTENTION_MULTIPLE): prompts and beam rounds reach it padded, causal prompts
    with tokens after their own and beams' prompt keys with the padding masked out, and the real
    rows come out as unpadded attention computes them."""
    import torch.nn.functional as F

    from xllm_async.model import attention_backends, forward_context

    spans: list[tuple[int, int]] = []  # (queries, keys) of every kernel call
    sdpa, flash = F.scaled_dot_product_attention, attention_backends.FLASH_CPU
    if flash is None:
        pytest.skip("no fused CPU attention operator in this torch build")

    def spy_sdpa(q, k, v, *args, **kw):
        spans.append((q.shape[-2], k.shape[-2]))
        return sdpa(q, k, v, *args, **kw)

    def spy_flash(q, k, v, *args, **kw):
        spans.append((q.shape[-2], k.shape[-2]))
        return flash(q, k, v, *args, **kw)

    monkeypatch.setattr(attention_backends.F, "scaled_dot_product_attention", spy_sdpa)
    # torch's kernels, as on CPUs without AVX512-BF16
    torch_kernels = attention_backends.SdpaAttention(torch.bfloat16, flash=spy_flash)
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim = 4, 2, 16
    lengths = [5, 23, 23, 40]
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).bfloat16()

    q, k, v = randn(tokens, heads, dim), randn(tokens, kv_heads, dim), randn(tokens, kv_heads, dim)
    out = forward_context.PackedPrefill(torch_kernels, lengths, torch.device("cpu")).attend(0, q, k, v, dim ** -0.5)
    assert spans and all(n % attention_backends.ATTENTION_MULTIPLE == 0 for call in spans for n in call)
    start = 0
    for n in lengths:  # each sequence against float32 attention of its own tokens
        qs, ks, vs = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))
        ref = sdpa(qs, ks, vs, is_causal=True, scale=dim ** -0.5, enable_gqa=True)
        assert torch.allclose(out[start:start + n].float(), ref.transpose(0, 1).reshape(n, -1), atol=2e-2)
        start += n

    spans.clear()  # a beam round's prompt stage: 6 beams x 2 queries against 37 prompt keys
    qb, kb, vb = randn(1, kv_heads, 12, dim), randn(1, kv_heads, 37, dim), randn(1, kv_heads, 37, dim)
    out, lse = torch_kernels.attend(qb, kb, vb, dim ** -0.5)
    assert spans == [(16, 48)] and out.shape == (1, kv_heads, 12, dim) and lse.shape == (1, kv_heads, 12, 1)
    ref = sdpa(qb.float(), kb.float(), vb.float(), scale=dim ** -0.5)
    assert torch.allclose(out.float(), ref, atol=2e-2)
    scores = (qb.float() @ kb.float().transpose(-1, -2)) * dim ** -0.5
    assert torch.allclose(lse.float(), scores.logsumexp(-1, keepdim=True), atol=2e-2)

    spans.clear()  # float32 takes the kernel's other path: exact lengths
    float32 = attention_backends.SdpaAttention(torch.float32, flash=spy_flash)
    forward_context.PackedPrefill(float32, lengths, torch.device("cpu")).attend(0, q.float(), k.float(), v.float(),
                                                                          dim ** -0.5)
    assert sorted(set(spans)) == [(5, 5), (23, 23), (40, 40)]


@pytest.mark.parametrize("refusal", [
    RuntimeError("GQA is not supported with the cuDNN backend."),
    RuntimeError("FlashAttention only supports Ampere GPUs or newer."),
    RuntimeError("CUDA error: no kernel image is available for execution on the device"),
    TypeError("varlen_attn() got an unexpected keyword argument 'window_size'"),
    ValueError("Expect number of query heads to be a multiple of kv heads"),
    NotImplementedError("varlen_attn on this device"),
])
def test_varlen_flash_attention_is_turned_off_only_by_errors_that_say_it_cannot_run(monkeypatch, caplog, refusal):
    """A failure of one call (out of memory, a device fault) fails that forward's batch and leaves
    varlen flash attention on for the next; one that says this build or device cannot run it turns
    it off for good, with one warning, and the packed prompts' SDPA calls answer instead. Once,
    any failure turned it off for the whole process. (torch's function replaced by a stand-in:
    it runs only on CUDA.)"""
    from xllm_async.model import attention_backends, flash_varlen, forward_context

    failures = iter([torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                     RuntimeError("CUDA error: an illegal memory access was encountered"), refusal])
    calls = []

    def stand_in(q, k, v, *args, **kwargs):
        calls.append(q.shape[0])
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return torch.zeros_like(q)

    flash = flash_varlen.FlashVarlen()
    flash.fn, flash.extra, flash.gqa, flash.scale = stand_in, {}, True, True
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(11, 2, 16, generator=gen) for _ in range(3))
    # (CPU tensors stand in for CUDA ones)
    prefill = forward_context.PackedPrefill(attention_backends.CudaFlashAttention(torch.float32, flash), [5, 6],
                                      torch.device("cpu"))
    assert prefill.cu_lengths.tolist() == [0, 5, 11]
    with pytest.raises(torch.OutOfMemoryError):
        prefill.attend(0, q, k, v, 0.25)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        prefill.attend(0, q, k, v, 0.25)
    assert flash.fn is stand_in  # still on: the next batch tries it again
    with caplog.at_level("WARNING", logger="xllm_async.model"):
        out = prefill.attend(0, q, k, v, 0.25)
    assert flash.fn is None and caplog.text.count("varlen flash attention unusable") == 1
    assert len(calls) == 3 and out.abs().sum() > 0  # SDPA's answer, not the stand-in's zeros
    assert torch.equal(prefill.attend(0, q, k, v, 0.25), out) and len(calls) == 3  # off for good
    assert not flash_varlen.unsupported(torch.OutOfMemoryError("out of memory: not supported"))


def test_warm_up_compiles_onednn_for_every_large_row_count(tiny_model_dir, monkeypatch):
    """Start-up runs oneDNN's linear once at each padded row count from WARM_FROM up to the
    batch's most tokens, for every layer shape and slot thread count, so that no kernel of a large
    batch is first compiled under traffic; the caller's thread count is left as it was. (oneDNN's
    linear serves large batches on AMX, and alone on CPUs without our kernel: it is chosen here.)"""
    from xllm_async.model import cpu_linear, layers
    from xllm_async.runtime import model_runner

    if "onednn" not in _packings():
        pytest.skip("no oneDNN linear on this machine")
    monkeypatch.setattr(model_runner, "choose_linear", lambda device, dtype: "onednn")
    runner = model_runner.ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    calls: list[tuple[int, int, int]] = []  # (rows, input width, threads)
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *rest: calls.append(
        (x.shape[0], x.shape[1], torch.get_num_threads())) or onednn(x, *rest))
    before = torch.get_num_threads()
    runner.warm_up(2000, {1, 2})
    assert torch.get_num_threads() == before
    sizes = sorted({cpu_linear.padded_rows(n) for n in range(cpu_linear.WARM_FROM + 1, 2001)})
    assert sizes[0] > cpu_linear.WARM_FROM and sizes[-1] >= 2000
    assert {(rows, threads) for rows, _, threads in calls} == {(s, t) for s in sizes for t in (1, 2)}
    shapes = {(m.in_features, m.out_features, m.bias is not None) for m in runner.model.modules()
              if isinstance(m, layers.Linear)}
    assert len(calls) == len(sizes) * 2 * len(shapes) and len({x for _, x, _ in calls}) >= 2


def test_warm_up_compiles_nothing_where_our_linear_takes_every_row_count(tiny_model_dir, monkeypatch):
    """On AVX512-BF16 our linear takes every row count and no layer keeps oneDNN's weight: start-up
    has nothing of oneDNN's to compile."""
    from xllm_async.model import cpu_linear
    from xllm_async.runtime.model_runner import ModelRunner

    require_kernel("linear")
    if cpu_linear.keeps_onednn_copy():
        pytest.skip("AMX: oneDNN's copy serves the large batches")
    runner = ModelRunner(tiny_model_dir, torch.device("cpu"), "bfloat16")
    calls: list[int] = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *rest: calls.append(x.shape[0]) or onednn(x, *rest))
    runner.warm_up(2000, {1, 2})
    assert calls == [] and not runner.model.pad_rows


def test_the_attention_backend_is_chosen_once_from_the_device_the_dtype_and_the_head_shape():
    """Our CPU kernels where they take the dtype and head shape (each kernel on its own), torch's
    kernels for the rest; on accelerators one masked decode call, on CUDA with varlen flash
    prefills in bfloat16 and float16."""
    from xllm_async.model import attention_backends as backends
    from xllm_async.model import cpu_kernels
    from xllm_async.model.flash_varlen import FlashVarlen
    from xllm_async.runtime.backends import choose_attention

    cpu = torch.device("cpu")
    if cpu_kernels.verified()["packed attention"] and cpu_kernels.verified()["decode attention"]:
        smol = choose_attention(cpu, torch.bfloat16, 64, 3)  # SmolLM2's heads: every kernel
        assert isinstance(smol, backends.CpuKernelAttention)
        assert None not in (smol.varlen_kernel, smol.decode_kernel, smol.prefix_kernel)
        tiny = choose_attention(cpu, torch.float32, 16, 2)  # 16 wide: every kernel too
        assert None not in (tiny.varlen_kernel, tiny.decode_kernel, tiny.prefix_kernel)
        wide = choose_attention(cpu, torch.bfloat16, 64, 12)  # 12 query heads a key head: the decode kernel takes 8
        assert wide.varlen_kernel is not None and wide.prefix_kernel is not None and wide.decode_kernel is None
    assert type(choose_attention(cpu, torch.float16, 64, 3)) is backends.SdpaAttention
    assert choose_attention(cpu, torch.float16, 64, 3).multiple == backends.ATTENTION_MULTIPLE
    for device in (torch.device("cuda", 0), torch.device("meta")):  # (chosen, not run; meta stands in for an NPU)
        assert type(choose_attention(device, torch.float32, 64, 3)) is backends.MaskedSdpaAttention
    flash = choose_attention(torch.device("cuda", 0), torch.bfloat16, 64, 3)
    wanted = backends.CudaFlashAttention if FlashVarlen().fn is not None else backends.MaskedSdpaAttention
    assert type(flash) is wanted and flash.multiple == 1
