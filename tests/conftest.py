"""Load the repository as a package, the way ComfyUI loads a custom node pack.

ComfyUI has its own top-level `nodes` module, so the pack's `nodes/` is only ever imported relatively,
from inside the package. Tests import it as `kv_offload_pack.nodes.<module>`.
"""

import importlib.util
import os
import pathlib
import sys

import pytest

# Every view a store hands out or fills is checked against its buffer's address range (offload_core.layout),
# here and in every process the tests start (a real ComfyUI included).
os.environ["KV_OFFLOAD_CHECK_VIEWS"] = "1"

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACK = "kv_offload_pack"


def load_pack():
    if PACK not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK, ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = module
        spec.loader.exec_module(module)
    return sys.modules[PACK]


load_pack()


@pytest.fixture
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a busy machine OpenMP threads waiting for each other make
    every op many times slower; restored after the test."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _mounter(tmp_path, kind: str, commands, why: str):
    """`(mount, unmount_all)`: `mount(size)` runs `commands(size, image, where)` in turn for a fresh mount point
    `where` (and a backing file `image`), skipping the test with `why` and the error where one fails."""
    import subprocess

    mounted = []

    def mount(size: str) -> str:
        image, where = tmp_path / f"{kind}-{len(mounted)}.img", tmp_path / f"{kind}{len(mounted)}"
        where.mkdir()
        for command in commands(size, str(image), str(where)):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot mount a{'n' if kind[0] in 'ae' else ''} {kind} here "
                            f"({done.stderr.strip() or command[0] + ' failed'}); {why}")
        mounted.append(where)
        return str(where)

    def unmount_all() -> None:
        for where in reversed(mounted):
            subprocess.run(["umount", "-l", str(where)], capture_output=True)

    return mount, unmount_all


@pytest.fixture
def mount_tmpfs(tmp_path):
    """`mount_tmpfs(size)` mounts a real tmpfs of `size` (e.g. "8m") and returns its path; unmounted after the test.

    Skips, with the reason, where this process may not mount (not root, no CAP_SYS_ADMIN in a container)."""
    mount, unmount_all = _mounter(tmp_path, "tmpfs", lambda size, image, where: [
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", where]], "needs root")
    yield lambda size="16m": mount(size)
    unmount_all()


@pytest.fixture
def mount_ext4(tmp_path):
    """`mount_ext4(size)` makes an ext4 filesystem of `size` (e.g. "24m") in a file and mounts it through a loop
    device (a real disk's filesystem, where direct I/O works, unlike tmpfs); unmounted after the test. Skips
    where this process may not (not root, no loop devices, no mkfs.ext4)."""
    import shutil

    if shutil.which("mkfs.ext4") is None:
        pytest.skip("no mkfs.ext4 here")
    mount, unmount_all = _mounter(tmp_path, "ext4", lambda size, image, where: [
        ["truncate", "-s", size, image], ["mkfs.ext4", "-q", "-F", image], ["mount", "-o", "loop", image, where]],
        "needs root and loop devices")
    yield lambda size="24m": mount(size)
    unmount_all()


@pytest.fixture
def failing_writes(monkeypatch):
    """`failing_writes(name, before=None)`: from then on a positional write (`fileos.Handle.pwrite`, the one
    write of every system) into a file whose path contains `name` raises EIO — a failing disk, with the space
    allocated but the write refused — after calling `before()` if given. Returns `heal()`, which puts the real
    write back."""
    import errno
    import sys

    import offload_core.tiers.file.fileos  # noqa: F401  (loaded, so it is found below)

    def arm(name: str, before=None):
        # Every copy of the engine loaded by now: the ComfyUI pack's tests load it a second time, in the pack.
        handles = [m.Handle for n, m in list(sys.modules.items()) if n.endswith("offload_core.tiers.file.fileos")]
        real = {handle: handle.pwrite for handle in handles}

        def pwrite(handle, data, offset):
            if name in handle.path:
                if before is not None:
                    before()
                raise OSError(errno.EIO, "Input/output error")
            return real[type(handle)](handle, data, offset)

        for handle in handles:
            monkeypatch.setattr(handle, "pwrite", pwrite)
        return lambda: [monkeypatch.setattr(handle, "pwrite", real[handle]) for handle in handles]

    return arm


@pytest.fixture
def wait_until():
    """`wait_until(condition, seconds=10)`: polls `condition()` until it holds; fails the test if it does not in
    time. For state another thread finishes (a done-callback giving a buffer back runs just after the waiter
    wakes), never as a fixed wait."""
    import time

    def wait(condition, seconds: float = 10.0) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline, "condition not reached in time"
            time.sleep(0.01)

    return wait
