"""The pipeline under test: the built-in random Qwen-Image 2.1, or a local diffusers folder."""

from __future__ import annotations

from typing import Callable

import torch

from . import fullsize, models
from .folder import check_model_folder

# Default built-in model: wide enough that each layer's attention and MLP, not Python, dominate a step on a
# CPU, small enough that the whole table prints in well under two minutes on two cores.
BENCH_SIZE = models.TinySize(layers=6, heads=4, head_dim=128, context_dim=64)


def pipeline(args):
    """(pipe, description) of the pipeline `bench`'s options name (`--size`, `--pipeline`, `--model`)."""
    if args.size == "full":
        return fullsize.pipeline(args.pipeline, args.device, args.torch_dtype)
    if args.pipeline == "flux2" and args.model is None:
        pipe = models.flux2_klein_kv_pipeline(BENCH_SIZE, device=args.device, dtype=args.torch_dtype)
        return pipe, f"built-in Flux2KleinKVPipeline, random weights ({BENCH_SIZE.layers} double layers)"
    return load(args.model, args.device, args.torch_dtype)


def load(model: str | None, device: torch.device, dtype: torch.dtype):
    """(pipeline, description). `model`: None for the built-in one, else a local diffusers folder."""
    if model is None:
        pipe = models.qwen21_pipeline(BENCH_SIZE, device=device, dtype=dtype)
        size = BENCH_SIZE
        hidden = size.heads * size.head_dim
        return pipe, f"built-in QwenImage21Pipeline, random weights ({size.layers} layers, hidden {hidden})"
    class_name = check_model_folder(model)
    import diffusers

    pipe = getattr(diffusers, class_name).from_pretrained(model, dtype=dtype, local_files_only=True)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe, f"{class_name} from {model}"


def call_factory(pipe, *, builtin: bool, steps: int, resolution: int, n_images: int = 1) -> Callable[[], dict]:
    """A function returning fresh call kwargs (a new seeded generator each time) for one request."""
    images = models.condition_images(n_images, size=resolution, seed=1)
    if builtin:
        return lambda: models.call_kwargs(pipe, images, steps=steps, resolution=resolution)
    flux = models.pipeline_kind(pipe) == "flux2"
    size = {"height": resolution, "width": resolution} if flux else {"output_resolution": resolution}
    if flux:
        size["text_encoder_out_layers"] = _flux2_text_layers(pipe.text_encoder)

    def real_kwargs() -> dict:
        return dict(prompt="a red cat on a blue sky, oil painting", image=list(images), num_inference_steps=steps,
                    generator=torch.Generator().manual_seed(0), output_type="np", **size)

    return real_kwargs


def _flux2_text_layers(text_encoder) -> tuple[int, ...]:
    """The pipeline's default hidden-state taps (9, 18, 27), or the same thirds of a shallower encoder."""
    depth = text_encoder.config.num_hidden_layers
    return (9, 18, 27) if depth >= 27 else tuple(max(1, depth * k // 3) for k in (1, 2, 3))


def supports_no_cache(pipe) -> bool:
    """Only Qwen-Image 2.1 can skip its cache (`use_kv_cache=False`); FLUX.2 Klein KV always caches."""
    return models.pipeline_kind(pipe) != "flux2"
