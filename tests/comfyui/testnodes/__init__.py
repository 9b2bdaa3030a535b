"""Test-only ComfyUI nodes for the integration suite (never shipped with the pack).

They make what a text encoder, a VAE and a full-size checkpoint would otherwise provide: seeded random
conditioning, seeded random latents, and a tiny random Qwen-Image model built in-process (Qwen-Image
widths are class defaults, so a tiny one cannot be loaded through `UNETLoader`).
"""

import sys
import threading

import torch

import comfy.model_management as mm
import comfy.model_patcher
import comfy.supported_models


class KVOffloadTestConditioning:
    CATEGORY = "kv_offload/testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
                             "tokens": ("INT", {"default": 8, "min": 1, "max": 512}),
                             "dim": ("INT", {"default": 64, "min": 1, "max": 8192})}}

    def make(self, seed, tokens, dim):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, dim, generator=g), {}]],)


class KVOffloadTestLatent:
    CATEGORY = "kv_offload/testing"
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
                             "channels": ("INT", {"default": 128, "min": 1, "max": 1024}),
                             "height": ("INT", {"default": 4, "min": 1, "max": 1024}),
                             "width": ("INT", {"default": 4, "min": 1, "max": 1024}),
                             "frames": ("INT", {"default": 0, "min": 0, "max": 64,
                                                "tooltip": "0: a 4-D image latent; n: 5-D with n frames"})},
                "optional": {"batch": ("INT", {"default": 1, "min": 1, "max": 8,
                                               "tooltip": "latents in the batch, each its own noise"})}}

    def make(self, seed, channels, height, width, frames, batch=1):
        g = torch.Generator().manual_seed(seed)
        shape = (batch, channels, height, width) if frames == 0 else (batch, channels, frames, height, width)
        return ({"samples": torch.randn(*shape, generator=g)},)


class KVOffloadTestTinyQwenImage:
    """A 2-layer random Qwen-Image(-Edit) transformer: 2 heads of 32, text context 64, 16 latent channels."""

    CATEGORY = "kv_offload/testing"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31})}}

    def make(self, seed):
        return (_tiny_qwen_image(seed),)


def _tiny_qwen_image(seed, disable_dynamic=False):
    """The model, made afresh; registered as its patcher's `cached_patcher_init`, as ComfyUI's loaders do, so
    MultiGPU CFG Split can build it again on another device."""
    config = comfy.supported_models.QwenImage({"image_model": "qwen_image"})
    config.unet_config.update(num_layers=2, attention_head_dim=32, num_attention_heads=2,
                              joint_attention_dim=64, axes_dims_rope=(8, 12, 12))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, "")
    g = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in model.diffusion_model.state_dict().items()}
    model.diffusion_model.load_state_dict(sd, strict=True, assign=True)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                               offload_device=mm.unet_offload_device())
    patcher.cached_patcher_init = (_tiny_qwen_image, (seed,))
    return patcher


class KVOffloadTestPoseConditioning:
    """Seeded random pose-video latents and the pose prompt on a conditioning (what `WanAnimate2ToVideo` sets).

    Wire the positive's output into the negative's `pose_prompt` so both carry the positive's prompt for the
    pose pass, as `WanAnimate2ToVideo` does."""

    CATEGORY = "kv_offload/testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
                             "frames": ("INT", {"default": 4, "min": 1, "max": 64}),
                             "height": ("INT", {"default": 4, "min": 1, "max": 1024}),
                             "width": ("INT", {"default": 4, "min": 1, "max": 1024})},
                "optional": {"pose_prompt": ("CONDITIONING",)}}

    def make(self, conditioning, seed, frames, height, width, pose_prompt=None):
        g = torch.Generator().manual_seed(seed)
        pose = torch.randn(1, 16, frames, height, width, generator=g)
        prompt = (pose_prompt or conditioning)[0][0]
        return ([[c, {**opts, "pose_video_latent": pose, "cross_attn_pose": prompt}] for c, opts in conditioning],)


