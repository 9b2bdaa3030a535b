"""A few daemon threads doing blocking file I/O, with bounded waits and a way to walk away from a stuck one.

`concurrent.futures.ThreadPoolExecutor` joins its workers at interpreter exit, so one `pread` stuck in the
kernel (a dead NFS server, a failing disk) would hang the process for ever. These workers are daemon
threads: `shutdown(timeout)` cancels queued jobs, waits a bounded time for running ones and reports what the
ones still running were doing, so the caller can abandon them (and the buffers they write into) and go on.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Dict, Iterable, List, Optional

from ...host.env import env_int, env_seconds

# Requests in flight per file store: enough to keep a disk's queue full, since one sequential stream leaves most
# disks below their limit (`python -m offload_core stream` measures the depth a disk needs).
IO_DEPTH = env_int("KV_OFFLOAD_IO_DEPTH", 4, low=1, high=64)

# The longest any single file operation (one layer's read or write, or the wait for one) may take before it
# counts as stuck. Read at call time, so tests (and users with slow network disks) can change it.
IO_TIMEOUT_S = env_seconds("KV_OFFLOAD_IO_TIMEOUT_S", 120.0)

# A consumer's wait for one load spans at most this many of those operations in a row: the job ahead of it on
# its lane, the earlier load into its slot, the layer's write, a free staging buffer, the reads.
LOAD_STEPS = 5


def io_timeout() -> float:
    return IO_TIMEOUT_S


def load_timeout() -> float:
    """The bound of a consumer's wait for one layer load, in units of `KV_OFFLOAD_IO_TIMEOUT_S` (600 s by default)."""
    return LOAD_STEPS * IO_TIMEOUT_S


class IOStuckError(TimeoutError):
    """An I/O job did not finish in time and may still be running: whatever buffer it uses must not be reused."""


class Then:
    """What a job returns to go on with `fn()` as the rest of the same job, on `pool`: the worker goes on to
    its next request at once (a chunk's checksum after its read or write runs on other threads, so hashing
    never keeps a request from the disk). A worker with no request waiting runs `fn()` itself. The job's
    future completes with `fn()`'s result."""

    __slots__ = ("fn", "pool")

    def __init__(self, fn: Callable, pool: "IOPool"):
        self.fn, self.pool = fn, pool


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
        """Queues `fn()`; `what` (e.g. "the read of layer-00003.safetensors") names it in timeout reports.

        With `into`, the future is appended to it before the job is queued: an interrupt anywhere in a loop of
        submits leaves every queued job in the list, for the caller's cleanup to wait for (or cancel). `done` is
        attached to the future before it is queued, too: it runs once the job has finished, failed or been
        cancelled (never while it runs), which makes it the one owner of whatever the job uses from then on.
        """
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"KV offload: I/O pool {self.name} is shut down; cannot run {what}.")
            if done is not None:
                future.add_done_callback(done)
            if into is not None:
                into.append(future)
            self._jobs.put((future, fn, what, False))
        return future

    def _continue(self, future: Future, fn: Callable, what: str) -> None:
        """Queues the rest of a job another pool started (its future is running already)."""
        with self._lock:
            queued = not self._closed
            if queued:
                self._jobs.put((future, fn, what, True))
        if not queued:
            future.set_exception(_shut(self.name, what))

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            item = self._jobs.get()
            if item is None:
                return
            future, fn, what, continued = item
            if not continued and not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[me] = what
            result = None
            try:
                result = fn()
                while isinstance(result, Then) and self._jobs.empty():
                    # No request waits for this worker: it goes on with the rest itself instead of waking a
                    # thread of the other pool (a wake-up costs 70 us on the 2-core machine; the last
                    # checksums of a `file_sync` layer lie between its last read and the next layer's first).
                    result = result.fn()
            except BaseException as exc:  # handed to whoever waits; the worker lives on
                future.set_exception(exc)
            else:
                if isinstance(result, Then):
                    result.pool._continue(future, result.fn, what)
                else:
                    future.set_result(result)
            finally:
                with self._lock:
                    self._running.pop(me, None)
            del item, future, fn, result  # drop references to buffers before blocking on the next job

    def shutdown(self, timeout: float) -> List[str]:
        """Cancels queued jobs and waits up to `timeout` s for running ones; returns what is still running."""
        with self._lock:
            self._closed = True
        # Every call, whole: a call that Ctrl-C stopped may have queued some of the stops, or none. A stop taken out
        # here is queued again below; one more than the threads left is never taken, which harms nothing.
        while True:
            try:
                self._taken.append(self._jobs.get_nowait())  # one line: a job out of the queue is never lost
            except queue.Empty:
                break
        while self._taken:
            item = self._taken[0]
            if item is not None and not item[0].cancel() and not item[0].done():  # a started job's rest ends here
                item[0].set_exception(_shut(self.name, item[2]))
            del self._taken[0]
        for _ in self._threads:  # one each, started or not (one whose start was interrupted may run yet)
            self._jobs.put(None)
        deadline = _now() + timeout
        for thread in self._threads:
            if thread.ident is not None:  # started (a Ctrl-C may have stopped the pool's making before a start)
                thread.join(max(0.0, deadline - _now()))
        with self._lock:
            return [self._running.get(t, "an unknown job") for t in self._threads if t.is_alive()]


    def join(self) -> None:
        """After `shutdown`: waits, without a bound, for every thread to end (a job stuck in the kernel returns)."""
        for thread in self._threads:
            if thread.ident is not None:
                thread.join()


