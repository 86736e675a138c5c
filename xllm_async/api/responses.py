"""OpenAI response shapes for completions and chat, streamed or whole."""

from __future__ import annotations

import itertools
import os
import time

import orjson

from ..engine.request import Delta

_ids = itertools.count(1)
_PROCESS = os.urandom(4).hex()  # ids unique across restarts without a uuid per request
DONE = b"data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{_PROCESS}{next(_ids):x}"


def token_id_text(token_id: int) -> str:
    """A token as vLLM's return_tokens_as_token_ids shows it in logprobs (any token, even one
    that is no whole character, can be told apart)."""
    return f"token_id:{token_id}"


class Choice:
    """One choice accumulated from its deltas (for the whole response and usage)."""

    __slots__ = ("parts", "tokens", "logprobs", "finish_reason", "error")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.tokens = 0
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.error: str | None = None

    def add(self, delta: Delta) -> None:
        if delta.text:
            self.parts.append(delta.text)
        if delta.token_id is not None:
            self.tokens += 1
        if delta.logprobs is not None:
            self.logprobs.append((delta.token_id, delta.logprobs))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.error = delta.error


class ResponseShape:
    """Builds the JSON of one request's response; subclasses say completion or chat."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, model: str, tokenizer, prefix: str, prompt_tokens: int, logprobs: bool) -> None:
        self.id = new_id(prefix)
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.streamed: dict[int, int] = {}  # a streamed completion's choices: characters of token text so far
        # With a prefix cache: a request per prompt, whose cached_tokens usage reports once they ran.
        self.cached_from: list | None = None

    def usage(self, choices: list[Choice]) -> dict:
        return self._usage(sum(c.tokens for c in choices))

    def _usage(self, completion: int) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self.prompt_tokens + completion}
        if self.cached_from is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(r.cached_tokens for r in self.cached_from)}
        return usage

    def response(self, choices: list[Choice]) -> bytes:
        return orjson.dumps({
            "id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
            "choices": [self.whole_choice(i, c) for i, c in enumerate(choices)], "usage": self.usage(choices),
        })

    def beam_response(self, selected: list[list[tuple]], with_items: bool) -> bytes:
        """Choices of beam searches: per prompt, its chosen (BeamResult, item ids) pairs, best first.
        The token ids name items, so every choice carries them; with an item table, `item_id` is
        the first item (in the table's order) that spells them and `item_ids` all of them."""
        choices = []
        completion_tokens = 0
        for pairs in selected:
            for beam, item_ids in pairs:
                choice = Choice()
                choice.parts.append(beam.text)
                # "stop" for a beam answered up to its EOS (api/vllm_beams.py's EndedBeam)
                choice.finish_reason = getattr(beam, "finish_reason", "length")
                body = self.whole_choice(len(choices), choice)
                body["token_ids"] = beam.token_ids
                body["cumulative_logprob"] = beam.cumulative_logprob
                if with_items:
                    body["item_id"] = item_ids[0] if item_ids else None
                    body["item_ids"] = item_ids
                choices.append(body)
                completion_tokens += len(beam.token_ids)
        return orjson.dumps({
            "id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
            "choices": choices, "usage": self._usage(completion_tokens),
        })

    def chunk(self, delta: Delta, first: bool) -> bytes:
        return self._event({"id": self.id, "object": self.chunk_object_name, "created": self.created,
                            "model": self.model, "choices": [self.delta_choice(delta, first)]})

    def usage_chunk(self, choices: list[Choice]) -> bytes:
        return self._event({"id": self.id, "object": self.chunk_object_name, "created": self.created,
                            "model": self.model, "choices": [], "usage": self.usage(choices)})

    @staticmethod
    def error_event(error: dict) -> bytes:
        return b"data: " + orjson.dumps({"error": error}) + b"\n\n"

    @staticmethod
    def _event(payload: dict) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def whole_choice(self, index: int, choice: Choice) -> dict:
        raise NotImplementedError

    def delta_choice(self, delta: Delta, first: bool) -> dict:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    scoring = None  # set by score(): the prompts to echo or score, per choice

    def score(self, scoring, requests: list, choices: list[Choice]) -> None:
        """Echo and score the prompts of these finished choices (whole responses only)."""
        self.scoring = (scoring, requests)
        if scoring.no_output:  # max_tokens 0: the token generated is left out
            for choice in choices:
                choice.parts, choice.logprobs, choice.tokens, choice.finish_reason = [], [], 0, "length"

    def whole_choice(self, index: int, choice: Choice) -> dict:
        if self.scoring is not None:
            return self._scored_choice(index, choice)
        return {"index": index, "text": "".join(choice.parts),
                "logprobs": self._logprobs(choice.logprobs) if self.logprobs else None,
                "finish_reason": choice.finish_reason}

    def _scored_choice(self, index: int, choice: Choice) -> dict:
        scoring, requests = self.scoring
        n = len(requests) // len(scoring.texts)  # choices a prompt
        request = requests[index]
        prompt, scores = request.prompt_ids, requests[index - index % n].prompt_scores  # (scored once a prompt)
        text = "".join(choice.parts)
        logprobs = None
        if scoring.echo:
            sent = scoring.texts[index // n]
            text = (sent if sent is not None else self.tokenizer.decode(prompt)) + text
            if self.logprobs:
                # The prompt's tokens first: the first has no log-probability (nothing comes before it).
                texts = [self.token_text(t) for t in prompt]  # (one decode a token costs less than batch_decode)
                k = request.params.logprobs
                top = [None] + [self._top(alternatives[:k], texts[i + 1], lp)
                                for i, (alternatives, lp) in enumerate(zip(scores.top, scores.logprobs))]
                generated = self._logprobs(choice.logprobs, sum(map(len, texts)))
                logprobs = {"tokens": texts + generated["tokens"],
                            "token_logprobs": [None] + scores.logprobs + generated["token_logprobs"],
                            "top_logprobs": top + generated["top_logprobs"],
                            "text_offset": list(itertools.accumulate(map(len, texts[:-1]), initial=0))
                            + generated["text_offset"]}
        elif self.logprobs:
            logprobs = self._logprobs(choice.logprobs)
        body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        if scoring.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(prompt, scores, scoring.prompt_logprobs)
        return body

    def _prompt_logprobs(self, prompt: list[int], scores, k: int) -> list:
        """vLLM's prompt_logprobs: None for the first token, then per token {id: {logprob, rank,
        decoded_token}} for the prompt's own token and the k likeliest."""
        out: list = [None]
        for token, logprob, rank, alternatives in zip(prompt[1:], scores.logprobs, scores.ranks, scores.top):
            entry = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": self.token_text(token)}}
            for place, (t, v) in enumerate(alternatives[:k], 1):
                entry.setdefault(str(t), {"logprob": v, "rank": place, "decoded_token": self.token_text(t)})
            out.append(entry)
        return out

    def delta_choice(self, delta: Delta, first: bool) -> dict:
        logprobs = None
        if self.logprobs and delta.logprobs is not None:
            # text_offset counts from the start of the choice's text, as in the whole response.
            logprobs = self._logprobs([(delta.token_id, delta.logprobs)], self.streamed.get(delta.index, 0))
            self.streamed[delta.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return {"index": delta.index, "text": delta.text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}

    def _logprobs(self, entries: list, offset: int = 0) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, lp in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            top.append(self._top(lp.top, text, lp.logprob))
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _top(self, alternatives: list, text: str, logprob: float) -> dict:
        """The k likeliest and the token itself, as OpenAI answers ("up to logprobs + 1 elements")."""
        top = {self.token_text(t): v for t, v in alternatives}
        top.setdefault(text, logprob)
        return top


class ChatShape(ResponseShape):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def whole_choice(self, index: int, choice: Choice) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": "".join(choice.parts)},
                "logprobs": self._logprobs(choice.logprobs) if self.logprobs else None,
                "finish_reason": choice.finish_reason}

    def delta_choice(self, delta: Delta, first: bool) -> dict:
        # The role rides on the first chunk, together with the first text.
        message = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        logprobs = None
        if self.logprobs and delta.logprobs is not None:
            logprobs = self._logprobs([(delta.token_id, delta.logprobs)])
        return {"index": delta.index, "delta": message, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    def _logprobs(self, entries: list) -> dict:
        content = []
        for token_id, lp in entries:
            content.append({**self._entry(token_id, lp.logprob),
                            "top_logprobs": [self._entry(t, v) for t, v in lp.top]})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
