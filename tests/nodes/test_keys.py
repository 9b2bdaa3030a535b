"""The shared keys are defined once and pinned; the readout's calls and the reusable store's surface are explicit."""

import pytest

from kv_offload_pack.nodes import keys
from kv_offload_pack.nodes.readout.protocol import NO_READOUT, safe
from kv_offload_pack.nodes.run.reuse import ReusableStore


def test_each_shared_key_keeps_its_value():
    # renaming one changes every reuse key built from it and what ComfyUI reads: it must be a visible change
    assert (keys.TRANSFORMER_OPTIONS, keys.QWEN21_OPTIONS, keys.ANIMATE2_CACHE, keys.RUN_KEY, keys.WRAPPER_KEY,
            keys.OUR_PATCH, keys.QWEN21_FAMILY, keys.UUIDS) == (
        "transformer_options", "qwen_image21_cache", "animate2_cache", "kv_offload_run", "kv_offload",
        "diffusion_model.select_prefix_cache", "qwen_image21", "uuids")


def test_a_misspelt_readout_call_is_an_attribute_error():
    with pytest.raises(AttributeError):
        safe(object()).stpe()
    with pytest.raises(AttributeError):
        NO_READOUT.stpe()
    safe(None).step()  # no readout: every call is valid and does nothing


def test_a_store_method_not_served_is_not_reachable():
    class Store:
        closed = False

        def park(self):
            return "reached"

    with pytest.raises(AttributeError):
        ReusableStore(Store(), registry=None).park()
