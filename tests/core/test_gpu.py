"""CUDA paths: side streams, pinned buffers, events. Run wherever CUDA exists (scripts/gpu_check.sh runs them
under TORCH_CUDA_SANITIZER=1, which reports any unsynchronized access between streams)."""

import pytest
import torch

from offload_core import HostServices, KVStore, OffloadConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TIERS = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async"]


def produce(n_layers, tokens=2048, dim=1024):
    """K/V produced by kernels on the current stream, as a transformer block would."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n_layers, 2, dim, dim, device="cuda", generator=gen, dtype=torch.bfloat16) / dim ** 0.5
    return x, w


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("mode", TIERS)
def test_bit_exact_under_compute_pressure_on_a_non_default_stream(mode, depth, tmp_path):
    if mode not in ("ram_async", "file_async") and depth > 1:
        pytest.skip("prefetch depth applies to the async modes only")
    layers = 12
    x, w = produce(layers)
    config = OffloadConfig(mode=mode, prefetch_depth=depth if "async" in mode else None,
                           file_dir=str(tmp_path) if "file" in mode else None)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), KVStore(config, "cuda") as store:
        reference = []
        for i in range(layers):
            k, v = x @ w[i, 0], x @ w[i, 1]
            store.put(i, k, v)
            reference.append((k.clone(), v.clone()))
            k.mul_(3)  # queued right after put: the store's copy must be ordered before it
            v.zero_()
        for _ in range(3):
            for i in range(layers):
                k, v = store.get(i)
                scores = (x @ k.T).softmax(-1) @ v  # long kernels reading the slot while the next copy runs
                assert torch.equal(k, reference[i][0]) and torch.equal(v, reference[i][1])
                assert torch.isfinite(scores).all()
        stats = store.stats()
    torch.cuda.synchronize()
    if mode in ("ram_async", "file_async"):
        assert stats["peak_layers_on_device"] == depth + 1
        assert stats["bytes"]["host_pinned"] > 0


def test_offloaded_tiers_use_less_device_memory_than_gpu(tmp_path):
    layers = 16
    x, w = produce(layers)
    peaks = {}
    for mode in ("gpu", "ram_async", "file_async"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with KVStore(OffloadConfig(mode=mode), "cuda") as store:
            for i in range(layers):
                store.put(i, x @ w[i, 0], x @ w[i, 1])
            for i in range(layers):
                store.get(i)
            torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - base
    assert peaks["ram_async"] < peaks["gpu"] / 2 and peaks["file_async"] < peaks["gpu"] / 2, peaks


def test_host_services_are_used():
    calls = {"pin": 0, "unpin": 0, "stream": 0}
    side = torch.cuda.Stream()

    def pin(t):
        calls["pin"] += 1
        return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)) == 0

    def unpin(t):
        calls["unpin"] += 1
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def stream(device):
        calls["stream"] += 1
        return side

    x, w = produce(4)
    host = HostServices(pin=pin, unpin=unpin, stream=stream)
    with KVStore(OffloadConfig(mode="ram_async"), "cuda", host=host) as store:
        for i in range(4):
            store.put(i, x @ w[i, 0], x @ w[i, 1])
        for i in range(4):
            store.get(i)
    assert calls["pin"] == 4 and calls["unpin"] == 4 and calls["stream"] == 1


@pytest.mark.parametrize("mode", TIERS)
def test_identical_batch_rows_are_checked_and_broadcast_on_the_device(mode, tmp_path):
    """Rows produced on a non-default stream, changed right after put; one row moves, the batch comes back."""
    layers, batch = 6, 4
    x, w = produce(layers, tokens=512)
    config = OffloadConfig(mode=mode, file_dir=str(tmp_path) if "file" in mode else None)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), KVStore(config, "cuda") as store:
        reference = []
        for i in range(layers):
            k, v = ((x @ w[i, j]).expand(batch, -1, -1).contiguous() for j in range(2))
            if i == layers - 1:
                v[-1, 0, 0] += 1  # one element of the last row: kept whole
            store.put(i, k, v)
            reference.append((k.clone(), v.clone()))
            k.mul_(3)
            v.zero_()
        for _ in range(3):
            for i in range(layers):
                k, v = store.get(i)
                scores = (x @ k[-1].T).softmax(-1) @ v[-1]
                assert torch.equal(k, reference[i][0]) and torch.equal(v, reference[i][1])
                assert torch.isfinite(scores).all()
        stats = store.stats()
    torch.cuda.synchronize()
    assert stats["dedup"]["layers"] == layers - 1 and stats["dedup"]["check_s"] > 0
