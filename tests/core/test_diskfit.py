"""The file tiers' request size and requests in flight, fitted to the disk (`offload_core.tiers.diskfit`).

The rest of the suite fixes the pattern (`KV_OFFLOAD_IO_PROBE=0` in the tests' conftest); here the probe runs,
on this machine's real disk, with the calls the tiers make, through this system's `os` and through the macOS
and Windows stand-ins (`simplatform.py`).
"""

import os
import threading

import pytest
import torch

from offload_core import KVStore, OffloadConfig
from offload_core.tiers.file import diskfit, fileio, iopool
from offload_core.tiers.file.fileio import KVWriteError

MiB = 1 << 20
SMALL = [(1 * MiB, 1), (1 * MiB, 4), (2 * MiB, 2)]  # quick candidates for the tests


@pytest.fixture
def probing(monkeypatch):
    """The probe on, nothing remembered from earlier tests, and forgotten again after."""
    monkeypatch.delenv("KV_OFFLOAD_IO_PROBE", raising=False)
    for name in ("KV_OFFLOAD_IO_DEPTH", "KV_OFFLOAD_IO_REQUEST_MIB"):
        monkeypatch.delenv(name, raising=False)
    diskfit.forget()
    yield
    diskfit.forget()


def _direct_mode(directory) -> str:
    mode = fileio.probe_page_cache_mode(str(directory), True)
    if mode not in diskfit.PROBED_MODES:
        pytest.skip(f"{directory} refuses direct I/O ({mode}): no probe runs there")
    return mode


def test_choose_takes_the_best_worse_side_and_the_most_in_flight_among_ties():
    figures = {
        (8 * MiB, 4): {"write": 3.0, "read": 1.0},  # the best write, a poor read
        (4 * MiB, 8): {"write": 2.0, "read": 2.0},  # worse side 2/3 of the best write
        (2 * MiB, 16): {"write": 2.7, "read": 2.0},  # worse side 0.9 of the best: the winner
    }
    assert diskfit.choose(figures) == (2 * MiB, 16)
    figures[(4 * MiB, 4)] = {"write": 2.5, "read": 1.95}  # within TIE of the winner, 16 MiB in flight against 32
    assert diskfit.choose(figures) == (2 * MiB, 16)
    figures[(4 * MiB, 8)] = {"write": 2.6, "read": 1.95}  # 32 MiB in flight too, on fewer threads
    assert diskfit.choose(figures) == (4 * MiB, 8)
    figures[(8 * MiB, 4)] = {"write": 2.55, "read": 1.9}  # the default, within TIE too: it stays
    assert (8 * MiB, 4) == diskfit.default() and diskfit.choose(figures) == (8 * MiB, 4)


def test_reads_get_their_own_depth_beyond_the_write_bound():
    figures = {(8 * MiB, 4): {"write": 3.0, "read": 1.2}, (4 * MiB, 4): {"write": 2.4, "read": 2.1}}
    reads = {(8 * MiB, 8): 2.6, (8 * MiB, 16): 2.65}  # 8 MiB reads want 8 in flight; 16 gain nothing more
    assert diskfit.choose(figures) == (4 * MiB, 4)  # by the patterns' own reads alone the default loses
    assert diskfit.choose(figures, reads) == (8 * MiB, 4)  # its read side is its best read at any depth
    assert diskfit.read_depth(reads, figures, 8 * MiB, 4) == 8  # the fewest within READ_TIE of the best
    assert diskfit.read_depth({(8 * MiB, 8): 1.0}, figures, 8 * MiB, 4) == 4  # never fewer than the writes
    assert diskfit.deeper_reads((8 * MiB, 4), diskfit.CANDIDATES) == (8, 16)  # 8 MiB's deepest write pattern
    assert diskfit.deeper_reads((8 * MiB, 2), diskfit.CANDIDATES) == ()  # measured once per request size
    assert diskfit.deeper_reads((2 * MiB, 16), diskfit.CANDIDATES) == ()
    assert diskfit.IOPattern(8 * MiB, 4, "probe", read_depth=16).label == "8MiBx4/r16"
    assert diskfit.IOPattern(8 * MiB, 4, "probe").label == "8MiBx4"


