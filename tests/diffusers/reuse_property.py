"""The property run: random requests, each after a random change (or none), each compared bit for bit with the
same request served without reuse. Used by the short CI test and by scripts/reuse_property.py (the long run)."""

from __future__ import annotations

import random

import numpy as np

from offload_core.bench import models
from offload_core.diffusers import disable_kv_offload, enable_kv_offload

from changes import CHANGES
from valuechanges import scene

BIG = {"device": 1 << 30, "host": 1 << 30, "file": 1 << 30}


def _run(pipe, image, seed, prompt):
    args = models.call_kwargs(pipe, [image], steps=2, resolution=64, seed=seed, cfg=False)
    args["prompt"] = prompt
    return pipe(**args).images


def property_run(pipe, images, requests: int, seed: int, mode: str = "ram_sync", scene_name: str = "") -> dict:
    """Counts: requests, hits, stale (a hit that differs), wrong (a miss that differs), refused, per change.
    `scene_name`: a scene of `valuechanges.SCENES` in force for the run, whose value changes join the draw."""
    rng = random.Random(seed)
    undo_scene, value_changes, excluded = scene(pipe, scene_name) if scene_name else (lambda: None, {}, set())
    catalogue = {**{n: c for n, c in CHANGES.items() if n not in excluded}, **value_changes}
    session = enable_kv_offload(pipe, mode, reuse_budget=BIG, reuse="always")
    active: dict = {}
    counts = {"requests": 0, "hits": 0, "stale": 0, "wrong": 0, "refused": 0, "changes": {}}
    state = {"seed": 0, "image": 0, "prompt": "a red apple"}
    history: list = []
    try:
        for _ in range(requests):
            # Half the requests repeat the state (a new seed at most): those are the hits; an active change is
            # undone as often as a new one is made, so earlier states (and their kept prefixes) come back.
            if rng.random() < 0.5:
                change = rng.choice(["seed", "none"])
            elif active and rng.random() < 0.5:
                change = rng.choice(sorted(active))
            else:
                change = rng.choice([*catalogue, "image", "prompt"])
            counts["changes"][change] = counts["changes"].get(change, 0) + 1
            if change in catalogue:  # toggled: applied if off, undone if on
                undo = active.pop(change, None)
                if undo is None:
                    active[change] = catalogue[change](pipe)
                else:
                    undo()
            elif change == "seed":
                state["seed"] = rng.randrange(3)
            elif change == "image":
                state["image"] = rng.randrange(len(images))
            elif change == "prompt":
                state["prompt"] = rng.choice(["a red apple", "a green tree at night"])
            request = (pipe, images[state["image"]], state["seed"], state["prompt"])
            hits = session.reuse.stats()["hits"]
            out = _run(*request)
            hit = session.reuse.stats()["hits"] > hits
            counts["refused"] += any(s.get("reuse_refused") for s in session.last_stats)
            registry, session.reuse = session.reuse, None  # the same request, served without reuse
            try:
                reference = _run(*request)
            finally:
                session.reuse = registry
            same = np.array_equal(out, reference)
            counts["requests"] += 1
            counts["hits"] += hit
            counts["stale"] += hit and not same
            counts["wrong"] += (not hit) and not same
            if not same and "first_failure" not in counts:  # what to replay: the request and the state before it
                counts["first_failure"] = {"request": counts["requests"], "change": change, "hit": hit,
                                           "active": sorted(active), **state, "history": history[-12:]}
            history.append((change, sorted(active), hit))
    finally:
        for undo in active.values():
            undo()
        disable_kv_offload(pipe)
        undo_scene()
    return counts
