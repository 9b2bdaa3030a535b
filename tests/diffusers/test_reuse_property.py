"""A short property run per pipeline (the long one is scripts/reuse_property.py): 0 stale hits, and hits happen."""

import pytest

from reuse_property import property_run


@pytest.mark.parametrize("which,scene", [("qwen", "partials"), ("flux", "objects")])
def test_random_changes_never_get_a_stale_hit(which, scene, qwen_pipe, flux_pipe, images):
    counts = property_run(qwen_pipe if which == "qwen" else flux_pipe, images, requests=40, seed=7, scene_name=scene)
    assert counts["stale"] == 0 and counts["wrong"] == 0, counts
    assert counts["hits"] >= 5 and counts["refused"] >= 1, counts  # the run exercised hits and refusals