def _shut(name: str, what: str) -> RuntimeError:
    return RuntimeError(f"KV offload: I/O pool {name} was shut down before {what} finished.")


def _now() -> float:
    import time

    return time.monotonic()


class _Latch:
    """Opens once every future of a batch is done, or as soon as one fails. Each future's result is taken by
    the thread that finishes it, so the waiter wakes once and finds them collected: `concurrent.futures.wait`
    instead installs and removes a waiter on every future, under all their locks, at each call (45 us for 20
    futures on the 2-core machine, about three times that right after the wait, and a `file_sync` read runs
    it on the way from one layer's last request to the next layer's first)."""

    __slots__ = ("results", "failed", "opened", "_left", "_lock")

    def __init__(self, futures: List[Future]):
        self.results: list = [None] * len(futures)
        self.failed = False
        self.opened = threading.Event()
        self._left = len(futures)
        self._lock = threading.Lock()
        if not futures:
            self.opened.set()
        for index, future in enumerate(futures):
            future.add_done_callback(functools.partial(self._done, index))

    def _done(self, index: int, future: Future) -> None:
        try:
            self.results[index] = future.result()
            failed = False
        except BaseException:  # its error, or its cancellation: the waiter reads them in order
            failed = True
        with self._lock:
            self._left -= 1
            self.failed = self.failed or failed
            if failed or not self._left:
                self.opened.set()


def wait_all(futures: Iterable[Future], what: str, timeout: Optional[float] = None) -> list:
    """Results of `futures` in order; the first error is raised only once none of them is still running.

    A job that fails early must not let the caller reuse a buffer the other jobs still write into: on an error
    the jobs not yet started are cancelled and the running ones waited for. If any is still running when the
    time is up, `IOStuckError` says so, and the caller must abandon the buffer.
    """
    futures = list(futures)
    limit = io_timeout() if timeout is None else timeout
    deadline = _now() + limit
    latch = _Latch(futures)
    if latch.opened.wait(limit) and not latch.failed:
        return latch.results
    pending = [f for f in futures if not f.done()]  # a failure, or the time is up
    error = next((f.exception() for f in futures if f.done() and not f.cancelled() and f.exception()), None)
    if pending:
        if error is not None:
            for f in pending:
                f.cancel()
        _, pending = cf.wait([f for f in pending if not f.cancelled()], timeout=max(0.0, deadline - _now()))
    if pending:
        for f in pending:
            f.cancel()  # the queued ones never start; the running ones are what is stuck
        raise IOStuckError(f"KV offload: {what} did not finish within {limit:g} s ({len(pending)} of {len(futures)} "
                           "requests still running): the disk or network filesystem is not answering. Raise "
                           "KV_OFFLOAD_IO_TIMEOUT_S if it is only slow.") from error
    if error is not None:
        raise error
    return [f.result() for f in futures]


def when_done(futures: Iterable[Future], then: Callable[[], object]) -> None:
    """Cancels the jobs of `futures` not yet started and calls `then()` once none is running any more.

    For cleanup after an error or an interrupt: a file descriptor closed, or a buffer reused, while a request
    still uses it could let that request read or write through a recycled descriptor number.
    """
    futures = [f for f in futures if not f.cancel() and not f.done()]
    if not futures:
        then()
        return
    left = [len(futures)]
    lock = threading.Lock()

    def one(_future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for f in futures:
        f.add_done_callback(one)
