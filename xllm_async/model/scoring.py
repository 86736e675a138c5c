"""A prompt scored by the model: each token's log-probability given the tokens
before it, its rank and the likeliest alternatives (echo with logprobs, vLLM's
prompt_logprobs). Both runners compute it from their final hidden states."""

from __future__ import annotations

import torch


class PromptScores:
    """What the model made of a prompt: for each token after the first, its log-probability
    given the tokens before it, its rank there (1 = the likeliest) and the top alternatives."""

    __slots__ = ("logprobs", "ranks", "top")

    def __init__(self) -> None:
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top: list[list[tuple[int, float]]] = []


SCORE_ROWS = 64  # positions scored at once: 64 x a 151,669-token vocabulary is 39 MB of float32 logits


def score_prompt(head, hidden: torch.Tensor, targets: list[int], top: int) -> PromptScores:
    """hidden [len(targets), hidden]: the final states of positions 0..n-2, which predict the
    prompt's tokens 1..n-1 (targets); head(rows) gives their float32 logits over the vocabulary."""
    scores = PromptScores()
    wanted = torch.tensor(targets, device=hidden.device)
    for start in range(0, len(targets), SCORE_ROWS):
        logprobs = torch.log_softmax(head(hidden[start:start + SCORE_ROWS]), dim=-1)
        chosen = logprobs.gather(1, wanted[start:start + SCORE_ROWS, None])
        scores.logprobs += chosen[:, 0].tolist()
        scores.ranks += ((logprobs > chosen).sum(-1) + 1).tolist()
        if top:
            values, ids = logprobs.topk(top, dim=-1)
            scores.top += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            scores.top += [[] for _ in range(chosen.shape[0])]
    return scores
