"""Execution slots: N threads, each bound to one device stream for its life,
running the jobs handed to it one at a time. The model is shared; each thread
keeps only its own caches and buffers (inside the jobs it runs)."""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable

import torch

from .device import StreamBinding

log = logging.getLogger("xllm_async.executor")


class ExecutionSlot:
    """One thread, one stream. Jobs are plain callables; they never touch asyncio
    objects and hand results back through loop.call_soon_threadsafe themselves."""

    def __init__(self, index: int, device: torch.device, cpu_threads: int, nice: int = 0,
                 all_threads: int = 0) -> None:
        self.index = index
        self.binding = StreamBinding(device, cpu_threads, all_threads)
        self.nice = nice  # how much lower than the event loop this thread runs (see lower_priority)
        self.native_id = 0  # the OS thread id, once started
        # Written by the scheduler code running on this thread; read when metrics are scraped.
        self.busy_seconds = 0.0
        self.batches_run = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"xllm-slot-{index}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        log.info("execution slot %d bound to %s, nice +%d", self.index, self._description, self.nice)

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def call(self, fn: Callable[[], object]) -> object:
        """Run fn on this slot's thread (its stream, its thread-local state) and return what it
        returns, or raise what it raised. Blocks: for start-up, before any batch runs."""
        done = threading.Event()
        result: list = [None, None]

        def job() -> None:
            try:
                result[0] = fn()
            except BaseException as exc:  # noqa: BLE001  (handed to the caller)
                result[1] = exc
            finally:
                done.set()

        self.submit(job)
        done.wait()
        if result[1] is not None:
            raise result[1]
        return result[0]

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        # Before binding: the intra-op threads this thread starts inherit its priority.
        lower_priority(self.nice)
        self.binding.enter()
        self._description = self.binding.describe()
        self._ready.set()
        try:
            while (job := self._jobs.get()) is not None:
                try:
                    job()
                except Exception:  # a job maps its own failures to answers; this is a last guard
                    log.exception("execution slot %d: job failed", self.index)
        finally:
            self.binding.exit()


def lower_priority(nice: int) -> None:
    """Run the calling thread `nice` steps below the process (Linux, where each thread has
    its own niceness; elsewhere, or where it is refused, it keeps the process's).

    Why slots run below the event loop: on CPU the slot threads keep the cores busy, and a
    loop thread that waits for a core delays every answer, every admission and, through
    them, the next batches. nice 5 served more than 0 under both schedulers, and 10 no more
    than 5 (measured: perf/history/RESULTS-sessions-1-23.md, XLLM_SLOT_NICE).
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
    except OSError as exc:
        log.debug("slot thread keeps its priority: %s", exc)


def start_slots(device: torch.device, count: int, cpu_threads: int = 0, nice: int = 0) -> list[ExecutionSlot]:
    """count slot threads; on CPU each gets cpu_threads intra-op threads (0: cores // count,
    so that N slots share the cores instead of fighting over all of them; with 0, a slot whose
    siblings are idle may use every core: StreamBinding.share_cores), and runs nice steps below
    the process (lower_priority)."""
    cores = os.cpu_count() or 1
    threads = cpu_threads or max(1, cores // count)
    # Only slot 0 may take every core while alone. Each slot thread keeps an OpenMP pool of its
    # own, and once two slots had each grown theirs to every core, libgomp counted more threads
    # than cores and a lone slot ran no faster on all of them than on its share
    # (perf/experiments/lone_slot.sh). The scheduler hands slot 0 the next batch whenever it is idle.
    slots = [ExecutionSlot(i, device, threads, nice, cores if i == 0 and not cpu_threads else 0)
             for i in range(count)]
    for slot in slots:
        slot.start()
    return slots
