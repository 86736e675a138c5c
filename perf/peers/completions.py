"""OpenAI `/v1/completions` over a plain transformers model: the part both peer servers share,
so that they differ only in how they serve (LitServe's batching loop, or FastAPI with a thread
pool) and not in how they generate or what they send back.

Generation is `model.generate` with greedy decoding on a left-padded batch with its attention
mask; a batch runs until its longest request is done, each row cut to its own `max_tokens`
(or its first EOS, unless `ignore_eos`). Sampling is not implemented: `temperature` must be 0
(the default here), which is what perf/bench_serving.py sends.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

DONE = "data: [DONE]\n\n"
_ids = itertools.count(1)


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The fields of an OpenAI completions request that the peers honour; others are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[int] | str
    max_tokens: int = Field(16, ge=1)
    temperature: float = 0.0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: list[int] | str) -> list[int] | str:
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("temperature")
    @classmethod
    def _greedy_only(cls, temperature: float) -> float:
        if temperature != 0.0:
            raise ValueError("the peer servers decode greedily only: temperature must be 0")
        return temperature


class Completion:
    """One request: its prompt ids and limits, the tokens it has got, and the OpenAI JSON or SSE
    text they make. `push` and `close` return what to send now ('' for nothing)."""

    def __init__(self, request: CompletionRequest, prompt_ids: list[int], model: CausalLM) -> None:
        self.prompt_ids = prompt_ids
        self.max_tokens = request.max_tokens
        self.stop_on_eos = not request.ignore_eos
        self.stream = request.stream
        self.include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._model = model
        self._sent = ""  # streamed text so far
        self._closed = False
        self._head = {"id": f"cmpl-{os.getpid():x}{next(_ids):x}", "object": "text_completion",
                      "created": int(time.time()), "model": model.name}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> str:
        """Takes the next generated token (ignored once the request has what it asked for)."""
        if self.finished:
            return ""
        self.tokens.append(token)
        if self.stop_on_eos and token in self._model.eos_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
        if not self.stream:
            return self.close() if self.finished else ""
        text = self.text()
        # a byte-level token may end inside a UTF-8 character: hold it back until the character is whole
        delta = "" if text.endswith("\ufffd") and not self.finished else text[len(self._sent):]
        self._sent += delta
        piece = self._event([{"index": 0, "text": delta, "logprobs": None, "finish_reason": None}]) if delta else ""
        return piece + self.close() if self.finished else piece

    def close(self) -> str:
        """The end of the response: the whole JSON body, or the last SSE events and [DONE]; '' the second time."""
        if self._closed:
            return ""
        self._closed = True
        self.finish_reason = self.finish_reason or "length"
        if not self.stream:
            return json.dumps(self.response())
        events = self._event([{"index": 0, "text": "", "logprobs": None, "finish_reason": self.finish_reason}])
        if self.include_usage:
            events += self._event([], usage=self.usage())
        return events + DONE

    def text(self) -> str:
        return self._model.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def usage(self) -> dict:
        prompt, completion = len(self.prompt_ids), len(self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def response(self) -> dict:
        choice = {"index": 0, "text": self.text(), "logprobs": None, "finish_reason": self.finish_reason}
        return {**self._head, "choices": [choice], "usage": self.usage()}

    def _event(self, choices: list[dict], **extra) -> str:
        return f"data: {json.dumps({**self._head, 'choices': choices, **extra})}\n\n"


class RowLimits(StoppingCriteria):
    """Stops each row of a batch at its own max_tokens, or at its first EOS when it asked to.

    (No `eos_token_id` attribute: generate would take it for its own EOS criterion and pad the
    finished rows, which we cut off anyway.)
    """

    def __init__(self, rows: list[Completion], width: int, eos_ids: list[int]) -> None:
        self.width = width
        self.max_tokens = torch.tensor([row.max_tokens for row in rows])
        self.stop_on_eos = torch.tensor([row.stop_on_eos for row in rows])
        self.eos = torch.tensor(eos_ids or [-1])
        self.hit_eos = torch.zeros(len(rows), dtype=torch.bool)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.hit_eos |= torch.isin(input_ids[:, -1], self.eos) & self.stop_on_eos
        return self.hit_eos | (input_ids.shape[1] - self.width >= self.max_tokens)


class StepCallback(BaseStreamer):
    """generate's streamer hook: skips the prompt it is handed first, then passes on each step's tokens."""

    def __init__(self, on_step: Callable[[list[int]], None]) -> None:
        self.on_step = on_step
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.on_step(value.tolist())
        self.prompt_seen = True

    def end(self) -> None:
        pass


class CausalLM:
    """A model folder loaded with transformers on the CPU, in its own dtype, torch's default threads."""

    def __init__(self, model_dir: str, name: str | None = None) -> None:
        self.model_dir = os.path.abspath(model_dir)
        self.name = served_name(model_dir, name)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype="auto", local_files_only=True).eval()
        config = self.model.generation_config
        eos = config.eos_token_id if config.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.pad_id = next(i for i in (config.pad_token_id, self.tokenizer.pad_token_id, min(self.eos_ids, default=0))
                           if i is not None)
        # EOS is handled per row by RowLimits: generate's own EOS stop would end rows that ignore it
        config.eos_token_id = None
        config.pad_token_id = self.pad_id

    def completion(self, request: CompletionRequest) -> Completion:
        prompt = request.prompt
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        return Completion(request, ids, self)

    def generate(self, rows: list[Completion], on_step: Callable[[list[int]], None]) -> None:
        """Greedy decoding of the rows as one left-padded batch; on_step gets each step's token of
        every row (finished rows included), on this thread, as the step ends."""
        width = max(len(row.prompt_ids) for row in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row.prompt_ids):] = torch.tensor(row.prompt_ids)
            mask[i, width - len(row.prompt_ids):] = 1
        self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                            max_new_tokens=max(row.max_tokens for row in rows),
                            stopping_criteria=StoppingCriteriaList([RowLimits(rows, width, sorted(self.eos_ids))]),
                            streamer=StepCallback(on_step))


def served_name(model_dir: str, name: str | None = None) -> str:
    """The name clients pass as `model`: the folder's name unless one is given (as server.py does)."""
    return name or os.path.basename(os.path.abspath(model_dir))


def models_list(model_dir: str, name: str | None, owned_by: str) -> dict:
    """The body of GET /v1/models."""
    return {"object": "list", "data": [{"id": served_name(model_dir, name), "object": "model",
                                        "root": os.path.abspath(model_dir), "owned_by": owned_by}]}


def server_parser(description: str, port: int) -> argparse.ArgumentParser:
    """The command line every peer server starts with: the model, its name, where to listen."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (config.json, safetensors, tokenizer)")
    parser.add_argument("--served-model-name", help="default: the folder's name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    return parser