def test_a_store_reads_with_more_requests_than_its_write_staging_allows(tmp_path, monkeypatch):
    """Reads on 8 threads, writes within 2 + 2 staging buffers: every byte back, in both file modes."""
    fit = diskfit.IOPattern(1 * MiB, 2, "probe", "stand-in", read_depth=8)
    monkeypatch.setattr(diskfit, "pattern_for", lambda *a: fit)
    k = torch.randn(5 * MiB // 4 + 3)  # 5 MiB and 12 bytes a tensor: 11 chunks a layer, the last one short
    for mode in ("file_sync", "file_async"):
        with KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu") as store:
            for key in range(4):
                store.put(key, k + key, -k)
            store.flush()
            tier = store._tiers["file"]
            assert tier._chunks.workers == 8 and len(tier._writer.staging._all) == 4
            assert store.stats()["file_io"]["pattern"] == "1MiBx2/r8"
            for _ in range(2):
                for key in range(4):
                    got_k, got_v = store.get(key)
                    assert torch.equal(got_k, k + key) and torch.equal(got_v, -k)
    assert os.listdir(tmp_path) == []


def test_every_candidate_stays_within_the_staging_the_fixed_pattern_held():
    fixed = (iopool.IO_DEPTH + 2) * fileio.CHUNK
    assert diskfit.STAGING_BOUND == fixed == 48 * MiB
    assert (fileio.CHUNK, iopool.IO_DEPTH) in diskfit.CANDIDATES
    for request, depth in diskfit.CANDIDATES:
        assert (depth + 2) * request <= fixed and request * depth >= 8 * MiB
    assert {d for _, d in diskfit.CANDIDATES} == {1, 2, 4, 8, 16}


def test_a_probe_measures_each_pattern_with_the_tiers_calls_and_leaves_nothing(tmp_path):
    mode = _direct_mode(tmp_path)
    fit = diskfit.probe(str(tmp_path), mode, candidates=SMALL, nbytes=8 * MiB)
    assert fit.chosen == "probe" and (fit.request, fit.depth) in SMALL
    deeper = {f"{diskfit.label(1 * MiB, d)}/read" for d in (8, 16)} | {f"{diskfit.label(2 * MiB, d)}/read"
                                                                       for d in (4, 8, 16)}
    assert set(fit.probe) == {diskfit.label(*p) for p in SMALL} | deeper  # reads beyond the write bound too
    assert all(f.get("write", 1) > 0 and f["read"] > 0 for f in fit.probe.values())
    assert fit.reads >= fit.depth and fit.reads in (1, 2, 4, 8, 16)
    assert os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("kv_offload_probe")]


def test_a_probe_stops_starting_patterns_after_its_time(tmp_path):
    mode = _direct_mode(tmp_path)
    fit = diskfit.probe(str(tmp_path), mode, candidates=SMALL, seconds=0.0, nbytes=4 * MiB)
    assert len(fit.probe) == 1  # the first pattern is always measured, then the time is up


