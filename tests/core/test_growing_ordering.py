"""The fences of growing layers, each shown necessary on `SimCuda` (a CPU model of CUDA ordering).

The consumer's kernels (a block written after the prefix, the prefix read) are queued on its stream with
`sim.launch`; `early` runs side-stream copies as soon as they may while the kernels lag (a load overwriting a
slot still read shows), `late` runs the kernels at once and the copies as late as they may (a missing wait for a
load or for the block's write before it is kept shows). Every prefix a kernel read must be what was committed.
"""

import pytest
import torch

from offload_core import GrowingKVStore, GrowingShape, OffloadConfig

LAYERS, BLOCKS, STEPS = 4, [3, 5, 2, 4], 3


@pytest.mark.parametrize("schedule", ["early", "late"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("mode", ["ram_sync", "ram_async", "file_sync", "file_async", "gpu"])
def test_every_prefix_a_kernel_reads_is_the_committed_one(make_sim, mode, depth, schedule, tmp_path):
    sim = make_sim(schedule)
    shape = GrowingShape(batch=2, capacity=sum(BLOCKS), heads=2, head_dim=8, dtype=torch.float32)
    g = torch.Generator().manual_seed(40)
    ref = [(torch.randn(shape.pair, generator=g), torch.randn(shape.pair, generator=g)) for _ in range(LAYERS)]
    fields = {"mode": mode}
    if mode.endswith("async"):
        fields["prefetch_depth"] = depth
    if mode.startswith("file"):
        fields["file_dir"] = str(tmp_path)
    seen = []
    with GrowingKVStore(OffloadConfig(**fields), "cpu", shape=shape, layers=LAYERS) as store:
        at = 0
        for n in BLOCKS:
            for step in range(STEPS):
                final = step == STEPS - 1
                for layer in range(LAYERS):
                    k, v = store.view(layer)

                    def kernel(k, v, layer=layer, at=at, n=n, final=final):
                        seen.append((layer, at, k[:, :at].clone(), v[:, :at].clone()))
                        sign = 1 if final else -1
                        k[:, at:at + n] = ref[layer][0][:, at:at + n] * sign
                        v[:, at:at + n] = ref[layer][1][:, at:at + n] * sign

                    sim.launch(kernel, k, v)
                    if final:
                        store.commit(layer, at, at + n)
            at += n
        sim.synchronize()
    assert len(seen) == LAYERS * STEPS * len(BLOCKS)
    for layer, at, k, v in seen:
        assert torch.equal(k, ref[layer][0][:, :at]) and torch.equal(v, ref[layer][1][:, :at]), (layer, at)


@pytest.mark.parametrize("mode", ["ram_async", "file_async"])
def test_packed_prefixes_unpack_after_their_load(make_sim, mode, tmp_path):
    # The late schedule only: packing and unpacking are torch calls of the engine, which the model runs at once
    # rather than on the consumer's stream (on a GPU they queue there, behind the kernels before them).
    sim = make_sim("late")
    shape = GrowingShape(batch=1, capacity=sum(BLOCKS), heads=2, head_dim=8, dtype=torch.float32)
    g = torch.Generator().manual_seed(41)
    ref = [(torch.randn(shape.pair, generator=g), torch.randn(shape.pair, generator=g)) for _ in range(LAYERS)]
    config = OffloadConfig(mode=mode, storage="int8", file_dir=str(tmp_path) if "file" in mode else None)
    seen = []
    with GrowingKVStore(config, "cpu", shape=shape, layers=LAYERS) as store:
        at = 0
        for n in BLOCKS:
            for layer in range(LAYERS):
                k, v = store.view(layer)

                def kernel(k, v, layer=layer, at=at, n=n):
                    seen.append((layer, at, k[:, :at].clone()))
                    k[:, at:at + n] = ref[layer][0][:, at:at + n]
                    v[:, at:at + n] = ref[layer][1][:, at:at + n]

                sim.launch(kernel, k, v)
                store.commit(layer, at, at + n)
            at += n
        sim.synchronize()
    for layer, at, k in seen:
        want = ref[layer][0][:, :at]
        assert at == 0 or ((k - want).norm() / want.norm()).item() < 0.02, (layer, at)
