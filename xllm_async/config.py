"""Settings: one dataclass, filled from XLLM_<NAME> environment variables and
--<name> flags (flags win), every value validated before anything starts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence

ENV_PREFIX = "XLLM_"


class ConfigError(Exception):
    """A bad setting; the message is one line naming the source, value and what is allowed."""


@dataclasses.dataclass
class Settings:
    model: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    devices: str = "auto"
    dtype: str = "auto"
    engine: str = "auto"
    quantization: str = "none"
    kv_cache_bytes: int | None = None
    graph_max_tokens: int = 8192
    scheduler: str = "fixed_steps"
    concurrent_execute_stream_num: int = 2
    torch_threads: int = 0
    slot_nice: int = 5
    max_tokens_per_batch: int = 8192
    max_seqs_per_batch: int = 256
    max_model_len: int | None = None
    max_queued_requests: int = 4096
    max_n: int = 64
    max_body_bytes: int = 16 * 1024 * 1024
    cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "xllm_async")
    queue_timeout: float = 0.0
    max_connections: int = 2048
    read_timeout: float = 30.0
    keep_alive_timeout: float = 30.0
    write_timeout: float = 30.0
    send_buffer_bytes: int = 0
    drain_timeout: float = 30.0
    api_key: str | None = None
    max_beam_width: int = 128
    max_num_return_sequences: int = 128
    max_beam_rounds: int = 64
    beam_max_tokens: int = 3
    item_table: str | None = None
    log_level: str = "info"
    access_log: str = "plain"
    metrics: str = "on"
    prefix_cache: str = "on"
    prefix_cache_share: float | None = None
    prefix_cache_admit: str = "second"
    kv_prefault: str = "off"


# --- value parsers: each returns the value or raises ValueError("what is allowed") ---

def _int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(allowed) from None
        if value < low or (high is not None and value > high):
            raise ValueError(allowed)
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("a number of seconds >= 0") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError("a number of seconds >= 0")
    return value


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in options:
            raise ValueError("one of " + ", ".join(options))
        return text.lower()

    return parse


_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?|npu(:\d+)?)$")


def _device(text: str) -> str:
    if not _DEVICE_RE.match(text.lower()):
        raise ValueError("auto, cpu, cuda:<index> or npu:<index>")
    return text.lower()


def _text(text: str) -> str:
    if not text.strip():
        raise ValueError("a non-empty string")
    return text


def _model_dir(text: str) -> str:
    path = os.path.expanduser(text)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError("a model folder that holds config.json")
    return path


_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?$", re.IGNORECASE)


def _bytes(text: str) -> int:
    """A size: 4000000000, 4G, 512MiB (powers of 1024 for K/M/G/T)."""
    match = _SIZE_RE.match(text.strip())
    if not match:
        raise ValueError("a size in bytes such as 4G or 512M")
    unit = 1024 ** ("kmgt".find(match.group(2).lower()) + 1) if match.group(2) else 1
    value = int(float(match.group(1)) * unit)
    if value < 1 << 20:
        raise ValueError("a size of at least 1M")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("a number between 0 and 1") from None
    if not 0 < value < 1:
        raise ValueError("a number between 0 and 1")
    return value


def _optional(parse: Callable[[str], object]) -> Callable[[str], object]:
    return lambda text: None if text == "" else parse(text)


# name -> (parser, help). The defaults live on the dataclass.
_OPTIONS: dict[str, tuple[Callable[[str], object], str]] = {
    "model": (_optional(_model_dir),
              "model folder (config.json, safetensors, tokenizer); unset = SmolLM2-135M-Instruct"),
    "served_model_name": (_optional(_text), "name clients pass as `model` (default: the folder's name)"),
    "host": (_text, "address to listen on; 0.0.0.0 exposes the server to the network"),
    "port": (_int_range(1, 65535), "TCP port"),
    "devices": (_device, "auto (NPU, else CUDA, else CPU), cpu, cuda:N or npu:N"),
    "dtype": (_choice("auto", "float32", "bfloat16", "float16"),
              "weights and activations dtype; auto = on CPU bfloat16 where the CPU has AMX or "
              "AVX512-BF16, else float32; on accelerators the model's own"),
    "engine": (_choice("auto", "native", "transformers"),
               "model code: native (ours: Llama, Qwen2, Qwen3) or transformers; auto = native where supported"),
    "quantization": (_choice("none", "int8", "gguf"),
                     "CPU, our engine: the linear layers' weights kept quantized; int8 = made at load (GGUF's "
                     "Q8_0 blocks, the LM head too), gguf = the model's GGUF file's own blocks, as shipped"),
    "kv_cache_bytes": (_optional(_bytes), "key/value cache of all slots together (e.g. 4G); unset = 20% of host "
                                          "memory on CPU, 50% of free device memory on accelerators"),
    "graph_max_tokens": (_int_range(0), "CUDA and NPU: forwards of up to this many tokens replay graphs "
                                        "captured at start-up (per slot, cut at attention); 0 = off"),
    "scheduler": (_choice("fixed_steps", "continuous"),
                  "fixed_steps (batches run to completion on N slots) or continuous"),
    "concurrent_execute_stream_num": (_int_range(1, 64),
                                      "N execution streams/slots for fixed_steps (1 = a single worker)"),
    "torch_threads": (_int_range(0, 1024), "CPU only: intra-op threads per slot; 0 = cores // slots"),
    "slot_nice": (_int_range(0, 19), "Linux: slot threads run this much nicer than the event loop, "
                                     "so it answers promptly while they compute; 0 = same priority"),
    "max_tokens_per_batch": (_int_range(1), "prompt tokens one batch may prefill (padded ones on the "
                                            "transformers engine)"),
    "max_seqs_per_batch": (_int_range(1), "sequence budget of one batch"),
    "max_model_len": (_optional(_int_range(2)), "longest prompt + output in tokens (default: the model's)"),
    "max_queued_requests": (_int_range(1), "requests waiting for a batch before new ones get 503"),
    "max_n": (_int_range(1, 1024), "largest `n` (choices per prompt) a request may ask for"),
    "max_body_bytes": (_int_range(1024), "largest request body in bytes (413 beyond)"),
    "cache_dir": (_text, "where the default model is converted to once"),
    "queue_timeout": (_seconds, "a request still waiting for a batch after this many seconds gets 408; 0 = off"),
    "max_connections": (_int_range(1), "open connections; more are answered 503 and closed"),
    "read_timeout": (_seconds, "seconds a request may take to arrive whole (slow senders get 408)"),
    "keep_alive_timeout": (_seconds, "seconds an idle keep-alive connection stays open"),
    "write_timeout": (_seconds, "seconds a client may stop reading a stream before it is dropped"),
    "send_buffer_bytes": (_int_range(0), "kernel send buffer of each connection (SO_SNDBUF): what a client "
                                         "that stops reading holds before the write timeout starts; "
                                         "0 = the kernel's own sizing (net.ipv4.tcp_wmem)"),
    "drain_timeout": (_seconds, "on SIGTERM/SIGINT, seconds to finish admitted requests before exiting"),
    "api_key": (_optional(_text), "if set, every route but /health and /metrics needs "
                                  "`Authorization: Bearer <key>`"),
    "max_beam_width": (_int_range(1, 1024), "largest `beam_width` of a beam (recommendation) request"),
    "max_num_return_sequences": (_int_range(1, 1024), "largest `num_return_sequences` of a beam request"),
    "max_beam_rounds": (_int_range(1), "largest `max_tokens` (rounds) of a beam request; its beams' own caches "
                                       "count against XLLM_KV_CACHE_BYTES"),
    "beam_max_tokens": (_int_range(1), "rounds (item id length) of a beam request that sends no `max_tokens`"),
    "item_table": (_optional(_text), "file of `<item id><TAB><token ids>` lines, all of one length; beam searches then "
                                      "return only items, each choice with its `item_id` and `item_ids`; SIGHUP "
                                      "reloads it"),
    "log_level": (_choice("debug", "info", "warning", "error"), "logging level"),
    "access_log": (_choice("plain", "json", "off"), "one line per request: plain text, JSON lines, or off"),
    "metrics": (_choice("on", "off"), "Prometheus metrics at /metrics (off only to measure what they cost)"),
    "prefix_cache": (_choice("on", "off"), "our engine: keep prompts' keys and values after their prefill, and "
                                           "prefill a prompt from the end of its longest cached prefix (blocks of "
                                           "32 tokens, least recently used evicted); its store lives in the "
                                           "part of XLLM_KV_CACHE_BYTES that running requests do not use "
                                           "(XLLM_PREFIX_CACHE_SHARE)"),
    "prefix_cache_share": (_optional(_fraction), "with XLLM_PREFIX_CACHE=on: unset, on a CPU the prefix cache "
                                                 "holds whatever of XLLM_KV_CACHE_BYTES the slots' caches have not "
                                                 "reached and gives it back as they reach further (each slot's "
                                                 "cache as large as with the prefix cache off), on an accelerator "
                                                 "half of it; a fraction: that share, taken from the slots' caches"),
    "prefix_cache_admit": (_choice("second", "all"), "with XLLM_PREFIX_CACHE=on: which prompts' blocks the prefix "
                                                     "cache keeps: second, a block seen before (by an earlier prompt, "
                                                     "or another of its batch), or any of a prompt whose keys go into "
                                                     "a slot's cache anyway (more tokens out than one, beam rounds), "
                                                     "so that one-token prompts that never repeat write nothing into "
                                                     "it; all, every prompt's"),
    "kv_prefault": (_choice("off", "on"), "with XLLM_PREFIX_CACHE=on, on a CPU: on, the prefix cache's store (what "
                                          "of XLLM_KV_CACHE_BYTES the slots' caches have not reached) backed with "
                                          "memory at start-up, as vLLM and SGLang allocate theirs, so that no "
                                          "request pays for a page's first touch (where a VM's host backs memory "
                                          "on first touch, ~2.5 s a GB); start-up takes that time and the "
                                          "budget is resident from the start; off, taken as it is used"),
}


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def load_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from the environment, then flags. Raises ConfigError on the first bad value."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="server.py", description="xllm_async OpenAI-compatible server")
    for name, (_, help_text) in _OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), "--" + name, dest=name, default=None,
                            metavar="VALUE",  # (argparse formats help with %: "20%" would break --help)
                            help=f"{help_text} [env {env_name(name)}]".replace("%", "%%"))
    args = parser.parse_args(argv)
    values = {}
    for name, (parse, _) in _OPTIONS.items():
        flag = getattr(args, name)
        if flag is not None:
            source, raw = "--" + name.replace("_", "-"), flag
        else:
            source, raw = env_name(name), environ.get(env_name(name))
        if raw is None:
            continue
        try:
            values[name] = parse(raw)
        except ValueError as exc:
            raise ConfigError(f"invalid {source}={raw!r}: expected {exc}") from None
    return Settings(**values)


def options_table() -> str:
    """The README's settings table, generated so it cannot drift from the code."""
    defaults = Settings()
    rows = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    for name, (_, help_text) in _OPTIONS.items():
        default = getattr(defaults, name)
        shown = "~/.cache/xllm_async" if name == "cache_dir" else ("(unset)" if default is None else default)
        shown = "off" if name == "queue_timeout" else shown
        rows.append(f"| `{env_name(name)}` | `--{name.replace('_', '-')}` | `{shown}` | {help_text} |")
    return "\n".join(rows)


def update_readme(path: str = "README.md") -> None:
    """Rewrite the settings table between its markers in the README."""
    with open(path) as f:
        text = f.read()
    start, end = "<!-- settings table -->\n", "<!-- /settings table -->"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    with open(path, "w") as f:
        f.write(head + start + options_table() + "\n" + end + tail)


if __name__ == "__main__":  # python -m xllm_async.config: refresh the README's table
    update_readme()