def test_a_store_uses_the_probed_pattern_and_its_files_say_so(tmp_path, probing, monkeypatch):
    _direct_mode(tmp_path)
    monkeypatch.setattr(diskfit, "CANDIDATES", SMALL)
    monkeypatch.setattr(diskfit, "PROBE_BYTES", 8 * MiB)
    k = torch.randn(3 * MiB // 4 + 1)  # 3 MiB and 4 bytes: several chunks of any candidate, the last one short
    for mode in ("file_sync", "file_async"):
        with KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu") as store:
            for key in range(3):
                store.put(key, k, -k)
            store.flush()
            io = store.stats()["file_io"]
            assert io["chosen"] == "probe" and (io["request_bytes"], io["in_flight"]) in SMALL
            tier = store._tiers["file"]
            assert tier._chunks.workers == io["reads_in_flight"] >= io["in_flight"]
            assert len(tier._writer.staging._all) == io["in_flight"] + 2
            path = os.path.join(tier.directory, "layer-00000.safetensors")
            with open(path, "rb") as f:
                head = f.read(4096)
            assert f'"chunk_bytes":"{io["request_bytes"]}"'.encode() in head
            for key in range(3):
                got_k, got_v = store.get(key)
                assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    assert os.listdir(tmp_path) == []


def test_the_probe_runs_once_per_filesystem_even_from_two_threads(tmp_path, probing, monkeypatch):
    mode = _direct_mode(tmp_path)
    calls, second = [], threading.Event()

    def slow_probe(directory, cache_mode):
        calls.append(directory)
        second.wait(10)  # the other thread is on its way in: without the lock it would probe too
        return diskfit.IOPattern(MiB, 2, "probe", "stand-in figures")

    def make(name: str, then=None):
        if then is not None:
            then.set()
        got.append(diskfit.pattern_for(str(tmp_path / name), mode, None))

    monkeypatch.setattr(diskfit, "probe", slow_probe)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    got = []
    first = threading.Thread(target=make, args=("a",))
    first.start()
    while not calls:
        first.join(0.01)
    threads = [first, threading.Thread(target=make, args=("b", second))]
    threads[1].start()
    for t in threads:
        t.join(30)
    assert len(calls) == 1 and len(got) == 2 and got[0] is got[1]
    assert diskfit.pattern_for(str(tmp_path), "fadvise", None).chosen == "default"  # another cache mode: not probed


def test_no_probe_where_it_would_measure_ram_or_the_page_cache(tmp_path, probing, monkeypatch, mount_tmpfs, system):
    monkeypatch.setattr(diskfit, "probe", lambda *a: pytest.fail("probed"))
    for cache_mode in ("fadvise", "buffered", "off"):
        fit = diskfit.pattern_for(str(tmp_path), cache_mode, None)
        assert (fit.chosen, fit.request, fit.depth) == ("default", fileio.CHUNK, iopool.IO_DEPTH)
        assert "page cache" in fit.reason
    if system.name != "linux":
        return  # a RAM disk of macOS or Windows looks like an ordinary volume: nothing to tell it by
    ram = mount_tmpfs("8m")
    with KVStore(OffloadConfig(mode="file_sync", file_dir=ram), "cpu") as store:
        store.put(0, torch.ones(8), torch.ones(8))
        io = store.stats()["file_io"]
    assert io["chosen"] == "default" and "tmpfs" in io["reason"]


def test_the_environment_fixes_the_pattern(tmp_path, probing, monkeypatch):
    monkeypatch.setattr(diskfit, "probe", lambda *a: pytest.fail("probed"))
    monkeypatch.setenv("KV_OFFLOAD_IO_REQUEST_MIB", "2")
    fit = diskfit.pattern_for(str(tmp_path), "o_direct", None)
    assert (fit.request, fit.depth, fit.chosen) == (2 * MiB, iopool.IO_DEPTH, "environment")
    assert fit.reason == "set by KV_OFFLOAD_IO_REQUEST_MIB"
    monkeypatch.delenv("KV_OFFLOAD_IO_REQUEST_MIB")
    monkeypatch.setenv("KV_OFFLOAD_IO_PROBE", "0")
    assert diskfit.pattern_for(str(tmp_path), "o_direct", None).reason == "KV_OFFLOAD_IO_PROBE=0"


def test_a_failed_probe_falls_back_says_why_and_is_tried_again(tmp_path, probing, monkeypatch):
    mode = _direct_mode(tmp_path)
    outcomes = [KVWriteError("KV offload: the disk holding it is full"), None]

    def probe(directory, cache_mode):
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return diskfit.IOPattern(MiB, 2, "probe", "second try")

    monkeypatch.setattr(diskfit, "probe", probe)
    first = diskfit.pattern_for(str(tmp_path), mode, None)
    assert first.chosen == "default" and "the disk holding it is full" in first.reason
    assert diskfit.pattern_for(str(tmp_path), mode, None).reason == "second try"


def test_a_full_disk_during_the_probe_is_not_an_error(probing, monkeypatch, mount_ext4):
    """A real filesystem with 6 MiB free: the probe's 8 MiB file does not fit, the store still works."""
    small = mount_ext4("24m")
    mode = _direct_mode(small)
    ballast = os.path.join(small, "ballast")
    with open(ballast, "wb") as f:
        f.write(b"\0" * (os.statvfs(small).f_bavail * os.statvfs(small).f_frsize - 6 * MiB))
    monkeypatch.setattr(diskfit, "CANDIDATES", SMALL)
    monkeypatch.setattr(diskfit, "PROBE_BYTES", 8 * MiB)
    fit = diskfit.pattern_for(small, mode, None)
    assert fit.chosen == "default" and "full" in fit.reason
    assert sorted(os.listdir(small)) == sorted(["ballast", "lost+found"])


@pytest.mark.parametrize("call", [1, 2, 5])
def test_an_interrupt_inside_the_probe_leaves_no_file_thread_or_directory(call, tmp_path, probing, monkeypatch):
    _direct_mode(tmp_path)
    monkeypatch.setattr(diskfit, "CANDIDATES", SMALL)
    monkeypatch.setattr(diskfit, "PROBE_BYTES", 4 * MiB)
    real, seen = diskfit.timed, []

    def interrupted(*args):
        seen.append(1)
        if len(seen) == call:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(diskfit, "timed", interrupted)
    with pytest.raises(KeyboardInterrupt):  # the probe alone: its own file goes
        diskfit.probe(str(tmp_path), fileio.probe_page_cache_mode(str(tmp_path), True), nbytes=4 * MiB)
    assert os.listdir(tmp_path) == []
    seen.clear()
    store = KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu")
    with pytest.raises(KeyboardInterrupt):
        store.put(0, torch.ones(8), torch.ones(8))
    store.close()
    assert os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("kv_offload_probe") and t.is_alive()]
    monkeypatch.setattr(diskfit, "timed", real)
    with KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu") as again:  # nothing was remembered
        again.put(0, torch.ones(8), torch.ones(8))
        assert again.stats()["file_io"]["chosen"] == "probe"


