"""What reuse rests on, read from the model code and checked on the unpatched pipelines (no adapter installed).

- FLUX.2 Klein KV: the reference tokens attend only to themselves and are modulated at a fixed timestep, so
  their K/V do not change with the prompt, the seed, the step count or the output size; they do change with
  the reference pixels and the number of references.
- Qwen-Image 2.1: the prefix (text + condition images) is causal and modulated at t = 0, so its K/V do not change
  with the seed or the step count; they do change with the prompt, the references and the output size.
"""

from offload_core.bench import models

from reuse_helpers import UpstreamKV, same_kv

STEPS, RES = 2, 64


def _extracted(pipe, images, **kwargs):
    probe = UpstreamKV(pipe)
    try:
        args = models.call_kwargs(pipe, images, steps=kwargs.pop("steps", STEPS),
                                  resolution=kwargs.pop("resolution", RES), seed=kwargs.pop("seed", 0))
        pipe(**{**args, **kwargs})
    finally:
        probe.remove()
    assert probe.calls, "the pipeline ran no extract step"
    return probe.calls[0]


def _other(images):
    changed = images[0].copy()
    changed.putpixel((3, 5), (0, 0, 0))
    return [changed]


def test_flux2_reference_kv_ignore_prompt_seed_steps_and_size(flux_pipe, images):
    base = _extracted(flux_pipe, images[:1])
    for change in ({"prompt": "a green tree at night"}, {"seed": 7}, {"steps": 4},
                   {"height": 96, "width": 96, "resolution": 96}):
        assert same_kv(_extracted(flux_pipe, images[:1], **change), base), change
    assert not same_kv(_extracted(flux_pipe, _other(images)), base)
    assert not same_kv(_extracted(flux_pipe, images[:2]), base)


def test_qwen21_prefix_kv_ignore_seed_and_steps(qwen_pipe, images):
    base = _extracted(qwen_pipe, images[:1])
    for change in ({"seed": 7}, {"steps": 4}):
        assert same_kv(_extracted(qwen_pipe, images[:1], **change), base), change
    for change, imgs in (({"prompt": "a green tree at night"}, images[:1]), ({}, _other(images)),
                         ({}, images[:2]), ({"output_resolution": 96}, images[:1])):
        assert not same_kv(_extracted(qwen_pipe, imgs, **change), base), change
