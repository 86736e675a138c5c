"""Serving benchmark: random prompts of exact token lengths sent to any OpenAI-compatible
server (xllm_async, vLLM, SGLang), reported in the "Serving Benchmark Result" table that
vLLM's and SGLang's bench_serving print, so the numbers line up side by side.

    python perf/bench_serving.py --random-input 1024 --random-output 128 --num-prompts 200 \\
        --max-concurrency 32 --output-file perf/results/bench.jsonl

Dataset. Prompt and output lengths are drawn uniformly from [len * ratio, len]
(`--random-range-ratio`, default 1.0: every prompt has exactly the asked length; SGLang's
default is 0.0). A prompt is a list of random ordinary (non-special) token ids of the served
model's tokenizer, read from a local folder: nothing is downloaded. `--prompt-format ids`
sends the ids as `prompt`; `--prompt-format text` sends text that the tokenizer encodes to
exactly the drawn number of tokens (see `text_of_length`), which chat needs. The count is
the prompt's own tokens: a tokenizer that prepends BOS, or a chat template, adds its tokens
on the server. Every request asks `max_tokens` = its drawn output length with
`ignore_eos: true` and `temperature: 0`, so outputs have the asked length.

Timing (perf_counter, from just before the request is written; each piece of the body is
stamped when the reader gets it, before its events are parsed):
- E2E latency: until the last piece of the response arrived (vLLM's definition: the client's
  own parsing after that is not the server's latency);
- TTFT: until the first SSE event carrying non-empty text (`choices[0].text`, or
  `choices[0].delta.content` on chat); without streaming, the whole latency;
- ITL: the gaps between successive events carrying text;
- TPOT: (latency - TTFT) / (output tokens - 1), for requests with more than one token;
- output tokens: `usage.completion_tokens` (streams ask for it with
  `stream_options.include_usage`); "retokenized" counts the returned text with the tokenizer;
- Concurrency: the sum of the latencies over the duration.

A request fails on a status other than 200, a broken connection, an error event, or a stream
that ends without `[DONE]`. Failures are counted and the first error is printed; every other
figure is computed over the successful requests.

`--dataset-name generated-shared-prefix` is SGLang's dataset of that name (`--gsp-num-groups`
system prompts of `--gsp-system-prompt-len` tokens, `--gsp-prompts-per-group` questions of
`--gsp-question-len` after each, `--gsp-output-len` tokens out; shuffled): what a prefix cache
is for. Defaults 16 x 16, 1,024 + 64 tokens in, 16 out.

Generative recommendation (`--beam-width`, `--num-return-sequences`): beam searches over
token-id prompts, whole responses, `--random-output` rounds. With an item table they return
items: `--item-table-out PATH` writes a semantic-id table (`--item-table-items` items of
`--item-codebooks` codes, each code one of `--item-codes`; codebook c spells code k as token
base + c * codes + k, with base the first ordinary token id from 1000 on that leaves the whole
range free of special tokens) and exits; the server loads it (`server.py --item-table PATH`), and
`--item-table PATH` here sends `max_tokens` = its item length and checks every returned choice
against it. The table then adds items/s (choices with an `item_id`), the share of the asked
items (requests x `num_return_sequences`) that came back, and the invalid ones (a choice without
an `item_id`, or whose tokens or id are not the table's): 0 on a server that searches the table.

    python perf/bench_serving.py --item-table-out items.tsv --item-table-items 5000 --tokenizer MODEL
    python server.py --model MODEL --item-table items.tsv &
    python perf/bench_serving.py --item-table items.tsv --beam-width 16 --num-return-sequences 16 \\
        --random-input 1000 --num-prompts 50 --max-concurrency 8

HTTP is a small HTTP/1.1 client: an asyncio.Protocol per connection whose bytes httptools
parses as they arrive (Content-Length, chunked and read-until-close bodies, keep-alive),
one connection per concurrent worker. It shares the cores with the server it measures, so
it is built to cost little: a reader wakes once per arrival, not once per line. Needs
httptools and numpy (both installed with the server). Sweeps reuse `benchmark()` in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httptools
import numpy as np

try:  # orjson parses the many small SSE events several times faster: the client must not be the bottleneck
    from orjson import loads as json_loads
except ImportError:
    from json import loads as json_loads

def run(coroutine):
    """asyncio.run on uvloop when it is installed: the client shares the machine with the server,
    so every microsecond it spends per request is taken from the server being measured."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


# --- dataset ---------------------------------------------------------------------------------

TEXT_ROUNDS = 10  # decode -> encode -> cut/pad rounds before starting over; two suffice almost always
TEXT_ATTEMPTS = 10  # fresh starts before giving up


