"""`bench --overhead`: the engine's own time per get, beside a plain copy, in every RAM mode and gpu."""

import json

import pytest

from offload_core.__main__ import main


def test_overhead_rows_cover_every_mode_and_calling_context(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert main(["bench", "--overhead", "--runs", "1", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["overhead"]
    assert {(r["mode"], r["context"]) for r in rows} == {(m, c) for m in ("gpu", "ram_sync", "ram_async")
                                                          for c in ("no_grad", "inference_mode")}
    for r in rows:
        assert r["get_us"] > 0 and r["copy_us"] > 0
        assert r["engine_us"] == pytest.approx(r["get_us"] - (0 if r["mode"] == "gpu" else r["copy_us"]))
    assert "| ram_async | inference_mode |" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--modes", "gpu"], ["--batch"], ["--pose"]])
def test_overhead_refuses_options_of_the_other_benchmarks(extra, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--overhead", *extra])
    assert exit_.value.code == 2 and "--overhead measures its own rows" in capsys.readouterr().err