class KVOffloadTestFailAt:
    """Raises RuntimeError in the `calls`-th call of a `double_block` patch: an error in the middle of a run."""

    CATEGORY = "kv_offload/testing"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "calls": ("INT", {"default": 8, "min": 1, "max": 1 << 20})},
                "optional": {"patch": (["double_block", "post_input"], {"default": "double_block"})}}

    def make(self, model, calls, patch="double_block"):
        seen = [0]
        lock = threading.Lock()  # multi-GPU sampling calls it from a thread per device

        def fail(args):
            with lock:
                seen[0] += 1
                if seen[0] == calls:
                    raise RuntimeError("test failure in the middle of sampling")
            return args if patch == "post_input" else {"img": args["img"]}

        m = model.clone()
        m.set_model_patch(fail, patch)
        return (m,)


class KVOffloadTestARInitialLatent:
    """What `ARVideoI2V` puts on the model once its VAE encoded the start image: a seeded random latent frame
    (1, 16, 1, h, w) under `transformer_options["ar_config"]["initial_latent"]`, which `sample_ar_video` runs at
    sigma 0 to seed the KV cache (no VAE needed)."""

    CATEGORY = "kv_offload/testing"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
                             "height": ("INT", {"default": 4, "min": 1, "max": 1024}),
                             "width": ("INT", {"default": 4, "min": 1, "max": 1024})}}

    def make(self, model, seed, height, width):
        g = torch.Generator().manual_seed(seed)
        m = model.clone()
        to = m.model_options.setdefault("transformer_options", {})
        to.setdefault("ar_config", {})["initial_latent"] = torch.randn(1, 16, 1, height, width, generator=g)
        return (m,)


class KVOffloadTestFailAtCall:
    """Raises RuntimeError in the `calls`-th model call (an APPLY_MODEL wrapper): an error in the middle of a run
    of any model."""

    CATEGORY = "kv_offload/testing"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "calls": ("INT", {"default": 8, "min": 1, "max": 1 << 20})}}

    def make(self, model, calls):
        seen = [0]

        def fail(executor, *args, **kwargs):
            seen[0] += 1
            if seen[0] == calls:
                raise RuntimeError("test failure in the middle of sampling")
            return executor(*args, **kwargs)

        m = model.clone()
        m.add_wrapper_with_key("apply_model", "kv_offload_test_fail", fail)
        return (m,)


class KVOffloadTestMode:
    """A mode as a link (what a primitive or a switch node feeds a combo input)."""

    CATEGORY = "kv_offload/testing"
    RETURN_TYPES = ("COMBO",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"mode": ("STRING", {"default": "auto"})}}

    def make(self, mode):
        return (mode,)


def _two_cpu_devices() -> None:
    """Test-only: ComfyUI's multi-GPU code (`comfy.multigpu`, behind the MultiGPU CFG Split node) sees two devices,
    `cpu` and `cpu:1`: distinct torch devices on the same memory, so the node deep-clones the model onto the second
    and `_calc_cond_batch_multigpu` runs one thread per device, as on two GPUs. Every other caller sees what
    ComfyUI sees (`--cpu`: one device)."""
    devices = mm.get_all_torch_devices

    def all_torch_devices(exclude_current=False):
        if sys._getframe(1).f_globals.get("__name__") != "comfy.multigpu":
            return devices(exclude_current)
        found = [torch.device("cpu"), torch.device("cpu", 1)]
        return found[1:] if exclude_current else found

    mm.get_all_torch_devices = all_torch_devices


_two_cpu_devices()


NODE_CLASS_MAPPINGS = {
    "KVOffloadTestMode": KVOffloadTestMode,
    "KVOffloadTestConditioning": KVOffloadTestConditioning,
    "KVOffloadTestLatent": KVOffloadTestLatent,
    "KVOffloadTestTinyQwenImage": KVOffloadTestTinyQwenImage,
    "KVOffloadTestPoseConditioning": KVOffloadTestPoseConditioning,
    "KVOffloadTestFailAt": KVOffloadTestFailAt,
    "KVOffloadTestARInitialLatent": KVOffloadTestARInitialLatent,
    "KVOffloadTestFailAtCall": KVOffloadTestFailAtCall,
}
