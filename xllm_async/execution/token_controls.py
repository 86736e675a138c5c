"""Token controls (logit_bias, allowed_token_ids, bad_words, min_tokens and the three penalties)
applied to a batch's logits at once, with vLLM's semantics and order.

Each request that sets any of them gets a RowControls at admission (prepare.py): its fixed parts
as tensors (bias ids and values, allowed ids, its prompt's distinct tokens) and a reference to its
growing output. Every step, apply_controls gathers the rows' index lists into a few flat tensors
and changes the scores with one scatter or gather per kind of control: Python runs once per
controlled row (and per bad word), never over the vocabulary. Rows without controls are copied
unchanged, so that they sample exactly as they would in a batch without any.
"""

from __future__ import annotations

import torch

from ..engine.params import TokenControls

_NEG_INF = float("-inf")


class RowControls:
    """One request's controls as the sampler needs them each step."""

    __slots__ = ("controls", "output_ids", "bias_ids", "bias_values", "allowed", "prompt_ids", "stop_ids",
                 "banned", "bad_sequences")

    def __init__(self, controls: TokenControls, prompt_ids: list[int], output_ids: list[int],
                 stop_ids: frozenset[int]) -> None:
        self.controls = controls
        self.output_ids = output_ids  # the request's own list: it grows as the request appends
        bias = controls.logit_bias
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long) if bias else None
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None
        self.allowed = (torch.tensor(sorted(set(controls.allowed)), dtype=torch.long)
                        if controls.allowed is not None else None)
        # The repetition penalty covers the prompt's tokens: each distinct one, found once here.
        self.prompt_ids = (torch.tensor(sorted(set(prompt_ids)), dtype=torch.long)
                           if controls.repetition_penalty != 1.0 else None)
        self.stop_ids = sorted(stop_ids)  # masked while the output is shorter than min_tokens
        # A one-token bad word is always masked; a longer one's last token when its others end the output.
        self.banned = sorted({word[0] for word in controls.bad_words if len(word) == 1})
        self.bad_sequences = [(list(word[:-1]), word[-1]) for word in controls.bad_words if len(word) > 1]

    def masked_now(self) -> list[int]:
        """Token ids this step must not choose: one-token bad words, the last token of each longer
        one whose other tokens end the output, and the stop tokens before min_tokens."""
        out = self.output_ids
        masked = list(self.banned)
        for prefix, last in self.bad_sequences:
            if len(prefix) <= len(out) and out[len(out) - len(prefix):] == prefix:
                masked.append(last)
        if len(out) < self.controls.min_tokens:
            masked.extend(self.stop_ids)
        return masked


def row_controls(controls: TokenControls | None, prompt_ids: list[int], output_ids: list[int],
                 stop_ids: frozenset[int]) -> RowControls | None:
    return RowControls(controls, prompt_ids, output_ids, stop_ids) if controls is not None else None


def _flat(pieces: list[tuple[int, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index of each entry, token id of each entry) of [(row, ids), ...]."""
    ids = torch.cat([t for _, t in pieces])
    rows = torch.cat([torch.full((len(t),), row, dtype=torch.long) for row, t in pieces])
    return rows.to(device), ids.to(device)


def _per_entry(pieces: list[tuple[int, torch.Tensor]], values: list[float], device: torch.device) -> torch.Tensor:
    """Each row's value repeated over its entries."""
    return torch.cat([torch.full((len(t),), v, dtype=torch.float32) for (_, t), v in zip(pieces, values)]).to(device)


def apply_controls(logits: torch.Tensor, rows: list[RowControls | None]) -> torch.Tensor:
    """The scores to choose from: logits [rows, vocab] (float32, copied) with each row's controls
    applied, in vLLM's order: allowed ids, bad words, min_tokens, logit_bias, then the repetition,
    frequency and presence penalties. Masked tokens get -inf."""
    scores = logits.to(torch.float32, copy=True)
    device = scores.device
    allowed, banned, biased, repeated, outputs = [], [], [], [], []
    repetition, frequency, presence = [], [], []
    for row, c in enumerate(rows):
        if c is None:
            continue
        k = c.controls
        if c.allowed is not None:
            allowed.append((row, c.allowed))
        masked = c.masked_now()
        if masked:
            banned.append((row, torch.tensor(masked, dtype=torch.long)))
        if c.bias_ids is not None:
            biased.append((row, c.bias_ids, c.bias_values))
        if k.repetition_penalty != 1.0 or k.frequency_penalty or k.presence_penalty:
            out = torch.tensor(c.output_ids, dtype=torch.long)
            if k.repetition_penalty != 1.0:
                repeated.append((row, torch.cat((c.prompt_ids, out))))
                repetition.append(k.repetition_penalty)
            if (k.frequency_penalty or k.presence_penalty) and len(out):
                outputs.append((row, out))
                frequency.append(k.frequency_penalty)
                presence.append(k.presence_penalty)
    if allowed:
        which = torch.tensor([row for row, _ in allowed], device=device)
        keep = torch.zeros(len(allowed), scores.shape[-1], dtype=torch.bool, device=device)
        local, ids = _flat([(i, t) for i, (_, t) in enumerate(allowed)], device)
        keep[local, ids] = True
        scores[which] = scores[which].masked_fill(~keep, _NEG_INF)
    if banned:
        scores.index_put_(_flat(banned, device), torch.tensor(_NEG_INF, device=device))
    if biased:
        pieces = [(row, ids) for row, ids, _ in biased]
        scores.index_put_(_flat(pieces, device), torch.cat([v for _, _, v in biased]).to(device), accumulate=True)
    if repeated:
        # A token seen twice is changed once: every duplicate entry writes the same value, made from the
        # score before the change.
        index = _flat(repeated, device)
        penalty = _per_entry(repeated, repetition, device)
        seen = scores[index]
        scores[index] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if outputs:
        index = _flat(outputs, device)
        # presence: once per distinct token (duplicate entries write the same value); frequency: once
        # per occurrence (accumulated over duplicates).
        scores[index] = scores[index] - _per_entry(outputs, presence, device)
        scores.index_put_(index, -_per_entry(outputs, frequency, device), accumulate=True)
    return scores
