"""The I/O pools' own contract: where the rest of a job runs, and `wait_all`'s results, errors and bound."""

import os
import threading

import pytest

from offload_core.tiers.file import iopool


@pytest.fixture
def pools():
    made = []

    def make(workers: int, name: str) -> iopool.IOPool:
        made.append(iopool.IOPool(workers, name))
        return made[-1]

    yield make
    for pool in made:
        pool.shutdown(5)

def test_wait_all_returns_every_result_in_order_whatever_order_they_end_in(pools):
    pool = pools(4, "test_io")
    gates = [threading.Event() for _ in range(4)]
    futures = [pool.submit(lambda i=i: (gates[i].wait(5), i * 10)[1], f"job {i}") for i in range(4)]
    for gate in reversed(gates):
        gate.set()
    assert iopool.wait_all(futures, "the jobs") == [0, 10, 20, 30]
    assert iopool.wait_all([], "nothing") == []


def test_wait_all_raises_the_first_error_once_no_job_runs_and_cancels_the_queued(pools, wait_until):
    # A request that fails early must not let the caller reuse a buffer another request still fills.
    pool = pools(2, "test_io")
    release, started = threading.Event(), threading.Event()
    slow = pool.submit(lambda: (started.set(), release.wait(5), "slow")[2], "the slow read")
    assert started.wait(5)
    failing = pool.submit(lambda: 1 / 0, "the failing read")
    # The failing read's thread takes the next one, which runs on with the slow one; the rest stay queued.
    taken = pool.submit(lambda: (release.wait(5), "taken")[1], "the read taken next")
    queued = [pool.submit(lambda: "never", f"queued read {i}") for i in range(3)]
    outcome = {}

    def waiter():
        try:
            iopool.wait_all([slow, failing, taken, *queued], "the reads")
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=waiter)
    thread.start()
    assert failing.exception(timeout=5) is not None
    wait_until(lambda: all(f.cancelled() for f in queued))  # the failure cancelled what had not started
    assert thread.is_alive() and "error" not in outcome  # two reads still run: no error yet
    release.set()
    thread.join(5)
    assert isinstance(outcome["error"], ZeroDivisionError)
    assert slow.result(timeout=5) == "slow" and taken.result(timeout=5) == "taken"


def test_wait_all_names_the_requests_still_running_when_its_bound_passes(pools):
    pool = pools(1, "test_io")
    release = threading.Event()
    stuck = pool.submit(lambda: release.wait(5), "the stuck read")
    queued = pool.submit(lambda: "never", "the read behind it")
    try:
        with pytest.raises(iopool.IOStuckError, match=r"the reads did not finish within 0\.2 s \(2 of 2"):
            iopool.wait_all([stuck, queued], "the reads", timeout=0.2)
        assert queued.cancelled()
    finally:
        release.set()


def test_a_shutdown_wakes_whoever_waits_on_a_job_it_cancels(pools):
    # A read waiting on a write of another pool (a growing layer's prefix waits for its appends) must see that
    # write cancelled when close shuts that pool down, not wait out its bound: `concurrent.futures.wait` wakes on
    # a cancelled job only once it is marked so, as a worker marks the cancelled jobs it takes from its queue.
    import concurrent.futures as cf

    writes, release = pools(1, "test_write"), threading.Event()
    writes.submit(lambda: release.wait(30), "the running append")
    queued = writes.submit(lambda: "never", "the queued append")
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (cf.wait([queued], timeout=60), woke.set()))
    waiter.start()
    try:
        writes.shutdown(0.0)
        assert woke.wait(30) and queued.cancelled()
    finally:
        release.set()
        waiter.join(60)


def _threads_named(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


@pytest.mark.sweep
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc")
def test_ctrl_c_at_every_line_of_making_a_pool_leaves_no_thread(wait_until):
    # A pool that Ctrl-C stops half made is nobody's to shut down: it stops the threads it started itself,
    # also when the interrupt comes inside a thread's start (after the thread runs, before start returns). The
    # system's own count: a thread just started is not yet in `threading.enumerate()`'s alive ones.
    from interrupt_lines import ctrl_c_at, lines_of

    lines = [(fn, line) for fn in (iopool.IOPool.__init__, threading.Thread.start) for line in lines_of(fn)]
    interrupted, before = 0, len(os.listdir("/proc/self/task"))
    for function, line in lines:
        with ctrl_c_at(function, line) as fired:
            try:
                iopool.IOPool(3, "test_made").shutdown(5)
            except KeyboardInterrupt:
                pass
        interrupted += bool(fired)
        wait_until(lambda: len(os.listdir("/proc/self/task")) <= before)
    assert interrupted >= 8


@pytest.mark.sweep
def test_a_shutdown_stopped_by_ctrl_c_at_any_line_stops_every_thread_when_called_again(wait_until):
    from interrupt_lines import ctrl_c_at, lines_of

    interrupted = 0
    for line in lines_of(iopool.IOPool.shutdown):
        pool, gate = iopool.IOPool(2, "test_shut"), threading.Event()
        running = [pool.submit(gate.wait, "a running job") for _ in range(2)]
        queued = pool.submit(lambda: None, "a queued job")
        with ctrl_c_at(iopool.IOPool.shutdown, line) as fired:
            try:
                pool.shutdown(0.0)
            except KeyboardInterrupt:
                pass
        interrupted += bool(fired)
        gate.set()
        assert pool.shutdown(5) == []
        assert not _threads_named("test_shut"), line
        assert all(f.done() for f in running) and queued.cancelled(), line
    assert interrupted >= 8
