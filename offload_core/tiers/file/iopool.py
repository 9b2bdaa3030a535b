"""Daemon threads for blocking file I/O with bounded waits. Not `ThreadPoolExecutor`, which joins its workers at
interpreter exit: one `pread` stuck in the kernel (a dead NFS server) would hang the process for ever. Instead
`shutdown(timeout)` reports the jobs still running, for the caller to abandon with the buffers they write into."""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Dict, Iterable, List, Optional

from ...host.env import env_int, env_seconds

# Requests in flight per file store (docs/engine.md, "Layers, files and failures").
IO_DEPTH = env_int("KV_OFFLOAD_IO_DEPTH", 4, low=1, high=64)

# The longest one file operation (a layer's read or write, or the wait for one) may take before it counts as stuck.
IO_TIMEOUT_S = env_seconds("KV_OFFLOAD_IO_TIMEOUT_S", 120.0)

# Operations a consumer's wait for one load spans: the job ahead on its lane, the earlier load into its slot, the
# layer's write, a free staging buffer, the reads.
LOAD_STEPS = 5


def io_timeout() -> float:
    """`IO_TIMEOUT_S`, read at call time so that tests can change it."""
    return IO_TIMEOUT_S


def load_timeout() -> float:
    """The bound of a consumer's wait for one layer load, in units of `KV_OFFLOAD_IO_TIMEOUT_S` (600 s by default)."""
    return LOAD_STEPS * IO_TIMEOUT_S


class IOStuckError(TimeoutError):
    """An I/O job did not finish in time and may still be running: whatever buffer it uses must not be reused."""


class IOPool:
    """`workers` daemon threads running submitted jobs first-in-first-out (one worker: a strictly ordered lane)."""

    def __init__(self, workers: int, name: str):
        self.name = name
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._running: Dict[threading.Thread, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._taken: list = []  # jobs a shutdown took out of the queue and has not ended yet
        self._threads: List[threading.Thread] = []
        try:  # a pool that Ctrl-C stopped half made stops the threads it started (nobody else holds it to)
            for i in range(workers):
                self._threads.append(threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True))
                self._threads[-1].start()
        except BaseException:
            self.shutdown(0.0)
            raise

    @property
    def workers(self) -> int:
        return len(self._threads)

    def submit(self, fn: Callable, what: str, into: Optional[List[Future]] = None,
               done: Optional[Callable[[Future], object]] = None) -> Future:
        """Queues `fn()`; `what` (e.g. "the read of layer-00003.safetensors") names it in timeout reports. `into`
        gets the future and `done` is attached to it before the job is queued, so an interrupted loop of submits
        leaves every queued job in `into` for cleanup; `done` runs once the job has finished, failed or been
        cancelled (never while it runs): it owns whatever the job uses from then on."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"KV offload: I/O pool {self.name} is shut down; cannot run {what}.")
            if done is not None:
                future.add_done_callback(done)
            if into is not None:
                into.append(future)
            self._jobs.put((future, fn, what))
        return future

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            item = self._jobs.get()
            if item is None:
                return
            future, fn, what = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[me] = what
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits; the worker lives on
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._running.pop(me, None)
            del item, future, fn  # drop references to buffers before blocking on the next job

    def shutdown(self, timeout: float) -> List[str]:
        """Cancels queued jobs and waits up to `timeout` s for running ones; returns what is still running."""
        with self._lock:
            self._closed = True
        # All of it on every call: one that Ctrl-C stopped may have queued some stops, or none. A stop taken out here
        # is queued again below; one more than the threads left is never taken, which harms nothing.
        while True:
            try:
                self._taken.append(self._jobs.get_nowait())  # one line: a job out of the queue is never lost
            except queue.Empty:
                break
        while self._taken:
            item = self._taken[0]
            if item is not None and item[0].cancel():
                try:  # what a worker does with a cancelled job: `concurrent.futures.wait` on it wakes only then
                    item[0].set_running_or_notify_cancel()
                except RuntimeError:
                    pass  # marked already, by a call that Ctrl-C stopped before it let go of the job
            del self._taken[0]
        for _ in self._threads:  # one each, started or not (one whose start was interrupted may run yet)
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.ident is not None:  # started (a Ctrl-C may have stopped the pool's making before a start)
                thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return [self._running.get(t, "an unknown job") for t in self._threads if t.is_alive()]


def wait_all(futures: Iterable[Future], what: str, timeout: Optional[float] = None) -> list:
    """Results of `futures` in order; the first error is raised only once none of them runs, so the caller never
    reuses a buffer another job still writes into. On an error or timeout the jobs not started are cancelled; any
    still running when the time is up raises `IOStuckError`, and the caller must abandon its buffer."""
    futures = list(futures)
    limit = io_timeout() if timeout is None else timeout
    deadline = time.monotonic() + limit
    _, pending = cf.wait(futures, limit, return_when=cf.FIRST_EXCEPTION)
    if pending:  # one failed, or the time is up: the queued ones never start, the running ones are waited for
        for f in pending:
            f.cancel()
        _, pending = cf.wait(pending, max(0.0, deadline - time.monotonic()))
    if pending:
        error = next((f.exception() for f in futures if f.done() and not f.cancelled() and f.exception()), None)
        raise IOStuckError(f"KV offload: {what} did not finish within {limit:g} s ({len(pending)} of {len(futures)} "
                           "requests still running): the disk or network filesystem is not answering. Raise "
                           "KV_OFFLOAD_IO_TIMEOUT_S if it is only slow.") from error
    return [f.result() for f in futures]


def when_done(futures: Iterable[Future], then: Callable[[], object]) -> None:
    """Cancels the jobs of `futures` not yet started and calls `then()` once none is running any more, so cleanup
    never closes a descriptor (whose number may be recycled) or reuses a buffer that a running request still uses."""
    futures = [f for f in futures if not f.cancel() and not f.done()]
    if not futures:
        then()
        return
    left, lock = [len(futures)], threading.Lock()

    def one(_future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for f in futures:
        f.add_done_callback(one)
