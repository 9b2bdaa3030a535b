"""Batches of 2 and 4 latents in a real ComfyUI: `gpu` bit-identical to ComfyUI's own FluxKVCache (every row kept,
no dedup) and every lossless mode to `gpu`, CFG on and off, and
the stats say how many batch rows each store kept (FLUX.2's reference tokens attend to the noisy target on the
capture step, so only the layers before that attention see identical rows)."""

import pytest

from graph_helpers import LOSSLESS, graph, sampled

pytestmark = pytest.mark.comfyui


def _latent_and_stores(comfy, mode, model, cfg, batch, seed, flux_kv=None):
    g = graph(model=model, mode=mode, cfg=cfg, seed=seed, flux_kv=flux_kv)
    g["start"]["inputs"]["batch"] = batch
    entry = comfy.run(g)
    assert sampled(entry)
    code, stats = comfy.request("GET", "/kv_offload/stats")
    assert code == 200
    return comfy.latent(entry), stats.get("stores", [])


@pytest.mark.parametrize("cfg", [1.0, 2.0], ids=["no_cfg", "cfg"])
@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("model", ["flux2", "qwen_image"])
def test_batches_are_exact_in_every_lossless_mode(comfy, model, batch, cfg):
    seed = 300 + batch + int(cfg)
    stock, _ = _latent_and_stores(comfy, None, model, cfg, batch, seed, flux_kv="only")
    reference, stores = _latent_and_stores(comfy, "gpu", model, cfg, batch, seed)
    assert reference.shape[0] == batch and reference.equal(stock), f"{model} gpu batch {batch}: differs from FluxKVCache"
    for mode in LOSSLESS:
        latent, stores = _latent_and_stores(comfy, mode, model, cfg, batch, seed)
        assert latent.equal(reference), f"{model} {mode} batch {batch}: differs from gpu"
        rows = [s["dedup"] for s in stores if s.get("dedup")]
        assert rows, f"{mode}: no store reported its batch rows"
        for d in rows:
            assert d["rows_kept"] <= d["rows_put"]
