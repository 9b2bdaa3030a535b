"""Runs the store and tier suites twice: on the plain CPU path and on `SimCuda`, a CPU model of CUDA ordering
in which queued copies really are deferred (see `simcuda.py`). Violations it records fail the test."""

import pytest

from simcuda import SimCuda

ON_BOTH = {"test_contract", "test_schedule", "test_files", "test_misuse", "test_placement", "test_codec_edges",
           "test_plan_reasons", "test_dedup"}


def pytest_generate_tests(metafunc):
    if "ordering" in metafunc.fixturenames and metafunc.module.__name__ in ON_BOTH:
        metafunc.parametrize("ordering", ["cpu", "simcuda"], indirect=True)


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
