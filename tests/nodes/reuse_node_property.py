"""The property run of the node's prefix reuse, on the in-process Qwen-Image 2.1 model: random runs, each after a
random change (storage, ComfyUI's cache dtype, an option the key cannot read, a weight edited through `.data`,
the prompt, the seed), each compared bit for bit with the same run with reuse off."""

from __future__ import annotations

import random

import torch

from kv_offload_pack.nodes.run.reuse import REUSE

from qwen21_tiny import Tiny21
from reuse_nodes_helpers import KEEP_ON, patched_with, queue


def node_property_run(requests: int, seed: int) -> dict:
    rng = random.Random(seed)
    REUSE.reset()
    dm = Tiny21()
    state = {"storage": "exact", "dtype": None, "override": False, "edit": False, "seed": 0, "prompt": 0,
             "code": False}
    attend = Tiny21._attend
    scaled = _scaled(attend)  # one patch object: while it stays, a hit is allowed
    saved = dm.qkv[0].clone()
    counts = {"requests": 0, "hits": 0, "stale": 0, "wrong": 0, "refused": 0}
    models = {}
    try:
        for _ in range(requests):
            change = rng.choice(["seed", "seed", "none", "none", "storage", "dtype", "override", "edit", "prompt",
                                 "code"])
            if change == "storage":
                state["storage"] = rng.choice(["exact", "int8", "fp8"])
            elif change == "dtype":
                state["dtype"] = rng.choice([None, "int8", "default"])
            elif change in ("override", "edit", "code"):
                state[change] = not state[change]
            elif change in ("seed", "prompt"):
                state[change] = rng.randrange(3 if change == "seed" else 2)
            # a class-level patch of the model's attention, as speed-up packages make, or the original back
            Tiny21._attend = scaled if state["code"] else attend
            dm.qkv[0].copy_(saved)
            if state["edit"]:
                dm.qkv[0].data[-1, -1] += 0.5
            outs = []
            for reuse in (KEEP_ON, False):  # reuse kept on at the tiny size (see KEEP_ON)
                key = (state["storage"], reuse)
                m = models.get(key) or models.setdefault(key, patched_with(dm, state["storage"], reuse=reuse))
                to = m.model_options["transformer_options"]
                to.pop("qwen_image21_cache", None)
                to.pop("optimized_attention_override", None)
                if state["dtype"]:
                    to["qwen_image21_cache"] = {"dtype": state["dtype"]}
                if state["override"]:
                    to["optimized_attention_override"] = _override
                for name, obj in m.object_patches.items():  # what ModelPatcher does while this model is patched
                    setattr(dm, name.split(".", 1)[1], obj)
                hits = REUSE.registry.stats()["hits"]
                outs.append(queue(dm, m, seed=state["seed"], prompt=state["prompt"]))
                hit = REUSE.registry.stats()["hits"] > hits
                if reuse:
                    counts["hits"] += hit
                    counts["refused"] += REUSE.refused is not None
                    was_hit = hit
            same = torch.equal(outs[0], outs[1])
            counts["requests"] += 1
            counts["stale"] += was_hit and not same
            counts["wrong"] += (not was_hit) and not same
    finally:
        Tiny21._attend = attend
        dm.qkv[0].copy_(saved)
        REUSE.reset()
    return counts


def _scaled(attend):
    def patched(self, *args, **kwargs):
        return attend(self, *args, **kwargs) * 1.01
    return patched


def _override(*args, **kwargs):  # an attention override another node set: the key cannot read it
    raise AssertionError("the tiny model never calls it")
