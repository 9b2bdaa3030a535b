"""The summary of scripts/gpu_check.sh: read from a results folder, one table, exit 1 on any failure.

No GPU here: the folder is what the script's steps leave behind, the benchmark JSON a real (tiny, CPU) run."""

import importlib.util
import json
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "scripts" / "gpu_summary.py")
gpu_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_summary)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="{e}" failures="{f}"
skipped="1" tests="{n}" time="12.5"></testsuite></testsuites>"""
DEMO = """mode        tier        exact    put s  get pass s  exposed wait ms
gpu         gpu         yes      0.010       0.002              0.0
ram_async   ram_async   {exact}      0.100       0.050              1.0
"""


def write(folder, step, rc, log="", **files):
    (folder / f"{step}.rc").write_text(f"{rc}\n")
    (folder / f"{step}.log").write_text(log)
    for ext, text in files.items():
        (folder / f"{step}.{ext}").write_text(text)


def bench_json(digests):
    rows = [{"key": key, "label": key, "latency_s": 1.5, "ratio_to_gpu": 1.0, "peak_device_allocated": 3 << 30,
             "exposed_wait_s": 0.01, "output_sha256": d} for key, d in digests.items()]
    return json.dumps({"v": 1, "rows": rows})


def reuse_json(hit_s=1.0, key_s=0.02, hits=1):
    rows = [{"key": "ram_async", "latency_s": 1.5}, {"key": "rerun", "latency_s": hit_s, "reuse_key_s": key_s,
                                                      "reuse_hits": hits}]
    return json.dumps({"v": 1, "rows": rows})


@pytest.fixture
def passing(tmp_path):
    write(tmp_path, "sanitizer", 0, xml=JUNIT.format(n=10, f=0, e=0))
    write(tmp_path, "tests", 0, xml=JUNIT.format(n=10, f=0, e=0))
    write(tmp_path, "demo", 0, DEMO.format(exact="yes"))
    for name in ("bench-qwen21", "bench-flux2"):
        write(tmp_path, name, 0, json=bench_json({"none": ["b"], "gpu": ["a"], "ram_async": ["a"]}))
    write(tmp_path, "reuse-key", 0, json=reuse_json())
    write(tmp_path, "stream", 2, "unknown command 'stream'; use 'bench' or 'demo'\n")
    return tmp_path


def test_everything_exact_passes_and_notes_what_is_absent(passing, capsys):
    assert gpu_summary.main([str(passing)]) == 0
    out = capsys.readouterr().out
    assert "9 passed, 0 failed, 0 errors, 1 skipped" in out and "2 tiers, every one bit-exact" in out
    assert re.search(r"bench full Qwen-Image 2.1: ram_async +pass +1.50 s \(1.00x gpu\), peak device 3.0 GiB", out)
    assert "recomputed prefix: not required" in out and "not in this version" in out
    assert re.search(r"reuse key at 9B size.*pass +key 20.0 ms per request; a hit 1.00 s against 1.50 s", out)
    assert "all checks passed" in out


def test_the_multigpu_case_is_noted_where_skipped_and_fails_when_a_test_failed(passing, capsys):
    (passing / "multigpu.skipped").write_text("== multigpu: skipped, this host has 1 GPU(s) and the case needs 2\n")
    assert gpu_summary.main([str(passing)]) == 0
    assert re.search(r"multi-GPU sampling, 2 GPUs.*note +skipped, this host has 1 GPU", capsys.readouterr().out)
    (passing / "multigpu.skipped").unlink()
    write(passing, "multigpu", 1, xml=JUNIT.format(n=6, f=1, e=0))
    assert gpu_summary.main([str(passing)]) == 1


@pytest.mark.parametrize("breakage", ["failed test", "inexact demo", "inexact row", "unstable row", "crash",
                                      "no report", "stream failed", "timeout", "nothing ran", "reuse key costs more",
                                      "reuse no hit"])
def test_any_failure_fails_the_check(passing, breakage, capsys):
    if breakage == "failed test":
        write(passing, "sanitizer", 1, xml=JUNIT.format(n=10, f=1, e=0))
    elif breakage == "inexact demo":
        write(passing, "demo", 0, DEMO.format(exact="NO"))
    elif breakage == "inexact row":
        write(passing, "bench-flux2", 0, json=bench_json({"gpu": ["a"], "file_sync_cold": ["c"]}))
    elif breakage == "unstable row":
        write(passing, "bench-qwen21", 0, json=bench_json({"gpu": ["a"], "ram_sync": ["a", "c"]}))
    elif breakage == "crash":
        write(passing, "bench-qwen21", 139, "Segmentation fault\n")
    elif breakage == "no report":
        write(passing, "tests", 4, "ERROR: usage\n")
    elif breakage == "stream failed":
        write(passing, "stream", 1, "ram_async: NOT exact\n")
    elif breakage == "reuse key costs more":  # the key took longer than the hit saved
        write(passing, "reuse-key", 0, json=reuse_json(hit_s=1.4, key_s=0.2))
    elif breakage == "reuse no hit":
        write(passing, "reuse-key", 0, json=reuse_json(hits=0))
    elif breakage == "nothing ran":  # every gpu test skipped: no CUDA after all
        write(passing, "tests", 0, xml=JUNIT.format(n=1, f=0, e=0))
    else:
        write(passing, "sanitizer", 124, "....\n", xml=JUNIT.format(n=3, f=0, e=0))
    assert gpu_summary.main([str(passing)]) == 1
    assert "SOME CHECKS FAILED" in capsys.readouterr().out


def test_a_real_benchmark_json_has_the_digests_the_summary_checks(tmp_path, one_torch_thread):
    pytest.importorskip("diffusers", reason="the benchmark needs diffusers 0.42")
    from offload_core.bench import main

    path = tmp_path / "bench-qwen21.json"
    assert main(["--runs", "1", "--steps", "2", "--resolution", "64", "--modes", "gpu,ram_async,file_sync_cold",
                 "--json", str(path)]) == 0
    write(tmp_path, "bench-qwen21", 0)
    rows = gpu_summary.bench_rows(str(tmp_path), "bench-qwen21", "bench")
    assert [status for _, status, _ in rows] == ["pass"] * 3, rows


def test_the_check_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0


def batch_json(exact):
    row = {"latency_s": 2.0, "kept_bytes": 2 << 30, "moved_bytes_per_step": 2 << 30, "rows_put": 128, "rows_kept": 32}
    rows = [dict(row, mode="ram_async", batch="1", exact=None), dict(row, mode="ram_async", batch="4, dedup off",
            exact=True), dict(row, mode="ram_async", batch="4", exact=exact)]
    return json.dumps({"settings": "s", "batch_rows": rows})


@pytest.mark.parametrize("exact", [True, False])
def test_a_batch_row_passes_only_when_bit_exact_against_dedup_off(passing, exact, capsys):
    write(passing, "batch-qwen21", 0 if exact else 1, json=batch_json(exact))
    assert gpu_summary.main([str(passing)]) == (0 if exact else 1)
    out = capsys.readouterr().out
    assert re.search(r"batch 4 vs 1, Qwen-Image 2.1: ram_async batch 4 +(pass|FAIL) +2.00 s, kept 2048 MiB, "
                     r"moved 2048 MiB/step, rows 32/128, " + ("bit-exact" if exact else "NOT bit-exact"), out), out


def test_a_real_pose_json_passes_and_an_inexact_or_refused_one_is_told(tmp_path, one_torch_thread):
    from offload_core.bench import main

    path = tmp_path / "pose.json"
    assert main(["--pose", "--frames", "1", "--runs", "1", "--json", str(path)]) == 0
    write(tmp_path, "pose", 0)
    rows = gpu_summary.pose_rows(str(tmp_path), "pose", "pose")
    assert [status for _, status, _ in rows] == ["pass"] * 6, rows
    assert rows[2][0] == "pose: ram_async" and "(1.00x ram_async)" in rows[2][2] and "bit-exact" in rows[2][2]
    data = json.loads(path.read_text())
    data["pose_rows"][3]["exact"] = False
    path.write_text(json.dumps(data))
    write(tmp_path, "pose", 1)
    rows = gpu_summary.pose_rows(str(tmp_path), "pose", "pose")
    assert rows[3][1] == "FAIL" and "NOT bit-exact" in rows[3][2]
    path.unlink()
    write(tmp_path, "pose", 2, "bench --pose: a 12.50 GiB pose cache (81 frames, width 5120) needs RAM 12.50 GiB "
          "(4.00 GiB free); use fewer --frames, or --size tiny.\n")
    assert gpu_summary.pose_rows(str(tmp_path), "pose", "pose")[0][1] == "note"
    write(tmp_path, "pose", 139, "Segmentation fault\n")
    assert gpu_summary.pose_rows(str(tmp_path), "pose", "pose")[0][1] == "FAIL"


def test_a_real_arvideo_json_passes_and_an_inexact_one_fails(tmp_path, one_torch_thread):
    from offload_core.bench.arvideo import main

    path = tmp_path / "arvideo.json"
    assert main(["--frames", "5", "--height", "32", "--width", "48", "--steps", "1", "--compute-ms", "0",
                 "--device", "cpu", "--modes", "gpu,ram_async,file_async", "--json", str(path)]) == 0
    write(tmp_path, "arvideo", 0)
    rows = gpu_summary.arvideo_rows(str(tmp_path), "arvideo", "arvideo")
    assert [r[0] for r in rows] == ["arvideo: gpu", "arvideo: ram_async", "arvideo: file_async"]
    assert all(r[1] == "pass" and "exact" in r[2] for r in rows) and "(1.00x gpu)" in rows[0][2]
    data = json.loads(path.read_text())
    data[2]["exact"] = False
    path.write_text(json.dumps(data))
    write(tmp_path, "arvideo", 1)
    assert gpu_summary.arvideo_rows(str(tmp_path), "arvideo", "arvideo")[2][1] == "FAIL"
    (tmp_path / "arvideo.json").unlink()
    write(tmp_path, "arvideo", 2, "python -m offload_core: unknown command 'arvideo'\n")
    assert gpu_summary.arvideo_rows(str(tmp_path), "arvideo", "arvideo")[0][1] == "note"
