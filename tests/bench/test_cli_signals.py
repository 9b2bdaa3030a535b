"""A command killed by SIGTERM or SIGHUP, or interrupted by Ctrl-C, cleans up as it would on its own: no folder or
file of its is left, and it exits with the shell's status for the signal, after one line on stderr."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals (Windows has no SIGTERM delivery)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def leftovers(folder):
    return sorted(os.path.join(d, n) for d, dirs, files in os.walk(folder) for n in dirs + files)


def wait_for(condition, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)  # polling a condition, not a fixed wait


def start(args, tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=ROOT, KV_OFFLOAD_IO_TIMEOUT_S="20")
    return subprocess.Popen([sys.executable, "-m", "offload_core", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_stream_killed_mid_run_leaves_no_folder(signum, tmp_path):
    proc = start(["stream", "--cache-mib", "256", "--layer-mib", "16", "--sweep-mib", "64", "--modes",
                  "file_sync,file_async", "--rounds", "20", "--requests", "4", "--depths", "1,2", "--dir",
                  str(tmp_path)], tmp_path)
    try:
        wait_for(lambda: any(n.startswith(".kv_offload-stream-") for n in os.listdir(tmp_path))
                 or proc.poll() is not None, "the stream folder")
        assert proc.poll() is None, proc.stderr.read()
        wait_for(lambda: len(leftovers(tmp_path)) > 1, "a file in it")  # mid-run: its raw file or a file mode's files
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    assert f"interrupted ({signum.name}); cleaned up." in err
    assert leftovers(tmp_path) == []


def test_demo_killed_mid_run_leaves_no_file_store(tmp_path):
    proc = start(["demo", "--device", "cpu", "--layers", "400", "--mib", "0.25"], tmp_path)
    try:  # the file modes' private folders are made in TMPDIR
        wait_for(lambda: any(n.startswith("kv_offload") for n in os.listdir(tmp_path)) or proc.poll() is not None,
                 "a file store's folder")
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert leftovers(tmp_path) == []
