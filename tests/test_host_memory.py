"""CPU weights are moved into one block on a huge-page boundary, unchanged, ties kept."""

from __future__ import annotations

import torch

from xllm_async.runtime.host_memory import HUGE_PAGE, pack_weights


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
