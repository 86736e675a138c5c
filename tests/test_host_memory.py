"""CPU weights are moved into one block on a huge-page boundary, unchanged, ties kept; so are the
packed linears, in order (unless XLLM_HUGE_PAGES=off), and key/value arenas with XLLM_HUGE_PAGES=all; freed heap
pages are handed back while batches run and once the server has been idle for a whole look."""

from __future__ import annotations

import pytest
import torch

from xllm_async.runtime.host_memory import (
    HUGE_PAGE,
    TrimSchedule,
    host_tensor,
    huge_pages_wanted,
    pack_linear_weights,
    pack_weights,
)


class TiedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 24)
        self.mid = torch.nn.Linear(24, 24)
        self.head = torch.nn.Linear(24, 1000, bias=False)
        self.head.weight = self.embed.weight  # tied, as in small LMs

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.embed(ids))))


def test_weights_move_into_one_block_with_the_same_values_and_ties():
    torch.manual_seed(0)
    model = TiedModel().eval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([[1, 5, 999]])
    with torch.no_grad():
        expected = model(ids)
    threads = torch.get_num_threads()
    block = pack_weights(model)
    assert block is not None
    assert torch.get_num_threads() == threads  # copied with one thread, then put back
    start = torch.frombuffer(block, dtype=torch.uint8).data_ptr()
    pointers = sorted(p.data_ptr() for p in model.parameters())
    assert all(start <= ptr < start + len(block) for ptr in pointers)
    assert pointers[0] % HUGE_PAGE == 0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.head.weight is model.embed.weight
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected)


class Pack:  # what pack_linear_weights sees of cpu_linear.PackedWeight: our layout, or None
    def __init__(self, ours: torch.Tensor | None) -> None:
        self.ours = ours


def test_packed_linears_move_into_one_huge_page_block_in_order_with_the_same_values(monkeypatch):
    monkeypatch.delenv("XLLM_HUGE_PAGES", raising=False)
    torch.manual_seed(0)
    packs = [Pack(torch.randn(3, 64 * 10).to(torch.bfloat16)), Pack(None), Pack(torch.randn(5, 64 * 7))]
    before = [p.ours.clone() if p.ours is not None else None for p in packs]
    block = pack_linear_weights(packs)
    assert block is not None
    start = torch.frombuffer(block, dtype=torch.uint8).data_ptr()
    first, second = packs[0].ours, packs[2].ours
    assert first.data_ptr() % HUGE_PAGE == 0 and first.data_ptr() >= start
    assert second.data_ptr() >= first.data_ptr() + first.numel() * first.element_size()  # a step's order
    assert second.data_ptr() + second.numel() * 4 <= start + len(block)
    assert torch.equal(first, before[0]) and torch.equal(second, before[2]) and packs[1].ours is None
    assert first.is_contiguous() and first.dtype == torch.bfloat16 and second.shape == (5, 448)


@pytest.mark.parametrize("choice", ["off", "weights"])
def test_arenas_come_from_torch_unless_all_and_packed_linears_stay_with_off(monkeypatch, choice):
    monkeypatch.setenv("XLLM_HUGE_PAGES", choice)
    arena = host_tensor(1000, torch.bfloat16)
    assert arena.shape == (1000,) and arena.dtype == torch.bfloat16
    assert huge_pages_wanted("weights") == (choice == "weights") and not huge_pages_wanted("arena")
    if choice == "weights":
        return
    ours = torch.randn(2, 128)
    pack = Pack(ours)
    assert pack_linear_weights([pack]) is None and pack.ours is ours


def test_an_arena_on_huge_pages_has_the_asked_size_and_takes_writes(monkeypatch):
    monkeypatch.setenv("XLLM_HUGE_PAGES", "all")
    arena = host_tensor(3 * HUGE_PAGE // 2 + 1, torch.bfloat16)
    assert arena.shape == (3 * HUGE_PAGE // 2 + 1,) and arena.dtype == torch.bfloat16
    assert arena.data_ptr() % HUGE_PAGE == 0
    arena.fill_(1.5)
    assert float(arena.float().sum()) == 1.5 * arena.numel()


def test_an_idle_server_trims_once_after_a_whole_quiet_look_and_not_again():
    schedule = TrimSchedule(interval=5.0)
    assert not schedule.due(1.0, 0, busy=False)  # nothing has run yet
    assert not schedule.due(2.0, 7, busy=True)  # under load, within the interval
    assert not schedule.due(3.0, 9, busy=False)  # idle now, but batches ended since the last look
    assert schedule.due(4.0, 9, busy=False)  # idle for a whole look: trim
    assert not schedule.due(5.0, 9, busy=False) and not schedule.due(60.0, 9, busy=False)  # nothing new


def test_at_low_load_the_server_trims_only_every_interval():
    # Idle at every look, yet a batch ran between any two: the trim waits for the interval,
    # not for each look that happens to find the server between requests.
    schedule = TrimSchedule(interval=5.0)
    due = [t for t in range(1, 21) if schedule.due(float(t), t, busy=False)]
    assert due == [5, 10, 15, 20]


def test_under_load_the_server_trims_every_interval():
    schedule = TrimSchedule(interval=5.0)
    due = [t for t in range(1, 21) if schedule.due(float(t), t * 3, busy=True)]
    assert due == [5, 10, 15, 20]

