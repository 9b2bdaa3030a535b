"""Runs the store and tier suites twice: on the plain CPU path and on `SimCuda`, a CPU model of CUDA ordering
in which queued copies really are deferred (see `simcuda.py`). Violations it records fail the test.

The file-tier suites also run three times over: on this machine's own system calls, and on the `os` / `fcntl` /
`msvcrt` surface of macOS and of Windows (`simplatform.py`)."""

import pytest

import simplatform
from simcuda import SimCuda

ON_BOTH = {"test_contract", "test_schedule", "test_files", "test_misuse", "test_placement", "test_codec_edges",
           "test_plan_reasons", "test_dedup", "test_property_engine", "test_codec_limits"}
ON_EVERY_SYSTEM = {"test_files", "test_file_integrity", "test_file_owner", "test_file_interrupts", "test_file_disk",
                   "test_file_park_close_interrupts", "test_file_put_interrupts",
                   "test_contract"}  # the contract: its file-mode cases only (the others touch no file)


def pytest_generate_tests(metafunc):
    if "ordering" in metafunc.fixturenames and metafunc.module.__name__ in ON_BOTH:
        metafunc.parametrize("ordering", ["cpu", "simcuda"], indirect=True)
    if "system" in metafunc.fixturenames and metafunc.module.__name__ in ON_EVERY_SYSTEM:
        metafunc.parametrize("system", simplatform.SYSTEMS, indirect=True)


def pytest_collection_modifyitems(config, items):
    """Drops the macOS / Windows copies of contract cases that use no file tier: nothing of theirs differs."""
    def other_system_without_files(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        return (item.module.__name__ == "test_contract" and params.get("system", "linux") != "linux"
                and not str(params.get("mode", "")).startswith("file"))

    dropped = [item for item in items if other_system_without_files(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not other_system_without_files(item)]


@pytest.fixture(autouse=True)
def system(request):
    """The `FileOS` the test's file tiers use: this machine's ('linux'), or the macOS / Windows stand-in.
    Installed with a patcher of its own, so a test's `monkeypatch.undo()` keeps it."""
    name = getattr(request, "param", "linux")
    with pytest.MonkeyPatch.context() as patcher:
        fs = simplatform.install(patcher, name)
        yield fs
    if name == "windows":
        assert fs.os.text_writes == 0, "a descriptor was opened without O_BINARY"


@pytest.fixture(autouse=True)
def ordering(request, monkeypatch):
    """None on the plain CPU path; the `SimCuda` every store of the test runs on otherwise."""
    if getattr(request, "param", "cpu") == "cpu":
        yield None
        return
    sim = SimCuda("late").install(monkeypatch)
    yield sim
    sim.synchronize()  # whatever is still queued runs now: it must not touch freed memory either
    assert sim.violations == []


@pytest.fixture
def make_sim(monkeypatch):
    """`make_sim(schedule)`: a `SimCuda` that stores created afterwards run on; its violations fail the test."""
    sims = []

    def make(schedule="late"):
        sims.append(SimCuda(schedule).install(monkeypatch))
        return sims[-1]

    yield make
    for sim in sims:
        sim.synchronize()
        assert sim.violations == []
