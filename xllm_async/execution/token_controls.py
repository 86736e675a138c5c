"""Token controls (logit_bias, allowed_token_ids, bad_words, min_tokens and the three penalties)
applied to a batch's logits at once, with vLLM's semantics and order.

Each request that sets any of them gets a RowControls at admission (prepare.py): its fixed parts
as arrays (bias ids and values, allowed ids, its prompt's distinct tokens) and its growing output,
kept as an array one new token a step. Every step, apply_controls gathers the rows' index lists
into one flat position tensor per kind of control (numpy builds them) and changes the scores with
one index op per kind: Python runs once per controlled row (and per bad word), never over the
vocabulary. Rows without controls keep their values exactly, so that they sample as they would
in a batch without any.
"""

from __future__ import annotations

import numpy as np
import torch

from ..engine.params import TokenControls

_NEG_INF = float("-inf")


class RowControls:
    """One request's controls as the sampler needs them each step."""

    __slots__ = ("controls", "output_ids", "bias_ids", "bias_values", "allowed", "prompt_ids", "stop_ids",
                 "banned", "bad_sequences", "penalized", "_history", "_filled")

    def __init__(self, controls: TokenControls, prompt_ids: list[int], output_ids: list[int],
                 stop_ids: frozenset[int]) -> None:
        self.controls = controls
        self.output_ids = output_ids  # the request's own list: it grows as the request appends
        bias = controls.logit_bias
        self.bias_ids = np.fromiter(bias, np.int64, len(bias)) if bias else None
        self.bias_values = np.fromiter(bias.values(), np.float32, len(bias)) if bias else None
        self.allowed = np.unique(np.asarray(controls.allowed, np.int64)) if controls.allowed is not None else None
        # The repetition penalty covers the prompt's tokens: each distinct one, found once here.
        self.prompt_ids = (np.unique(np.asarray(prompt_ids, np.int64))
                           if controls.repetition_penalty != 1.0 else None)
        self.stop_ids = sorted(stop_ids)  # masked while the output is shorter than min_tokens
        # A one-token bad word is always masked; a longer one's last token when its others end the output.
        self.banned = sorted({word[0] for word in controls.bad_words if len(word) == 1})
        self.bad_sequences = [(list(word[:-1]), word[-1]) for word in controls.bad_words if len(word) > 1]
        self.penalized = bool(controls.repetition_penalty != 1.0 or controls.frequency_penalty
                              or controls.presence_penalty)
        # The output as an array, extended by the tokens appended since the last step (converting
        # the whole list every step would cost more than all the rest as outputs grow).
        self._history = np.empty(64, np.int64)
        self._filled = 0

    def history(self) -> np.ndarray:
        """The output's token ids so far."""
        out, filled = self.output_ids, self._filled
        if len(out) > filled:
            if len(out) > len(self._history):
                grown = np.empty(max(2 * len(self._history), len(out)), np.int64)
                grown[:filled] = self._history[:filled]
                self._history = grown
            self._history[filled:len(out)] = out[filled:]
            self._filled = len(out)
        return self._history[:len(out)]

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


class _Entries:
    """(row, token ids, value per entry) pieces gathered over the rows, made into flat positions
    (row * vocab + id) and values with one numpy call each, then one tensor each."""

    __slots__ = ("starts", "ids", "values", "counts")

    def __init__(self) -> None:
        self.starts, self.ids, self.values, self.counts = [], [], [], []

    def add(self, start: int, ids: np.ndarray, value) -> None:
        """value: one per entry (an array) or one for all of them (a number)."""
        self.starts.append(start)
        self.ids.append(ids)
        self.values.append(value)
        self.counts.append(len(ids))

    def positions(self, device: torch.device) -> torch.Tensor:
        flat = np.repeat(np.asarray(self.starts, np.int64), self.counts) + np.concatenate(self.ids)
        return torch.from_numpy(flat).to(device)

    def per_entry(self, device: torch.device) -> torch.Tensor:
        if isinstance(self.values[0], np.ndarray):
            values = np.concatenate(self.values)
        else:
            values = np.repeat(np.asarray(self.values, np.float32), self.counts)
        return torch.from_numpy(values).to(device)


def apply_controls(logits: torch.Tensor, rows: list[RowControls | None]) -> torch.Tensor:
    """The scores to choose from: logits [rows, vocab] with each row's controls applied, in vLLM's
    order: allowed ids, bad words, min_tokens, logit_bias, then the repetition, frequency and
    presence penalties; masked tokens get -inf. In place where logits are float32 (they are the
    step's own, and a copy of a wide batch's would cost more than the controls); a float32 copy
    otherwise. Rows without controls keep their values exactly."""
    scores = logits if logits.dtype == torch.float32 else logits.float()
    scores = scores.contiguous()
    flat = scores.view(-1)
    vocab, device = scores.shape[-1], scores.device
    allowed, banned, biased, repeated, outputs = _Entries(), _Entries(), _Entries(), _Entries(), _Entries()
    frequency, allowed_rows = [], []
    for row, c in enumerate(rows):
        if c is None:
            continue
        start = row * vocab
        if c.allowed is not None:
            allowed.add(start, c.allowed, 0.0)
            allowed_rows.append(row)
        masked = c.masked_now()
        if masked:
            banned.add(start, np.asarray(masked, np.int64), 0.0)
        if c.bias_ids is not None:
            biased.add(start, c.bias_ids, c.bias_values)
        if c.penalized:
            k, history = c.controls, c.history()
            if c.prompt_ids is not None:  # (a repetition penalty: prompt and output tokens)
                repeated.add(start, c.prompt_ids, k.repetition_penalty)
                repeated.add(start, history, k.repetition_penalty)
            if k.presence_penalty or k.frequency_penalty:
                outputs.add(start, history, k.presence_penalty)
                frequency.append(k.frequency_penalty)
    if allowed_rows:
        at = allowed.positions(device)
        kept = flat.index_select(0, at)
        scores.index_fill_(0, torch.tensor(allowed_rows, device=device), _NEG_INF)
        flat.index_copy_(0, at, kept)
    if banned.ids:
        flat.index_fill_(0, banned.positions(device), _NEG_INF)
    if biased.ids:
        flat.index_add_(0, biased.positions(device), biased.per_entry(device))
    if repeated.ids:
        # A token seen twice is changed once: every duplicate entry writes the same value, made from
        # the score before the change.
        at, penalty = repeated.positions(device), repeated.per_entry(device)
        seen = flat.index_select(0, at)
        flat.index_copy_(0, at, torch.where(seen > 0, seen / penalty, seen * penalty))
    if sum(outputs.counts):
        at = outputs.positions(device)
        # presence: once per distinct token (duplicate entries write the same value); frequency: once
        # per occurrence (added over duplicates).
        flat.index_copy_(0, at, flat.index_select(0, at) - outputs.per_entry(device))
        outputs.values = frequency
        flat.index_add_(0, at, -outputs.per_entry(device))
    return scores