class Prompt(NamedTuple):
    """One request of the dataset: token ids or text, its token count, the output tokens to ask for."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


def load_tokenizer(path: str):
    """The tokenizer saved in a local model folder (never downloaded)."""
    from transformers import AutoTokenizer  # heavy: imported only when a dataset is built

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def ordinary_token_ids(tokenizer) -> list[int]:
    """The base vocabulary without special tokens: a random <|im_end|> would mean something."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def draw_length(rng: random.Random, length: int, range_ratio: float) -> int:
    return rng.randint(max(int(length * range_ratio), 1), length)


def text_of_length(tokenizer, ids: list[int], vocab: list[int], rng: random.Random) -> str:
    """Text that the tokenizer encodes to exactly len(ids) tokens.

    Random ids rarely survive decode -> encode (byte-level pieces merge or split), so the
    re-encoded ids are cut to the length, or padded with fresh random ids, and decoded again
    until the count holds. If a text never settles, start over from new random ids.
    """
    target = len(ids)
    for _ in range(TEXT_ATTEMPTS):
        for _ in range(TEXT_ROUNDS):
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == target:
                return text
            ids = ids[:target] + rng.choices(vocab, k=max(target - len(ids), 0))
        ids = rng.choices(vocab, k=target)
    raise ValueError(f"found no text of exactly {target} tokens in {TEXT_ATTEMPTS} attempts")