def _probe_descriptors():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if ".io-probe-" in os.readlink(f"/proc/self/fd/{fd}"):
                out.append(fd)
        except OSError:
            pass
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_probe_that_timed_out_closes_its_file_when_the_stuck_request_returns_and_is_not_repeated(
        tmp_path, probing, monkeypatch):
    """A probe read stuck in the kernel: the probe gives up after the I/O timeout and kept its descriptor "for the
    stuck request" forever, and every new file store probed again, one more descriptor on a deleted file each."""
    mode = _direct_mode(tmp_path)
    monkeypatch.setattr(diskfit, "CANDIDATES", SMALL[:1])
    monkeypatch.setattr(diskfit, "PROBE_BYTES", 2 * MiB)
    monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 0.2)  # the stuck read below never returns before it is released
    release, probes = threading.Event(), []
    real_read, real_probe = fileio.pread_exact, diskfit.probe

    def stuck_read(*args):
        release.wait()
        return real_read(*args)

    def counted_probe(*args, **kwargs):
        probes.append(1)
        return real_probe(*args, **kwargs)

    monkeypatch.setattr(fileio, "pread_exact", stuck_read)
    monkeypatch.setattr(diskfit, "probe", counted_probe)
    before = _probe_descriptors()
    fit = diskfit.pattern_for(str(tmp_path), mode, None)
    assert fit.chosen == "default" and "did not finish" in fit.reason
    assert diskfit.pattern_for(str(tmp_path), mode, None) is fit and probes == [1]  # not probed again
    release.set()  # the stuck request returns
    for thread in [t for t in threading.enumerate() if t.name == "kv_offload_probe_release"]:
        thread.join()
    assert _probe_descriptors() == before
