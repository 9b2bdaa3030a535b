"""`bench --size full`: refused up front where the memory is not there; the real widths are the released
configs; the full-size code path builds in the model dtype on the device and runs (at reduced depth here)."""

import pytest
import torch

pytest.importorskip("diffusers", reason="the benchmark needs diffusers 0.42")

from offload_core.bench import fullsize, main, models  # noqa: E402


@pytest.mark.parametrize("pipeline", ["qwen21", "flux2"])
def test_full_size_without_the_memory_says_what_it_needs_and_stops(pipeline, monkeypatch, capsys):
    monkeypatch.setattr(fullsize, "_free_bytes", lambda device: 3 << 30)
    monkeypatch.setattr(fullsize, "pipeline", lambda *a, **k: pytest.fail("allocated before the memory check"))
    with pytest.raises(SystemExit) as exc:
        main(["--size", "full", "--pipeline", pipeline, "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"needs about {fullsize.need_bytes(pipeline, torch.float32, 1, 1024) / 2**30:.1f} GiB" in err
    assert "3.0 GiB are free" in err and "parameters" in err


def test_full_size_refuses_a_model_folder(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--size", "full", "--model", "somewhere"])
    assert exc.value.code == 2 and "drop --model" in capsys.readouterr().err


@pytest.mark.parametrize("pipeline", ["qwen21", "flux2"])
def test_parameter_counts_are_those_of_the_real_configs(pipeline):
    assert fullsize.parameter_count(pipeline) == fullsize.PARAMETERS[pipeline]
    hidden = fullsize.CONFIGS[pipeline]["num_attention_heads"] * fullsize.CONFIGS[pipeline]["attention_head_dim"]
    assert hidden == 4096  # DESIGN section 6: both have hidden 4096 and 32 layers
    assert fullsize.kv_bytes(pipeline, torch.bfloat16, 1, 1024) == 2 * 32 * (4096 + 64) * 4096 * 2


@pytest.mark.parametrize("pipeline", ["qwen21", "flux2"])
def test_the_full_size_path_builds_in_the_model_dtype_and_runs(pipeline, monkeypatch, one_torch_thread):
    # Real channel counts and text widths, one block of 2 heads: what the full run builds, small enough for CI.
    small = dict(fullsize.CONFIGS[pipeline], num_layers=1, num_attention_heads=2)
    if pipeline == "flux2":
        small["num_single_layers"] = 1
    else:
        small["context_in_dim"] = 64
    monkeypatch.setitem(fullsize.CONFIGS, pipeline, small)
    pipe, description = fullsize.pipeline(pipeline, torch.device("cpu"), torch.bfloat16)
    assert "full width" in description
    assert {p.dtype for p in pipe.transformer.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
    out = models.run_pipeline(pipe, models.condition_images(1, size=64), steps=2, resolution=64)
    assert out.shape[1:3] == (64, 64)
