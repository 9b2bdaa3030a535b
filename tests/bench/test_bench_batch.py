"""`bench --batch`: a batch of 4 from one prompt against a batch of 1, identical rows kept once and not."""

import json

import pytest

pytest.importorskip("diffusers", reason="the benchmark needs diffusers")

import torch  # noqa: E402

from offload_core.bench import batch, cli, loading, models  # noqa: E402


@pytest.mark.parametrize("which", ["qwen21", "flux2"])
def test_a_batch_of_4_keeps_and_moves_what_a_batch_of_1_does(which):
    pipe = models.qwen21_pipeline() if which == "qwen21" else models.flux2_klein_kv_pipeline()
    call = loading.call_factory(pipe, builtin=True, steps=2, resolution=64)
    rows = batch.measure(pipe, call, steps=2, runs=1, device=torch.device("cpu"), modes=("gpu", "file_async"))
    by = {(r["mode"], r["batch"]): r for r in rows}
    assert len(rows) == 6
    for mode in ("gpu", "file_async"):
        one, whole, deduped = by[(mode, "1")], by[(mode, "4, dedup off")], by[(mode, "4")]
        assert deduped["exact"] is True and whole["exact"] is True and one["exact"] is None
        assert deduped["kept_bytes"] == one["kept_bytes"] < whole["kept_bytes"]
        assert deduped["moved_bytes_per_step"] == one["moved_bytes_per_step"]
        assert deduped["rows_kept"] * 4 == deduped["rows_put"] == whole["rows_kept"]
        assert deduped["check_s"] > 0 and whole["check_s"] == 0
    assert by[("file_async", "4")]["moved_bytes_per_step"] * 3 < by[("file_async", "4, dedup off")]["moved_bytes_per_step"]
    table = batch.table(rows, "settings")
    assert "file_async | 4 |" in table and "NO" not in table


@pytest.mark.slow
def test_the_command_writes_its_rows_as_json(tmp_path, capsys):
    out = tmp_path / "batch.json"
    assert cli.main(["--batch", "--steps", "2", "--runs", "1", "--resolution", "64", "--json", str(out)]) == 0
    assert "ram_async | 4, dedup off |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["batch_rows"]
    assert [(r["mode"], r["batch"]) for r in rows][:3] == [("gpu", "1"), ("gpu", "4, dedup off"), ("gpu", "4")]


def test_modes_and_plot_do_not_apply(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--batch", "--modes", "gpu"])
    assert exit_.value.code == 2 and "--batch measures its own rows" in capsys.readouterr().err
