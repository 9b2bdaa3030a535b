"""`--model`: which local diffusers folders the benchmark runs, checked without importing torch or diffusers."""

from __future__ import annotations

import json
import os

SUPPORTED = ("QwenImage21Pipeline", "Flux2KleinKVPipeline")


def check_model_folder(model: str) -> str:
    """The pipeline class named by the folder's model_index.json; ValueError unless it is one we run."""
    index = os.path.join(model, "model_index.json")
    if not os.path.isfile(index):
        what = "does not exist" if not os.path.exists(model) else "has no model_index.json"
        raise ValueError(f"--model {model!r} {what}; give a local diffusers folder (with a model_index.json) "
                         "of a QwenImage21Pipeline or Flux2KleinKVPipeline, or leave --model out for the built-in one.")
    try:
        with open(index) as f:
            class_name = json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"--model {model!r}: its model_index.json cannot be read as a JSON object ({exc}).") from None
    if class_name not in SUPPORTED:
        raise ValueError(
            f"--model {model!r} holds a {class_name}; the benchmark runs {' and '.join(SUPPORTED)} folders.")
    return class_name
