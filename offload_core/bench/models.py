"""Tiny diffusers pipelines with random weights, built in-process (nothing is downloaded).

They are real diffusers pipelines — the real transformer, text encoder, VAE and scheduler classes at small
widths — so the tests and the benchmark exercise exactly the code paths that full-size checkpoints take.
The tokenizer is a character-level BPE with the chat special tokens the pipelines look for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]
_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"-_()<>|/ \n"
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinySize:
    """Widths of a tiny pipeline. `hidden = heads * head_dim`; the rope axes must sum to `head_dim`."""

    layers: int = 3
    heads: int = 2
    head_dim: int = 32
    context_dim: int = 24
    single_layers: int = 2  # FLUX.2 only: single-stream blocks after the `layers` double-stream ones


TEST_SIZE = TinySize()


def tiny_tokenizer():
    """A character-level fast tokenizer carrying the Qwen chat special tokens and a minimal chat template."""
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(_CHARS)}
    vocab["<unk>"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPECIAL])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<|endoftext|>",
                                  eos_token="<|im_end|>")
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def _qwen3vl_processor(tok):
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        # Qwen3-VL's video processor needs torchvision; the pipelines never pass videos.
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template,
                             **kwargs)

    images = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                      min_pixels=32 * 32, max_pixels=4096 * 4096)
    return ImageOnlyQwen3VLProcessor(image_processor=images, tokenizer=tok, chat_template=_CHAT_TEMPLATE)


def _qwen3vl_text_encoder(tok, hidden: int):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {name: tok.convert_tokens_to_ids(tag) for name, tag in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden,
                  num_position_embeddings=64, deepstack_visual_indexes=[1])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    return Qwen3VLForConditionalGeneration(config).eval()


def _qwen21_vae(z_dim: int):
    from diffusers import AutoencoderKLQwenImage21

    return AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1, 1],
                                    num_res_blocks=1, temperal_downsample=[False, True, True, True],
                                    latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim).eval()


def _qwen21_tiny_config(size: TinySize) -> dict:
    head = size.head_dim
    axes = (head // 4, 3 * head // 8, head - head // 4 - 3 * head // 8)
    return dict(patch_size=1, in_channels=16, out_channels=16, num_layers=size.layers, attention_head_dim=head,
                num_attention_heads=size.heads, context_in_dim=size.context_dim, mlp_ratio=3, axes_dims_rope=axes)


def _qwen21_components(size: TinySize, seed: int, config: dict | None = None) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    config = config or _qwen21_tiny_config(size)
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    transformer = QwenImage21Transformer2DModel(**config).eval()
    return dict(transformer=transformer, vae=_qwen21_vae(config["in_channels"]),
                text_encoder=_qwen3vl_text_encoder(tok, config["context_in_dim"]),
                processor=_qwen3vl_processor(tok), scheduler=FlowMatchEulerDiscreteScheduler(shift_terminal=None))


def qwen21_pipeline(size: TinySize = TEST_SIZE, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", config: dict | None = None):
    """A `QwenImage21Pipeline` with random weights: 16x VAE, 16 latent channels (`config`: the transformer's
    config instead of `size`; the VAE and text encoder are tiny, of the widths it needs), patch size 1."""
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline(**_qwen21_components(size, seed, config))
    pipe.set_progress_bar_config(disable=True)
    return _place(pipe, device, dtype)


def qwen21_modular_pipeline(size: TinySize = TEST_SIZE, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                            device: str | torch.device = "cpu", guidance_scale: float = 1.0):
    """The modular Qwen-Image 2.1 pipeline (default auto blocks) with the same random components.

    `guidance_scale > 1` installs a classifier-free guider: two branches, two caches.
    """
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.modular_pipelines.qwenimage21 import QwenImage21AutoBlocks

    components = _qwen21_components(size, seed)
    components["guider"] = ClassifierFreeGuidance(guidance_scale=guidance_scale)
    pipe = QwenImage21AutoBlocks().init_pipeline()
    pipe.update_components(**components)
    pipe.to(device)
    for name in ("transformer", "vae", "text_encoder"):
        components[name].to(dtype=dtype)
    return pipe


def _flux2_tiny_config(size: TinySize) -> dict:
    head = size.head_dim
    return dict(patch_size=1, in_channels=16, num_layers=size.layers, num_single_layers=size.single_layers,
                attention_head_dim=head, num_attention_heads=size.heads, joint_attention_dim=3 * 16,
                timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(head // 4,) * 4, guidance_embeds=False)


def flux2_klein_kv_pipeline(size: TinySize = TEST_SIZE, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                            device: str | torch.device = "cpu", config: dict | None = None):
    """A `Flux2KleinKVPipeline` with random weights; call it with `text_encoder_out_layers=(1, 2, 3)`.

    `config`: the transformer's config (default: `size`); the text encoder and VAE are tiny, of the widths it
    needs (text hidden `joint_attention_dim / 3`, VAE latent channels `in_channels / 4`, 16x spatially).
    """
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinKVPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = config or _flux2_tiny_config(size)
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    text_hidden = config["joint_attention_dim"] // 3
    text = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=tok.pad_token_id)).eval()
    transformer = Flux2Transformer2DModel(**config).eval()
    # The pipeline packs 2x2 latent patches into tokens; blocks - 1 halvings make the rest of the 16x.
    blocks = 2 if config["in_channels"] <= 16 else 4
    vae = AutoencoderKLFlux2(block_out_channels=(8,) * blocks, layers_per_block=1, norm_num_groups=4,
                             latent_channels=config["in_channels"] // 4, down_block_types=("DownEncoderBlock2D",) * blocks,
                             up_block_types=("UpDecoderBlock2D",) * blocks).eval()
    pipe = Flux2KleinKVPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text,
                                tokenizer=tok, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return _place(pipe, device, dtype)


def _place(pipe, device, dtype: torch.dtype):
    # Random weights are created in float32; only cast when asked to (diffusers warns on every cast).
    return pipe.to(device=device) if dtype == torch.float32 else pipe.to(device=device, dtype=dtype)


def pipeline_kind(pipe) -> str:
    """"qwen21", "qwen21_modular" or "flux2": which call convention `call_kwargs` must follow."""
    name = type(pipe).__name__
    if "Modular" in name:
        return "qwen21_modular"
    return "flux2" if "Flux2" in name else "qwen21"


def call_kwargs(pipe, images: list, *, steps: int, resolution: int, seed: int = 0, cfg: bool = False,
                output_type: str = "np") -> dict:
    """Keyword arguments for one deterministic call of `pipe` (any of the three tiny pipelines).

    `cfg` adds a negative prompt with true CFG (classic Qwen pipeline; the modular one takes CFG from its guider).
    """
    kind = pipeline_kind(pipe)
    common = dict(prompt="a red cat on a blue sky", image=list(images), num_inference_steps=steps,
                  generator=torch.Generator().manual_seed(seed), output_type=output_type)
    if kind == "flux2":
        return dict(common, height=resolution, width=resolution, max_sequence_length=32,
                    text_encoder_out_layers=(1, 2, 3))
    common["output_resolution"] = resolution
    if cfg:
        common["negative_prompt"] = "a dog"
    if cfg and kind == "qwen21":
        common["true_cfg_scale"] = 4.0
    return common


def run_pipeline(pipe, images: list, **kwargs):
    """Call `pipe` with `call_kwargs(...)` and return its output images (an array or tensor)."""
    args = call_kwargs(pipe, images, **kwargs)
    if pipeline_kind(pipe) == "qwen21_modular":
        return pipe(**args, output="images")
    return pipe(**args).images


def condition_images(count: int, size: int = 64, seed: int = 0) -> list[Image.Image]:
    """`count` deterministic random RGB images of `size` x `size` pixels."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]
