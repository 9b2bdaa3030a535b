"""What the node does with inputs it cannot check or cache for: linked inputs."""

import pytest

from kv_offload_pack.nodes.apply import config_from_inputs, validation_message


def test_linked_inputs_pass_validation_and_are_checked_at_execution():
    # ComfyUI validates a linked input as None; its value only exists when the node executes
    assert validation_message(mode=None, prefetch_depth=1, bypass_page_cache=True, pin_budget_mb=0) is True
    assert validation_message(mode="file_async", prefetch_depth=None, bypass_page_cache=None,
                              pin_budget_mb=None) is True
    assert "`prefetch_depth` must be between" in validation_message(mode="ram_async", prefetch_depth=0,
                                                                    bypass_page_cache=None, pin_budget_mb=None)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        config_from_inputs(None)
