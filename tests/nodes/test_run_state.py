"""`RunState` on real engine stores: when a capture counts."""

import torch

from kv_offload_pack.nodes.state import CACHED, EXTRACT, RunState
from kv_offload_pack.offload_core import HostServices, KVStore, OffloadConfig


# --- capture completeness -----------------------------------------------------------------------------------------

def test_a_capture_missing_a_layer_is_recaptured_not_served():
    run = RunState(OffloadConfig(mode="ram_sync"), HostServices(), n_layers=2, store_factory=KVStore)
    k = torch.randn(1, 2, 4, 8)
    assert run.begin_forward(["c"], ref_tokens=4, batch=1).phase == EXTRACT
    run.put("c", ("double", 0), k, k)  # the forward ends without layer ("double", 1)
    run.end_forward(ok=True)
    assert run.begin_forward(["c"], ref_tokens=4, batch=1).phase == EXTRACT
    run.put("c", ("double", 0), k, k)
    run.put("c", ("double", 1), k, k)
    run.end_forward(ok=True)
    assert run.begin_forward(["c"], ref_tokens=4, batch=1).phase == CACHED
    run.close()