def make_random_prompts(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 1.0,
                        seed: int = 0, prompt_format: str = "ids") -> list[Prompt]:
    """num prompts of random ordinary tokens; the same seed gives the same prompts."""
    if prompt_format not in ("ids", "text"):
        raise ValueError(f"prompt_format must be 'ids' or 'text', got {prompt_format!r}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be within [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    vocab = ordinary_token_ids(tokenizer)
    prompts = []
    for _ in range(num):
        prompt_len = draw_length(rng, input_len, range_ratio)
        out_len = draw_length(rng, output_len, range_ratio)
        ids = rng.choices(vocab, k=prompt_len)
        prompt = ids if prompt_format == "ids" else text_of_length(tokenizer, ids, vocab, rng)
        prompts.append(Prompt(prompt, prompt_len, out_len))
    return prompts


# generated-shared-prefix as the peers' comparison runs it: system prompt, question, questions a group
SHARED_PREFIX = (1024, 64, 16)


def make_shared_prefix_prompts(tokenizer, groups: int, per_group: int, system_len: int, question_len: int,
                               output_len: int, seed: int = 0, prompt_format: str = "ids") -> list[Prompt]:
    """SGLang's `generated-shared-prefix` dataset: `groups` system prompts of system_len random
    tokens, each followed by per_group questions of question_len; shuffled (groups interleave, as
    users of several applications arrive). A server with a prefix cache computes each system prompt
    once; one without computes it per request. Token ids only: text re-drawn to an exact length
    would no longer share its prefix token for token."""
    if prompt_format != "ids":
        raise ValueError("the generated-shared-prefix dataset is sent as token ids (prompt_format 'ids')")
    rng = random.Random(seed)
    vocab = ordinary_token_ids(tokenizer)
    prompts = []
    for _ in range(groups):
        system = rng.choices(vocab, k=system_len)
        for _ in range(per_group):
            ids = system + rng.choices(vocab, k=question_len)
            prompts.append(Prompt(ids, len(ids), output_len))
    rng.shuffle(prompts)
    return prompts


# --- item tables (generative recommendation) ---------------------------------------------------

ITEM_BASE_FROM = 1000  # past the byte-level pieces at the start of most vocabularies


class ItemTable(NamedTuple):
    """Semantic ids: each item's token ids (all of one length) -> its item id."""

    items: dict[tuple[int, ...], str]

    @property
    def item_length(self) -> int:
        return len(next(iter(self.items)))


def item_token_base(tokenizer, span: int) -> int:
    """The first token id from ITEM_BASE_FROM on (lower on a small vocabulary) that starts `span`
    ordinary ids: a special token inside an item would mean something else to the model."""
    special = set(tokenizer.all_special_ids)
    for base in range(min(ITEM_BASE_FROM, max(tokenizer.vocab_size - span, 0)), tokenizer.vocab_size - span + 1):
        if not special.intersection(range(base, base + span)):
            return base
    raise ValueError(f"the vocabulary ({tokenizer.vocab_size} ids) has no {span} consecutive ordinary ids")


def make_item_table(count: int, codebooks: int, codes: int, base: int, seed: int = 0) -> ItemTable:
    """count distinct items of `codebooks` codes drawn uniformly, as residual quantisers lay them out:
    codebook c spells code k as token base + c * codes + k. Item ids are item-00000, item-00001..."""
    if codebooks < 1 or codes < 1 or not 1 <= count <= codes ** codebooks:
        raise ValueError(f"{count} items cannot be spelt with {codebooks} codebooks of {codes} codes")
    rng = random.Random(seed)
    keys: set[tuple[int, ...]] = set()
    while len(keys) < count:
        keys.add(tuple(base + c * codes + rng.randrange(codes) for c in range(codebooks)))
    width = len(str(count - 1))
    return ItemTable({key: f"item-{i:0{max(width, 5)}d}" for i, key in enumerate(sorted(keys))})


def write_item_table(path: str, table: ItemTable, comment: str = "") -> None:
    """`<item id><TAB><token ids>` lines, the format `server.py --item-table` loads."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        if comment:
            f.write(f"# {comment}\n")
        f.writelines(f"{item}\t{' '.join(map(str, key))}\n" for key, item in table.items.items())


def read_item_table(path: str) -> ItemTable:
    """The table write_item_table wrote (or any file of that format; `#` lines are comments)."""
    items: dict[tuple[int, ...], str] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            item, _, tokens = line.partition("\t")
            try:
                key = tuple(int(t) for t in tokens.split())
            except ValueError:
                key = ()
            if not item or not key or (items and len(key) != len(next(iter(items)))):
                raise ValueError(f"{path}:{number}: not an '<item id><TAB><token ids>' line of the table's length")
            items[key] = item
    if not items:
        raise ValueError(f"{path}: no items")
    return ItemTable(items)


# --- HTTP/1.1 client -------------------------------------------------------------------------


class HttpError(Exception):
    """The server or the connection broke HTTP/1.1: the request fails and the connection is dropped."""


class _StaleConnection(Exception):
    """A kept-alive connection was closed before any byte of the response came back."""


class HttpResponse:
    """Status, headers, and the body as an async iterator of pieces in the order they arrive."""

    __slots__ = ("chunks", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], chunks: AsyncIterator[bytes]) -> None:
        self.status = status
        self.headers = headers
        self.chunks = chunks

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.chunks])


class _Response:
    """One response as its connection's parser fills it in: head, body pieces, the end."""

    __slots__ = ("status", "headers", "keep_alive", "until_close", "head_done", "pieces", "complete", "error")

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.until_close = False  # no length given: the body runs until the server closes
        self.head_done = False
        self.pieces: list[bytes] = []  # body bytes not yet handed to the reader
        self.complete = False
        self.error: Exception | None = None


class _ClientProtocol(asyncio.Protocol):
    """httptools' callbacks for one connection: they fill in the response being read and wake its
    reader. The parser runs inside data_received, so a reader wakes once per arrival, however many
    headers, chunks or events it carried (a streams-based reader pays an await per line)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: _Response | None = None
        self.closed = False
        self._waiter: asyncio.Future | None = None

    async def wait(self) -> None:
        """Until more arrives for the current response, or the connection ends."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # asyncio callbacks

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing was asked: a server that talks out of turn
            self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.response.error = HttpError(f"bad response: {exc}")
            self.transport.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None and not response.complete and response.error is None:
            if response.until_close:
                response.complete = True
            elif response.head_done:
                response.error = HttpError("connection closed inside the response body")
        self._wake()

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        response = self.response
        response.status = self.parser.get_status_code()
        response.keep_alive = self.parser.should_keep_alive()
        headers = response.headers
        response.until_close = "content-length" not in headers and "chunked" not in headers.get(
            "transfer-encoding", "").lower() and response.status not in (204, 304)
        response.head_done = True

    def on_body(self, body: bytes) -> None:
        self.response.pieces.append(body)

    def on_message_complete(self) -> None:
        self.response.complete = True


class HttpConnection:
    """One keep-alive HTTP/1.1 connection, opened on first use; its requests go one after another.

    The body of a response must be read to its end before the next request; one that was not
    leaves the connection out of step, and the next request opens a fresh one.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._protocol: _ClientProtocol | None = None
        self._busy = False  # a response is still being read

    async def request(self, method: str, path: str, body: bytes = b"") -> HttpResponse:
        if self._busy:
            self.close()
        if self._protocol is not None and not self._protocol.closed:
            try:
                return await self._exchange(method, path, body)
            except _StaleConnection:  # the server dropped the idle connection: resend once on a new one
                self.close()
        _, self._protocol = await asyncio.get_running_loop().create_connection(
            _ClientProtocol, self.host, self.port)
        try:
            return await self._exchange(method, path, body)
        except _StaleConnection:
            raise HttpError("connection closed before the response") from None

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None
        self._busy = False

    async def _exchange(self, method: str, path: str, body: bytes) -> HttpResponse:
        protocol = self._protocol
        response = protocol.response = _Response()
        head = (f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
        protocol.transport.write(head + body)
        while not response.head_done:
            if response.error is not None:
                raise response.error
            if protocol.closed:
                raise _StaleConnection
            await protocol.wait()
        self._busy = True
        return HttpResponse(response.status, response.headers, self._body(protocol, response))

    async def _body(self, protocol: _ClientProtocol, response: _Response) -> AsyncIterator[bytes]:
        """What arrived since the last piece, as one piece (events that came together stay together)."""
        while True:
            if response.pieces:
                piece = b"".join(response.pieces)
                response.pieces.clear()
                yield piece
            elif response.error is not None:
                raise response.error
            elif response.complete:
                break
            else:
                await protocol.wait()
        self._busy = False
        if not response.keep_alive or protocol.closed:
            self.close()


class SseParser:
    """Splits a byte stream into the data of Server-Sent Events, whatever the piece boundaries."""

    __slots__ = ("_buffer", "_data")

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []

    def feed(self, piece: bytes) -> list[bytes]:
        """The data of each event that this piece completed."""
        *lines, self._buffer = (self._buffer + piece).split(b"\n")
        events = []
        for line in lines:
            line = line.rstrip(b"\r")
            if not line:  # a blank line ends an event
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            # comments and the event/id/retry fields carry nothing we measure
        return events


# --- one request -----------------------------------------------------------------------------


@dataclass
class RequestResult:
    """What one request measured; times in seconds from just before the request was written."""

    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int | None = 0  # None: the server sent no usage; count_retokenized fills it in
    retokenized_len: int = 0
    generated_text: str = ""
    error: str = ""
    # whole responses: each choice's (item_id, token_ids) as beam searches return them (None, () elsewhere)
    choices: list[tuple[str | None, tuple[int, ...]]] = field(default_factory=list)


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def request_body(prompt: Prompt, *, model: str, chat: bool, stream: bool, extra: dict | None = None) -> bytes:
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.output_len, "temperature": 0.0,
                            "ignore_eos": True, "stream": stream, **(extra or {})}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def event_text(event: dict, chat: bool) -> str:
    """The text a streamed chunk carries ('' for role-only, finish and usage chunks)."""
    choices = event.get("choices")
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def whole_text(response: dict, chat: bool) -> str:
    if not response["choices"]:  # answered, with nothing in it (an item search that found no item)
        return ""
    choice = response["choices"][0]
    return (choice["message"].get("content") or "") if chat else (choice.get("text") or "")


def error_message(body: bytes) -> str:
    """The message of an OpenAI error body (or the start of whatever the body is)."""
    try:
        error = json_loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return body[:200].decode("utf-8", "replace")


async def send_request(conn: HttpConnection, path: str, body: bytes, prompt_len: int, *,
                       chat: bool, stream: bool) -> RequestResult:
    """One request, timed; any failure becomes the result's error, never an exception."""
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    end = None  # when the last piece of the response arrived
    try:
        response = await conn.request("POST", path, body)
        if response.status != 200:
            result.error = f"HTTP {response.status}: {error_message(await response.read())}"
        elif stream:
            end = await read_stream(response, result, start, chat)
        else:
            data = await response.read()
            end = time.perf_counter()
            whole = json_loads(data)
            result.generated_text = whole_text(whole, chat)
            result.output_len = (whole.get("usage") or {}).get("completion_tokens")
            result.choices = [(c.get("item_id"), tuple(c.get("token_ids") or ())) for c in whole["choices"]]
    except Exception as exc:  # noqa: BLE001  (whatever broke, the request fails with the reason)
        conn.close()
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = (end or time.perf_counter()) - start
    if not result.ttft:  # not streamed, or no text came: the first text arrived with the end
        result.ttft = result.latency
    result.success = not result.error
    return result


async def read_stream(response: HttpResponse, result: RequestResult, start: float, chat: bool) -> float:
    """Reads SSE events to the end, filling in the timings, text, usage or the first error;
    returns when the last piece arrived."""
    parser = SseParser()
    parts: list[str] = []
    last = now = start
    done = False
    async for piece in response.chunks:
        now = time.perf_counter()  # events in one piece arrived together
        for data in parser.feed(piece):
            if data == b"[DONE]":
                done = True
                continue
            event = json_loads(data)
            if "error" in event:
                # keep reading: the stream still ends properly and the connection stays usable
                result.error = result.error or f"error event: {error_message(data)}"
                continue
            if event.get("usage"):
                result.output_len = event["usage"].get("completion_tokens")
            text = event_text(event, chat)
            if text:
                if parts:
                    result.itl.append(now - last)
                else:
                    result.ttft = now - start
                last = now
                parts.append(text)
    result.generated_text = "".join(parts)
    if not done and not result.error:
        result.error = "stream ended without [DONE]"
    return now


def count_retokenized(results: list[RequestResult], tokenizer) -> None:
    """After the run, so that tokenizing does not slow the client while it measures."""
    for result in results:
        result.retokenized_len = len(tokenizer.encode(result.generated_text, add_special_tokens=False))
        if result.output_len is None:  # the server reports no usage: the text is all we have
            result.output_len = result.retokenized_len


# --- the run ---------------------------------------------------------------------------------


class BenchmarkError(Exception):
    """The benchmark cannot run (no model, no tokenizer, a failed warm-up): one line for the user."""


class ProgressBar:
    """One line on stderr, redrawn at most ten times a second."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total = total
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self._drawn = 0.0

    def update(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self._drawn >= 0.1 or self.done == self.total:
            self._drawn = now
            filled = self.width * self.done // self.total
            elapsed = max(now - self.start, 1e-9)
            sys.stderr.write(f"\r|{'#' * filled}{'.' * (self.width - filled)}| {self.done}/{self.total} "
                             f"[{elapsed:.1f} s, {self.done / elapsed:.2f} req/s]")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def split_base_url(base_url: str) -> tuple[str, int, str]:
    """(host, port, path prefix) of http://host:port[/prefix]."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise BenchmarkError(f"--base-url must be http://host:port, got {base_url!r}")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


async def feed_arrivals(queue: asyncio.Queue, items: list, request_rate: float, rng: random.Random,
                        workers: int) -> None:
    """Queues the requests at Poisson arrival times (all at once when the rate is infinite),
    then one stop per worker. Times count from the start, so a slow loop does not drift."""
    start = time.perf_counter()
    arrival = 0.0
    for item in enumerate(items):
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        queue.put_nowait(item)
        if math.isfinite(request_rate):
            arrival += rng.expovariate(request_rate)
    for _ in range(workers):
        queue.put_nowait(None)


Send = Callable[[HttpConnection, bytes, int], Awaitable[RequestResult]]


async def run_requests(connections: list[HttpConnection], bodies: list[bytes], prompt_lens: list[int], send: Send,
                       request_rate: float, seed: int, progress: bool) -> tuple[list[RequestResult], float]:
    """Each connection is a worker taking the next arrived request; returns the results in
    prompt order and the duration from the first arrival to the last answer."""
    queue: asyncio.Queue = asyncio.Queue()
    results: dict[int, RequestResult] = {}
    bar = ProgressBar(len(bodies)) if progress else None

    async def worker(conn: HttpConnection) -> None:
        while (item := await queue.get()) is not None:
            index, body = item
            results[index] = await send(conn, body, prompt_lens[index])
            if bar is not None:
                bar.update()

    start = time.perf_counter()
    tasks = [asyncio.create_task(worker(conn)) for conn in connections]
    await feed_arrivals(queue, bodies, request_rate, random.Random(seed), len(connections))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return [results[i] for i in range(len(bodies))], duration


async def benchmark(base_url: str, prompts: list[Prompt], *, tokenizer, model: str,
                    endpoint: str = "/v1/completions", max_concurrency: int | None = None,
                    request_rate: float = math.inf, stream: bool = True, backend: str = "openai",
                    seed: int = 0, warmup_requests: int = 0, progress: bool = False,
                    extra_body: dict | None = None, keep_texts: bool = False,
                    item_table: ItemTable | None = None) -> dict:
    """Sends every prompt, then returns compute_metrics' figures plus the run's configuration.

    max_concurrency None means one connection per prompt. The first warmup_requests prompts are
    sent once, one by one, before the clock starts; a failed warm-up raises BenchmarkError.
    keep_texts adds "generated_texts": each prompt's answer in prompt order (None where it failed),
    for comparing the answers of two servers. item_table adds item_metrics' figures, the returned
    choices checked against it (`num_return_sequences` of extra_body is what each request asked).
    """
    if not prompts:
        raise BenchmarkError("no prompts to send")
    chat = is_chat(endpoint)
    if chat and not all(isinstance(p.prompt, str) for p in prompts):
        raise BenchmarkError("chat endpoints take text: build the prompts with prompt_format='text'")
    host, port, prefix = split_base_url(base_url)
    path = prefix + endpoint
    # The bodies are built before the clock starts: the client should measure the server, not JSON encoding.
    bodies = [request_body(p, model=model, chat=chat, stream=stream, extra=extra_body) for p in prompts]
    prompt_lens = [p.prompt_len for p in prompts]

    async def send(conn: HttpConnection, body: bytes, prompt_len: int) -> RequestResult:
        return await send_request(conn, path, body, prompt_len, chat=chat, stream=stream)

    connections = [HttpConnection(host, port) for _ in range(min(max_concurrency or len(prompts), len(prompts)))]
    try:
        for body, prompt_len in zip(bodies[:warmup_requests], prompt_lens):
            warm = await send(connections[0], body, prompt_len)
            if not warm.success:
                raise BenchmarkError(f"warm-up request failed: {warm.error}")
        results, duration = await run_requests(connections, bodies, prompt_lens, send, request_rate, seed, progress)
    finally:
        for conn in connections:
            conn.close()
    count_retokenized(results, tokenizer)
    metrics = compute_metrics(results, duration)
    if item_table is not None:
        metrics.update(item_metrics(results, item_table, (extra_body or {}).get("num_return_sequences", 1), duration))
    metrics.update(backend=backend, base_url=base_url, endpoint=endpoint, model=model, num_prompts=len(prompts),
                   max_concurrency=max_concurrency, request_rate="inf" if math.isinf(request_rate) else request_rate,
                   stream=stream, date=datetime.now().isoformat(timespec="seconds"))
    if keep_texts:
        metrics["generated_texts"] = [r.generated_text if r.success else None for r in results]
    return metrics


# --- figures ---------------------------------------------------------------------------------

STATS = ("mean", "median", "p90", "p99")


def summarize(name: str, seconds: list[float]) -> dict[str, float]:
    """mean/median/p90/p99 of the values in ms (numpy's linear percentiles; 0.0 when there are none)."""
    if not seconds:
        return {f"{stat}_{name}_ms": 0.0 for stat in STATS}
    ms = np.asarray(seconds, dtype=float) * 1000.0
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p90_{name}_ms": float(np.percentile(ms, 90)), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def compute_metrics(results: list[RequestResult], duration: float) -> dict:
    """The table's figures over the successful requests; failures are counted, their first error kept."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    latencies = [r.latency for r in ok]
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else "",
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_output_tokens_retokenized": sum(r.retokenized_len for r in ok),
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "concurrency": sum(latencies) / duration,
    }
    metrics.update(summarize("e2e_latency", latencies))
    metrics.update(summarize("ttft", [r.ttft for r in ok]))
    metrics.update(summarize("tpot", [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]))
    metrics.update(summarize("itl", [gap for r in ok for gap in r.itl]))
    return metrics


def item_metrics(results: list[RequestResult], table: ItemTable, asked_per_request: int, duration: float) -> dict:
    """Items over the successful requests: returned (choices with an item_id), their share of the asked
    ones, and the invalid choices (no item_id, or tokens and id that are not one of the table's items)."""
    ok = [r for r in results if r.success]
    returned = sum(item is not None for r in ok for item, _ in r.choices)
    invalid = sum(item is None or table.items.get(tokens) != item for r in ok for item, tokens in r.choices)
    asked = len(ok) * asked_per_request
    return {"items_asked": asked, "items_returned": returned, "item_share": returned / asked if asked else 0.0,
            "invalid_items": invalid, "item_throughput": returned / duration}


SECTIONS = (("End-to-End Latency", "e2e_latency", "E2E Latency"), ("Time to First Token", "ttft", "TTFT"),
            ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"), ("Inter-Token Latency", "itl", "ITL"))


def format_table(metrics: dict) -> str:
    """The "Serving Benchmark Result" table, laid out as vLLM's and SGLang's bench_serving print it."""
    def row(label: str, value: Any) -> str:
        return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}"

    lines = [f"{' Serving Benchmark Result ':=^50}",
             row("Backend:", metrics["backend"]),
             row("Traffic request rate:", metrics["request_rate"]),
             row("Max request concurrency:", metrics["max_concurrency"] or "not set"),
             row("Successful requests:", metrics["completed"]),
             row("Failed requests:", metrics["failed"])]
    if metrics["failed"]:
        lines.append(row("First error:", " ".join(metrics["first_error"].split())[:200]))
    lines += [row("Benchmark duration (s):", metrics["duration"]),
              row("Total input tokens:", metrics["total_input_tokens"]),
              row("Total generated tokens:", metrics["total_output_tokens"]),
              row("Total generated tokens (retokenized):", metrics["total_output_tokens_retokenized"]),
              row("Request throughput (req/s):", metrics["request_throughput"]),
              row("Input token throughput (tok/s):", metrics["input_throughput"]),
              row("Output token throughput (tok/s):", metrics["output_throughput"]),
              *([row("Beam throughput (beams/s):", metrics["beam_throughput"])] if "beam_throughput" in metrics
                else []),
              *([row("Item throughput (items/s):", metrics["item_throughput"]),
                 row("Items returned (% of asked):", 100.0 * metrics["item_share"]),
                 row("Invalid items:", metrics["invalid_items"])] if "item_throughput" in metrics else []),
              row("Total token throughput (tok/s):", metrics["total_throughput"]),
              row("Concurrency:", metrics["concurrency"])]
    for title, key, label in SECTIONS:
        lines.append(f"{title:-^50}")
        lines += [row(f"{stat.capitalize()} {label} (ms):", metrics[f"{stat}_{key}_ms"]) for stat in STATS]
    lines.append("=" * 50)
    return "\n".join(lines)


def append_json_line(path: str, metrics: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(metrics) + "\n")


# --- command line ----------------------------------------------------------------------------


async def fetch_model_info(base_url: str) -> dict:
    """The first entry of GET /v1/models (id, owned_by, root...)."""
    host, port, prefix = split_base_url(base_url)
    conn = HttpConnection(host, port)
    try:
        response = await conn.request("GET", prefix + "/v1/models")
        body = await response.read()
    except (OSError, HttpError) as exc:
        raise BenchmarkError(f"cannot ask {base_url}/v1/models: {exc}") from None
    finally:
        conn.close()
    if response.status != 200:
        raise BenchmarkError(f"{base_url}/v1/models answered {response.status}: {error_message(body)}")
    models = json_loads(body).get("data") or []
    if not models:
        raise BenchmarkError(f"{base_url}/v1/models lists no model")
    return models[0]


def tokenizer_path(args: argparse.Namespace, info: dict) -> str:
    path = args.tokenizer or args.model_path or info.get("root")
    if not path or not os.path.isdir(path):
        raise BenchmarkError(f"no local tokenizer folder (tried {path!r}): pass --tokenizer or --model-path "
                             "(nothing is downloaded)")
    return path


async def run_benchmark(args: argparse.Namespace) -> dict:
    """The whole run the command line asks for: discover, build the dataset, send, measure."""
    known = args.model and args.backend and (args.tokenizer or args.model_path)
    info = {} if known else await fetch_model_info(args.base_url)
    model = args.model or info["id"]
    tokenizer = load_tokenizer(tokenizer_path(args, info))
    prompt_format = args.prompt_format or ("text" if is_chat(args.endpoint) else "ids")
    extra_body = None
    if args.beam_width:  # the rec workload: beam search answers at the end, so no streaming
        extra_body = {"beam_width": args.beam_width, "num_return_sequences": args.num_return_sequences}
        args.stream = False
    items = None
    if args.item_table:
        if not args.beam_width:
            raise BenchmarkError("--item-table needs --beam-width: items come back from beam searches")
        items = read_item_table(args.item_table)
        args.random_output = items.item_length  # one round per codebook: the server refuses any other max_tokens
    if args.dataset_name == "generated-shared-prefix":
        prompts = make_shared_prefix_prompts(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                             args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
                                             args.seed, prompt_format)
    else:
        prompts = make_random_prompts(tokenizer, args.num_prompts, args.random_input, args.random_output,
                                      args.random_range_ratio, args.seed, prompt_format)
    if items is not None:  # whatever the range ratio drew
        prompts = [p._replace(output_len=items.item_length) for p in prompts]
    metrics = await benchmark(
        args.base_url, prompts, tokenizer=tokenizer, model=model, endpoint=args.endpoint,
        max_concurrency=args.max_concurrency, request_rate=args.request_rate, stream=args.stream,
        backend=args.backend or info.get("owned_by") or "openai", seed=args.seed,
        warmup_requests=args.warmup_requests, progress=not args.disable_progress, extra_body=extra_body,
        item_table=items,
    )
    if args.beam_width:
        metrics.update(beam_width=args.beam_width, num_return_sequences=args.num_return_sequences,
                       beam_throughput=metrics["request_throughput"] * args.beam_width)
    if items is not None:
        metrics.update(item_table=os.path.abspath(args.item_table), item_count=len(items.items),
                       item_length=items.item_length)
    if args.dataset_name == "generated-shared-prefix":
        metrics.update(dataset_name=args.dataset_name, gsp=[args.gsp_num_groups, args.gsp_prompts_per_group,
                                                             args.gsp_system_prompt_len, args.gsp_question_len,
                                                             args.gsp_output_len])
    metrics.update(random_input=args.random_input, random_output=args.random_output,
                   random_range_ratio=args.random_range_ratio, prompt_format=prompt_format, seed=args.seed)
    return metrics


def raise_open_file_limit() -> None:
    """One socket per worker: unlimited concurrency over many prompts needs more than 1024 descriptors."""
    try:
        import resource

        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass  # keep the limit we have; too many workers then fail with their own error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="http://host:port, without /v1")
    server.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    server.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    server.add_argument("--backend", help="label for the table (default: owned_by of GET /v1/models)")
    data = parser.add_argument_group("dataset")
    data.add_argument("--tokenizer", help="local tokenizer folder (default: --model-path, else the served "
                                          "model's root from /v1/models when that is a local folder)")
    data.add_argument("--model-path", help="local folder of the served model, for its tokenizer")
    data.add_argument("--dataset-name", choices=("random", "generated-shared-prefix"), default="random",
                      help="random prompts, or SGLang's shared system prompts (the --gsp-* flags)")
    data.add_argument("--gsp-num-groups", type=int, default=16, help="system prompts")
    data.add_argument("--gsp-prompts-per-group", type=int, default=16, help="questions after each")
    data.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    data.add_argument("--gsp-question-len", type=int, default=64)
    data.add_argument("--gsp-output-len", type=int, default=16)
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--random-input", type=int, default=1024, help="prompt tokens")
    data.add_argument("--random-output", type=int, default=128, help="output tokens")
    data.add_argument("--random-range-ratio", type=float, default=1.0,
                      help="lengths drawn uniformly in [len * ratio, len]; 1.0 = exact lengths")
    data.add_argument("--prompt-format", choices=("ids", "text"),
                      help="token ids or text of the exact length (default: ids on completions, text on chat)")
    data.add_argument("--seed", type=int, default=0)
    traffic = parser.add_argument_group("traffic")
    traffic.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: all)")
    traffic.add_argument("--request-rate", type=float, default=math.inf,
                         help="Poisson arrivals per second (default: inf, all at once)")
    traffic.add_argument("--no-stream", dest="stream", action="store_false", help="whole responses, no SSE")
    traffic.add_argument("--warmup-requests", type=int, default=1, help="sent one by one before the clock starts")
    rec = parser.add_argument_group("generative recommendation (beam search; --random-output = rounds)")
    rec.add_argument("--beam-width", type=int, help="beams per request (turns streaming off)")
    rec.add_argument("--num-return-sequences", type=int, default=1, help="best sequences returned per request")
    rec.add_argument("--item-table", help="the server's item table: max_tokens = its item length, choices checked "
                                          "against it, items/s reported")
    rec.add_argument("--item-table-out", help="write a semantic-id table here and exit (nothing is sent)")
    rec.add_argument("--item-table-items", type=int, default=5000, help="items of the written table")
    rec.add_argument("--item-codebooks", type=int, default=3, help="codes (tokens) per item")
    rec.add_argument("--item-codes", type=int, default=256, help="codes per codebook")
    rec.add_argument("--item-token-base", type=int,
                     help="token id of codebook 0's code 0 (default: found in the tokenizer's ordinary ids)")
    out = parser.add_argument_group("output")
    out.add_argument("--output-file", help="append the figures and the configuration as one JSON line")
    out.add_argument("--disable-progress", action="store_true")
    return parser


def write_table(args: argparse.Namespace) -> str:
    """--item-table-out: the table written, and one line saying what it holds."""
    span = args.item_codebooks * args.item_codes
    base = args.item_token_base
    if base is None:
        base = item_token_base(load_tokenizer(tokenizer_path(args, {})), span)
    table = make_item_table(args.item_table_items, args.item_codebooks, args.item_codes, base, args.seed)
    what = (f"{len(table.items)} items of {args.item_codebooks} codebooks x {args.item_codes} codes, "
            f"tokens {base}..{base + span - 1}, seed {args.seed}")
    write_item_table(args.item_table_out, table, what)
    return f"{args.item_table_out}: {what}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    raise_open_file_limit()
    try:
        if args.item_table_out:
            print(write_table(args))
            return 0
        metrics = run(run_benchmark(args))
    except (BenchmarkError, ValueError, OSError) as exc:  # a setting the run cannot use: one line, no traceback
        print(f"bench_serving: {exc}", file=sys.stderr)
        return 1
    print(format_table(metrics))
    if args.output_file:
        append_json_line(args.output_file, metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
