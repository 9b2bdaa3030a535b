"""The I/O pools' own contract: where the rest of a job runs, and `wait_all`'s results, errors and bound."""

import threading

import pytest

from offload_core.tiers import iopool


@pytest.fixture
def pools():
    made = []

    def make(workers: int, name: str) -> iopool.IOPool:
        made.append(iopool.IOPool(workers, name))
        return made[-1]

    yield make
    for pool in made:
        pool.shutdown(5)


def test_an_idle_worker_runs_the_rest_of_its_job_itself(pools):
    # Nothing waits for the I/O thread: it takes the checksum itself instead of waking a hash thread, whose
    # wake-up would lie between a file_sync layer's last read and its get's return.
    io, hashes = pools(1, "test_io"), pools(1, "test_hash")
    job = io.submit(lambda: iopool.Then(lambda: threading.current_thread().name, hashes), "a read")
    assert job.result(timeout=5).startswith("test_io")


def test_a_worker_with_a_request_waiting_hands_the_rest_on(pools):
    io, hashes = pools(1, "test_io"), pools(1, "test_hash")
    queued = threading.Event()
    job = io.submit(lambda: (queued.wait(5), iopool.Then(lambda: threading.current_thread().name, hashes))[1], "a read")
    behind = io.submit(lambda: "read", "the next read")
    queued.set()
    assert job.result(timeout=5).startswith("test_hash")
    assert behind.result(timeout=5) == "read"


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
