"""The string keys the pack shares with ComfyUI and with itself, each defined once and imported everywhere.

They name entries of `model_options` / `transformer_options`, our wrappers' key and our object patch, and
the prefix reuse key is built from them (`nodes/run/reuse.py`): renaming one here renames it everywhere at once,
and `tests/nodes/test_keys.py` pins each value, so a rename that would change a reuse key is seen.

No ComfyUI import.
"""

from __future__ import annotations

# ComfyUI's own keys (what the model and the sampler read and write)
TRANSFORMER_OPTIONS = "transformer_options"
MODEL_FUNCTION_WRAPPER = "model_function_wrapper"
PATCHES, PATCHES_REPLACE, WRAPPERS, CALLBACKS = "patches", "patches_replace", "wrappers", "callbacks"
UUIDS = "uuids"  # one uuid per cond in the batch
COND_OR_UNCOND = "cond_or_uncond"
QWEN21_OPTIONS = "qwen_image21_cache"  # Qwen-Image 2.1's prefix-cache options, passed to `select_prefix_cache`
QWEN21_OFF = ("device", "off")  # the entry of those options that turns the model's own cache off
ANIMATE2_CACHE = "animate2_cache"  # the Wan Animate 2 model reads its pose cache here
MULTI_GPU_KEY = "multigpu_thread_device"  # set by ComfyUI's _calc_cond_batch_multigpu in each thread's options
ON_DETACH = "on_detach_after"  # comfy.patcher_extension.CallbacksMP.ON_DETACH
# set per step or per sampler: the Qwen-Image 2.1 prefix is modulated at t = 0, so none of these reach it
PER_STEP_OPTIONS = frozenset({"sample_sigmas", "sigmas", COND_OR_UNCOND, UUIDS, "total_blocks", "block_index",
                              "block_type", "transformer_index"})

# ours
WRAPPER_KEY = "kv_offload"  # the key of our wrappers; also the attribute that marks our patches
RUN_KEY = "kv_offload_run"  # transformer_options key of the live RunState
OUR_PATCH = "diffusion_model.select_prefix_cache"  # our object patch on Qwen-Image 2.1
QWEN21_FAMILY = "qwen_image21"  # the family whose prefixes are kept across runs
