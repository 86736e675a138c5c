"""The running server as one object: builds the parts from Settings, starts
them, drains and stops them. server.py and in-process tests both use it."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time

import torch

from .api.app import OpenAIApp
from .api.items import ItemTable, ItemTableError
from .api.model_info import BeamLimits, ModelInfo
from .config import ConfigError, Settings
from .engine.engine import Engine
from .execution.steps import Execution
from .http.protocol import HttpLimits
from .http.server import HttpServer
from .metrics import Counter, Gauge, Metrics, ProcessFigures
from .runtime.default_model import default_model_dir
from .runtime.device import DeviceError, resolve_device
from .runtime.executor import start_slots
from .runtime.host_memory import TrimSchedule, heap_trimmer
from .runtime.model_runner import ModelRunner, load_runner
from .testing.hold import maybe_hold

log = logging.getLogger("xllm_async.server")
TRIM_INTERVAL = 5.0  # seconds between two malloc_trim calls while requests run
TRIM_TICK = 1.0  # how often the trimmer looks (TrimSchedule: once idle for a whole look, it trims)


def resident_memory_bytes() -> int:
    with open("/proc/self/statm") as f:  # Linux only: the second field is resident pages
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Service:
    def __init__(self, settings: Settings, runner: ModelRunner | None = None) -> None:
        """Load the model (unless one is given) and start the execution slots.
        Must run inside the event loop that will serve."""
        # The loop's thread keeps one intra-op thread for its whole life: a parallel torch
        # operation there (building the item table's masks was one) starts an OpenMP team for it,
        # and from then on every slot's forward runs slower (host_memory.one_intra_op_thread).
        # Slots set their own count.
        torch.set_num_threads(1)
        self.settings = settings
        self._trim = None
        self._trim_handle: asyncio.TimerHandle | None = None
        self._trim_schedule = TrimSchedule(TRIM_INTERVAL)
        self._reload_task: asyncio.Task | None = None  # the item table reload in progress, if any
        # The rounds a beam request runs when it sends no max_tokens must be within the limit.
        if settings.beam_max_tokens > settings.max_beam_rounds:
            raise ConfigError(f"invalid XLLM_MAX_BEAM_ROUNDS={settings.max_beam_rounds}: expected at least "
                              f"XLLM_BEAM_MAX_TOKENS ({settings.beam_max_tokens})")
        try:
            device = resolve_device(settings.devices)
        except DeviceError as exc:
            raise ConfigError(str(exc)) from None
        model_dir = settings.model or default_model_dir(settings.cache_dir)
        # maybe_hold: the runner itself, unless a test asked for a hold on its forwards (testing/hold.py).
        try:
            runner = runner or load_runner(model_dir, device, settings.dtype, settings.engine, settings.quantization)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.runner = maybe_hold(runner)
        if settings.max_model_len is not None:
            if settings.max_model_len > self.runner.max_model_len:
                raise ConfigError(f"invalid XLLM_MAX_MODEL_LEN={settings.max_model_len}: "
                                  f"expected at most the model's {self.runner.max_model_len}")
            self.runner.max_model_len = settings.max_model_len
        try:  # checked against the model's vocabulary, so after the model
            self.items = self._load_items() if settings.item_table else None
        except ItemTableError as exc:
            raise ConfigError(f"invalid XLLM_ITEM_TABLE: {exc}") from None

        continuous = settings.scheduler == "continuous"
        num_slots = 1 if continuous else settings.concurrent_execute_stream_num
        prefix_share = settings.prefix_cache_share if settings.prefix_cache == "on" else 0.0
        self.runner.set_kv_cache(settings.kv_cache_bytes, num_slots, prefix_share, settings.prefix_cache_admit)
        if settings.kv_prefault == "on" and self.runner.prefix_store is not None:
            began = time.monotonic()
            self.runner.prefix_store.populate()
            log.info("prefix cache: its store backed with memory in %.1f s (XLLM_KV_PREFAULT=on)",
                     time.monotonic() - began)
        if self.runner.kv_tokens and self.runner.kv_tokens < self.runner.max_model_len:
            raise ConfigError(f"invalid XLLM_KV_CACHE_BYTES={settings.kv_cache_bytes}: a slot's cache holds "
                              f"{self.runner.kv_tokens} tokens, less than one sequence of XLLM_MAX_MODEL_LEN="
                              f"{self.runner.max_model_len}; give it more bytes or lower XLLM_MAX_MODEL_LEN")
        if continuous and settings.concurrent_execute_stream_num != 1:
            log.info("continuous scheduler: one batch in flight on one slot "
                     "(XLLM_CONCURRENT_EXECUTE_STREAM_NUM applies to fixed_steps)")
        self.slots = start_slots(self.runner.device, num_slots,
                                 settings.torch_threads, settings.slot_nice)
        self._capture_graphs(settings.graph_max_tokens)
        self.runner.warm_up(settings.max_tokens_per_batch,
                    {n for slot in self.slots for n in (slot.binding.cpu_threads, slot.binding.all_threads)})
        self.metrics = Metrics(settings.metrics == "on")
        self.metrics.add(Gauge("model_load_seconds", "Seconds the model took to load.",
                               lambda: self.runner.load_seconds))
        self.engine = Engine(Execution(self.runner), self.slots, settings.scheduler, settings.max_seqs_per_batch,
                             settings.max_tokens_per_batch, settings.max_queued_requests, self.metrics,
                             settings.queue_timeout)
        self.name = settings.served_model_name or os.path.basename(os.path.normpath(model_dir))
        self.beam = beam = BeamLimits(not continuous, settings.max_beam_width, settings.max_num_return_sequences,
                                      settings.beam_max_tokens, self.items.item_length if self.items else 0,
                                      settings.max_beam_rounds)
        model = ModelInfo(self.name, self.runner.tokenizer, self.runner.vocab_size, self.runner.max_model_len,
                          settings.max_n, beam)
        info = {
            "model": self.name, "model_path": model_dir, "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."), "engine": self.runner.engine,
            "weights": self.runner.weights,
            "kv_cache_tokens_per_slot": self.runner.kv_tokens, "prefix_cache": self.runner.caches_prefixes,
            "scheduler": settings.scheduler,
            "concurrent_execute_stream_num": len(self.slots),
            "max_tokens_per_batch": settings.max_tokens_per_batch,
            "max_seqs_per_batch": settings.max_seqs_per_batch, "max_model_len": self.runner.max_model_len,
            "max_queued_requests": settings.max_queued_requests, "max_beam_width": settings.max_beam_width,
            "max_beam_rounds": settings.max_beam_rounds,
            "item_table": settings.item_table, "item_count": 0,  # the loaded table's figures: OpenAIApp.info
        }
        self.app = OpenAIApp(self.engine, model, info, settings.access_log, settings.api_key, self.items)
        limits = HttpLimits(settings.max_body_bytes, settings.max_connections, settings.read_timeout,
                            settings.keep_alive_timeout, settings.write_timeout, settings.send_buffer_bytes)
        self.http = HttpServer(self.app, limits, self.app.on_response)
        self.metrics.add(Gauge("http_connections_open", "Open client connections.",
                               lambda: len(self.http.connections)))
        if os.path.exists("/proc/self/statm"):
            self.metrics.add(Gauge("process_resident_memory_bytes", "Resident memory of this process.",
                                   resident_memory_bytes))
        self.metrics.add(ProcessFigures())
        store = self.runner.prefix_store  # (the gauges read 0 where the cache is off, as the dashboard expects them)
        self.metrics.add(Gauge("prefix_cache_bytes", "Bytes of XLLM_KV_CACHE_BYTES the prefix cache may hold now "
                                                     "(what the slots' caches have not reached, or its share).",
                               lambda: store.capacity * store.block_bytes if store else 0))
        self.metrics.add(Gauge("prefix_cache_usage_ratio", "Share of the prefix cache's blocks in use.",
                               lambda: store.used / store.capacity if store and store.capacity else 0.0))
        self.item_loads = Counter("item_table_loads_total", "Item table loads (start-up and SIGHUP), by result.",
                                  ("result",))
        self.metrics.add(self.item_loads)
        self.metrics.add(Gauge("item_table_items", "Items in the loaded item table.",
                               lambda: self.app.items.count if self.app.items else 0))
        if self.items is not None:
            self.item_loads.inc(1, "ok")

    def _load_items(self) -> ItemTable:
        started = time.monotonic()
        table = ItemTable.load(self.settings.item_table, self.runner.vocab_size, self.runner.device)
        if table.item_length > self.settings.max_beam_rounds:  # its searches could never run
            raise ItemTableError(f"{table.path}: items of {table.item_length} tokens; XLLM_MAX_BEAM_ROUNDS="
                                 f"{self.settings.max_beam_rounds} allows at most that many rounds")
        log.info("item table %s: %s, version %s, %.1f MB, loaded in %.2f s", table.path, table.summary(),
                 table.version, table.nbytes() / 1e6, time.monotonic() - started)
        return table

    def reload_items_soon(self) -> None:
        """A signal handler's call: start a reload and keep its task (the loop holds tasks weakly);
        one at a time."""
        if self._reload_task is not None and not self._reload_task.done():
            log.warning("SIGHUP: an item table reload is already running; this one is ignored")
            return
        self._reload_task = asyncio.get_running_loop().create_task(self.reload_items())

    async def reload_items(self) -> bool:
        """SIGHUP: read XLLM_ITEM_TABLE again, off the loop, and swap the new table in whole.
        Requests already admitted finish on the table they started with; a file that fails its
        checks leaves the old table serving."""
        if not self.settings.item_table:
            log.warning("SIGHUP: no item table to reload (XLLM_ITEM_TABLE is not set)")
            return False
        try:
            table = await asyncio.to_thread(self._load_items)
        except Exception as exc:  # noqa: BLE001  (whatever went wrong, the old table keeps serving)
            self.item_loads.inc(1, "error")
            log.error("item table reload failed, the old table stays: %s",
                      exc if isinstance(exc, ItemTableError) else f"{type(exc).__name__}: {exc}")
            return False
        self.items = self.app.items = table
        self.beam.item_length = self.beam.default_rounds = table.item_length
        self.item_loads.inc(1, "ok")
        return True

    def _capture_graphs(self, max_tokens: int) -> None:
        """On accelerators, each slot captures its graphs on its own thread and stream, one slot
        after another (a capture must not meet another thread's allocations)."""
        capture = self.runner.capture_graphs
        if not max_tokens:
            return
        for slot in self.slots:
            try:
                graphs = slot.call(lambda: capture(max_tokens))
            except Exception as exc:  # noqa: BLE001  (the plain forward serves: slower, never wrong)
                log.warning("slot %d: no graphs, its forwards run eagerly: %s: %s", slot.index, type(exc).__name__, exc)
                continue
            if graphs is not None:
                log.info("slot %d: %d graphs (%d row sizes up to %d, %d pieces each) captured in %.1f s", slot.index,
                         len(graphs.sizes) * (len(graphs.model.layers) + 1), len(graphs.sizes), graphs.max_rows,
                         len(graphs.model.layers) + 1, graphs.capture_seconds)

    async def start(self) -> None:
        s = self.settings
        try:
            await self.http.start(s.host, s.port)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {s.host}:{s.port}: {exc.strerror}") from None
        # What exists now (model, tokenizer, modules: hundreds of thousands of objects) lives as
        # long as the server. Frozen, the cyclic collector never rescans it: a full collection
        # would otherwise hold the GIL long enough to stall every slot.
        gc.collect()
        gc.freeze()
        self._trim = heap_trimmer()
        if self._trim is not None:
            self._trim_handle = asyncio.get_running_loop().call_later(TRIM_TICK, self._trim_heap)
        shown = {k: ("***" if k == "api_key" and v else v) for k, v in vars(s).items()}
        log.info("configuration: %s", ", ".join(f"{k}={v}" for k, v in shown.items()))
        log.info("serving %s on http://%s:%d (%s scheduler, %d slot(s), device %s)", self.name, s.host,
                 self.http.port, s.scheduler, len(self.slots), self.runner.device)

    def _trim_heap(self) -> None:
        """Free heap pages back to the system when TrimSchedule says (host_memory.py): a short
        pause of the loop, while slot threads go on (they wait only to allocate)."""
        loop = asyncio.get_running_loop()
        if self._trim_schedule.due(loop.time(), sum(slot.batches_run for slot in self.slots),
                                   bool(self.engine.unfinished)):
            self._trim()
        self._trim_handle = loop.call_later(TRIM_TICK, self._trim_heap)

    async def shutdown(self) -> None:
        """Stop accepting, let what was admitted finish within the drain time,
        answer the rest with a clear error, then stop the slots."""
        log.info("shutting down: no new connections; draining for up to %.0f s", self.settings.drain_timeout)
        self.app.draining = True
        self.http.stop_accepting()
        deadline = time.monotonic() + self.settings.drain_timeout
        while (self.engine.unfinished or self.http.busy) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.engine.unfinished:
            log.warning("drain time over: answering %d unfinished sequence(s) with an error",
                        len(self.engine.unfinished))
            self.engine.end_all("shutdown", "Server shut down before this request could finish")
            await asyncio.sleep(0.05)  # let the handlers write those answers
        self.http.close_all()
        if self._trim_handle is not None:
            self._trim_handle.cancel()
        await self.engine.stop()
        log.info("stopped")
