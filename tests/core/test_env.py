"""Environment values: a value that breaks its rule is used as the rule says and logged, naming the variable, the
value, the rule and what is used instead; the engine's own variables are read through it."""

import logging
import os
import subprocess
import sys

import pytest

from offload_core.host.env import LONGEST_S, env_int, env_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("text, used, why", [("banana", 4, "the default"), ("2.5", 4, "the default"),
                                             ("0", 1, "the nearest allowed"), ("-3", 1, "the nearest allowed"),
                                             ("100", 64, "the nearest allowed")])
def test_a_bad_whole_number_is_logged_with_what_is_used(text, used, why, monkeypatch, caplog):
    monkeypatch.setenv("KV_OFFLOAD_TEST_N", text)
    with caplog.at_level(logging.WARNING, logger="offload_core.host.env"):
        assert env_int("KV_OFFLOAD_TEST_N", 4, low=1, high=64) == used
    assert caplog.messages == [f"KV offload: KV_OFFLOAD_TEST_N={text!r} is not a whole number from 1 to 64; "
                               f"using {used}, {why}."]


@pytest.mark.parametrize("text", ["soon", "0", "-1", "inf", "nan"])
def test_bad_seconds_are_logged_and_the_default_used(text, monkeypatch, caplog):
    monkeypatch.setenv("KV_OFFLOAD_TEST_S", text)
    with caplog.at_level(logging.WARNING, logger="offload_core.host.env"):
        assert env_seconds("KV_OFFLOAD_TEST_S", 120.0) == 120.0
    assert caplog.messages == [f"KV offload: KV_OFFLOAD_TEST_S={text!r} is not a finite number of seconds > 0; "
                               "using 120.0, the default."]


@pytest.mark.parametrize("text", [None, "", "  "])
def test_unset_or_empty_is_the_default_without_a_word(text, monkeypatch, caplog):
    for name in ("KV_OFFLOAD_TEST_N", "KV_OFFLOAD_TEST_S"):
        if text is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, text)
    with caplog.at_level(logging.WARNING, logger="offload_core.host.env"):
        assert env_int("KV_OFFLOAD_TEST_N", 4, low=1, high=64) == 4
        assert env_seconds("KV_OFFLOAD_TEST_S", 120.0) == 120.0
    assert caplog.messages == []


def test_good_values_are_used_as_given(monkeypatch):
    monkeypatch.setenv("KV_OFFLOAD_TEST_N", " 16 ")
    monkeypatch.setenv("KV_OFFLOAD_TEST_S", "2.5")
    assert env_int("KV_OFFLOAD_TEST_N", 4, low=1, high=64) == 16
    assert env_seconds("KV_OFFLOAD_TEST_S", 120.0) == 2.5


def _engine_reads(**env):
    script = ("import logging; logging.basicConfig(format='%(message)s')\n"
              "from offload_core.tiers import base\nfrom offload_core.tiers.file import fileio, iopool\n"
              "print(iopool.IO_DEPTH, fileio.CHUNK >> 20, iopool.io_timeout(), base.TRANSFER_TIMEOUT_S)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.split(), out.stderr


def test_the_engine_reads_its_variables_through_the_checks():
    values, errors = _engine_reads(KV_OFFLOAD_IO_DEPTH="banana", KV_OFFLOAD_IO_REQUEST_MIB="0",
                                   KV_OFFLOAD_IO_TIMEOUT_S="-3")
    assert values == ["4", "1", "120.0", "600.0"]
    assert "KV_OFFLOAD_IO_DEPTH='banana' is not a whole number from 1 to 64; using 4, the default." in errors
    assert "KV_OFFLOAD_IO_REQUEST_MIB='0' is not a whole number from 1 to 256; using 1, the nearest allowed." in errors
    assert "KV_OFFLOAD_IO_TIMEOUT_S='-3' is not a finite number of seconds > 0; using 120.0, the default." in errors
    # Too long for Python's lock waits (a load waits five file operations): the longest allowed, with a warning.
    values, errors = _engine_reads(KV_OFFLOAD_IO_TIMEOUT_S="2e9")
    assert float(values[2]) == LONGEST_S and float(values[3]) == 5 * LONGEST_S
    assert f"KV_OFFLOAD_IO_TIMEOUT_S='2e9' is not a number of seconds up to {LONGEST_S:g}; using {LONGEST_S}" in errors
    # A good timeout bounds the consumer's wait for a load too (five file operations in a row at most).
    values, errors = _engine_reads(KV_OFFLOAD_IO_DEPTH="8", KV_OFFLOAD_IO_TIMEOUT_S="2")
    assert values == ["8", "8", "2.0", "10.0"] and errors == ""


def test_the_longest_timeout_fits_every_lock_wait_it_is_used_for():
    import threading

    from offload_core.tiers.file import iopool

    assert LONGEST_S * iopool.LOAD_STEPS < threading.TIMEOUT_MAX
    threading.Lock().acquire(timeout=LONGEST_S * iopool.LOAD_STEPS)  # free: returns at once, no OverflowError
