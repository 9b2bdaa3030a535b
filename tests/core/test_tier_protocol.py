"""Every tier is a `Tier` (an abstract base class) and serves a slot through the protocol's methods alone."""

import pytest
import torch

from offload_core import KVStore, OffloadConfig
from offload_core.host.devices import DONE
from offload_core.layout import views
from offload_core.places import DEVICE, FILE, PAGEABLE
from offload_core.tiers import Tier
from store_helpers import tiers


def test_a_tier_must_implement_the_whole_protocol():
    with pytest.raises(TypeError, match="abstract"):
        Tier()

    class Partial(Tier):  # no load
        def store(self, key, k, v, layout): ...
        def nbytes(self): return {}
        def close(self): ...
    with pytest.raises(TypeError, match="load"):
        Partial()


@pytest.mark.parametrize("mode, place", [("gpu", DEVICE), ("ram_sync", PAGEABLE), ("file_sync", FILE)])
def test_every_tier_loads_a_layer_into_a_slot_it_made(mode, place, tmp_path):
    k, v = torch.randn(2, 3, 8, 4), torch.randn(2, 3, 8, 4)
    k[1] += 1  # rows differ: the layer is kept whole
    config = OffloadConfig(mode=mode, file_dir=str(tmp_path) if place == FILE else None)
    with KVStore(config, "cpu") as store:
        store.put(0, k, v)
        store.flush()
        tier, layout = tiers(store)[place], store._layers.kept[0]
        assert isinstance(tier, Tier)
        slot = tier.new_slot(layout.data_bytes, store._res.streams)
        tier.load(0, slot, DONE).wait(store._res.streams.consumer())
        got_k, got_v = views(slot, layout)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
        tier.release_slot(slot)

