"""The command line refuses every bad input with one line on stderr and exit status 2, before any work.

Every case runs in-process through the module's `main` (cheap); a few also as `python -m offload_core ...`
subprocesses, all at once, for the real exit status and stderr. "Before any work" is asserted by what did not
happen: nothing on stdout (no table, no progress), no file or folder written.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from offload_core import __main__ as cli

BAD = {
    "json folder missing": (["bench", "--json", "{tmp}/missing/x.json"], "--json"),
    "plot folder missing": (["bench", "--plot", "{tmp}/missing/x.png"], "--plot"),
    "json is a folder": (["bench", "--json", "{tmp}"], "names a directory"),
    "plot names a folder": (["bench", "--plot", "{tmp}/new/"], "names a directory"),
    "device banana": (["bench", "--device", "banana"], "--device 'banana' is not a device name"),
    "device meta": (["bench", "--device", "meta"], "the tools run on cpu, cuda, xpu or mps"),
    "modes comma": (["bench", "--modes", ","], "--modes ',' names no rows"),
    "modes unknown": (["bench", "--modes", "vram"], "unknown row 'vram'"),
    "model missing": (["bench", "--model", "{tmp}/nonexistent"], "does not exist"),
    "runs not a number": (["bench", "--runs", "x"], "invalid int value"),
    "resolution": (["bench", "--resolution", "100"], "--resolution must be a multiple of 32"),
    "demo layers 0": (["demo", "--layers", "0"], "--layers must be between 1 and"),
    "demo layers huge": (["demo", "--layers", "99999999999"], "--layers must be between 1 and"),
    "demo mib 0": (["demo", "--mib", "0"], "--mib must be between one bfloat16 element"),
    "demo mib 1e30": (["demo", "--mib", "1e30"], "--mib must be between one bfloat16 element"),
    "demo mib inf": (["demo", "--mib", "inf"], "--mib must be between"),
    "demo mib nan": (["demo", "--mib", "nan"], "--mib must be between"),
    "demo beyond RAM": (["demo", "--layers", "9000", "--mib", "4000"], "of RAM"),
    "bench json empty": (["bench", "--json", ""], "--json '' cannot be written"),
    "bench steps huge": (["bench", "--steps", "99999"], "--steps must be between 2 and 1000"),
    "bench resolution huge": (["bench", "--resolution", "1048576"], "from 32 to 4096"),
    "stream json empty": (["stream", "--json", ""], "cannot be written"),
    "stream cache beyond RAM": (["stream", "--cache-mib", "100000000"], "of RAM"),
    "demo device banana": (["demo", "--device", "banana"], "is not a device name"),
    "unknown command": (["banana"], "unknown command 'banana'"),
    "stream device banana": (["stream", "--device", "banana"], "--device 'banana' is not a device name"),
    "stream prefetch depth 0": (["stream", "--prefetch-depth", "0"], "--prefetch-depth must be between 1 and 8"),
    "stream json folder missing": (["stream", "--json", "{tmp}/missing/s.json"], "does not exist"),
    "stream rounds not a number": (["stream", "--rounds", "x"], "invalid int value"),
    "stream unknown option": (["stream", "--bogus"], "unrecognized arguments: --bogus"),
    "stream layer 0": (["stream", "--layer-mib", "0"], "--layer-mib must be >= 1"),
    "bench threads 0": (["bench", "--threads", "0"], "--threads must be between 1 and 1024"),
    "pose frames 6": (["bench", "--pose", "--frames", "6"], "--frames must be 4k + 1"),
    "pose frames 0": (["bench", "--pose", "--frames", "0"], "--frames must be 4k + 1"),
    "pose windows 0": (["bench", "--pose", "--windows", "0"], "--windows must be between 1 and 16"),
    "pose windows over frames": (["bench", "--pose", "--frames", "9", "--windows", "4"], "no more than the 3 latent"),
    "pose runs 0": (["bench", "--pose", "--runs", "0"], "--runs must be between 1 and 100"),
    "pose modes": (["bench", "--pose", "--modes", "gpu"], "--modes does not apply to --pose"),
    "pose batch": (["bench", "--pose", "--batch"], "--batch does not apply to --pose"),
    "pose model": (["bench", "--pose", "--model", "{tmp}"], "--model does not apply to --pose"),
    "pose steps": (["bench", "--pose", "--steps", "4"], "--steps does not apply to --pose"),
    "pose json folder missing": (["bench", "--pose", "--json", "{tmp}/missing/p.json"], "--json"),
    "pose device banana": (["bench", "--pose", "--device", "banana"], "--device 'banana' is not a device name"),
    "frames without pose": (["bench", "--frames", "81"], "--frames applies to the pose cache benchmark only"),
    "windows without pose": (["bench", "--windows", "2"], "--windows applies to the pose cache benchmark only"),
}
if os.path.isdir("/proc/self"):  # a folder where nothing can be created, for root too (os.access says yes to root)
    BAD["bench json in /proc"] = (["bench", "--json", "/proc/kv.json"], "--json '/proc/kv.json' cannot be written")
    BAD["stream json in /proc"] = (["stream", "--json", "/proc/kv.json"], "cannot be written")
    BAD["stream dir /proc"] = (["stream", "--dir", "/proc"], "--dir '/proc': nothing can be created there")
if not torch.backends.mps.is_available():
    BAD["device mps"] = (["bench", "--device", "mps"], "has no MPS device")
if not torch.xpu.is_available():
    BAD["device xpu"] = (["bench", "--device", "xpu"], "has no XPU device")
if not torch.cuda.is_available():
    BAD["device cuda"] = (["bench", "--device", "cuda"], "has no CUDA device")
    BAD["demo device cuda"] = (["demo", "--device", "cuda:0"], "has no CUDA device")
    BAD["stream device cuda"] = (["stream", "--device", "cuda"], "has no CUDA device")
else:
    BAD["device cuda index"] = (["bench", "--device", f"cuda:{torch.cuda.device_count()}"], "numbered from 0")


def _exit_status(argv) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's way out
        return exc.code


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_refused_in_one_line_with_exit_2(name, tmp_path, capsys):
    argv, expected = BAD[name]
    assert _exit_status([a.format(tmp=tmp_path) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and expected in err, err
    assert os.listdir(tmp_path) == []


def _run_all(cases: dict, tmp_path, env=None) -> dict:
    procs = {name: subprocess.Popen([sys.executable, "-m", "offload_core",
                                     *[a.format(tmp=tmp_path) for a in argv]],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for name, (argv, _) in cases.items()}
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        results[name] = (p.returncode, out, err)
    return results


def test_as_a_command_too_one_line_and_exit_2(tmp_path):
    some = ("json folder missing", "device banana", "model missing", "demo layers 0", "unknown command",
            "stream prefetch depth 0", "stream device banana", "pose frames 6")
    results = _run_all({name: BAD[name] for name in some}, tmp_path)
    for name, (rc, out, err) in results.items():
        expected = BAD[name][1]
        assert (rc, out) == (2, ""), f"{name}: rc {rc}, stdout {out!r}, stderr {err!r}"
        assert err.count("\n") == 1 and expected in err, f"{name}: {err!r}"
    assert sorted(os.listdir(tmp_path)) == []  # no output file, no folder made


NO_TORCH = textwrap.dedent("""
    import contextlib, io, sys
    from offload_core.__main__ import main
    for argv in sys.argv[1:]:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                code = main(argv.split())
            except SystemExit as exc:
                code = exc.code
        print(argv, code, "torch" in sys.modules)
""")


def test_help_and_usage_errors_answer_without_importing_torch(tmp_path):
    cases = ["--help", "bench --help", "stream --help", "demo --help", "bench --runs 0", "bench --modes vram",
             f"bench --json {tmp_path}/no/x.json", f"bench --model {tmp_path}/none", "stream --prefetch-depth 0",
             "stream --device banana", "stream --rounds x", "demo --layers 0", "banana", "bench --pose --frames 6",
             "bench --pose --modes gpu", "bench --frames 5"]
    done = subprocess.run([sys.executable, "-c", NO_TORCH, *cases], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    codes = {argv: line.rsplit(" ", 2)[1:] for argv, line in zip(cases, done.stdout.splitlines())}
    assert codes == {argv: ["0" if "--help" in argv else "2", "False"] for argv in cases}


def test_an_output_path_is_checked_by_creating_it_and_nothing_is_left_or_changed(tmp_path):
    from offload_core.cli import cliargs

    parser = cliargs.Parser(prog="p")
    existing = tmp_path / "kept.json"
    existing.write_text("earlier results")
    cliargs.output_file(parser, "--json", str(existing))
    cliargs.output_file(parser, "--json", str(tmp_path / "new.json"))
    cliargs.output_folder(parser, "--dir", str(tmp_path))
    assert existing.read_text() == "earlier results" and sorted(os.listdir(tmp_path)) == ["kept.json"]


def test_the_stream_depth_limit_is_the_engines():
    from offload_core.bench.stream import cli as streamcli
    from offload_core.config import MAX_PREFETCH_DEPTH

    assert streamcli.MAX_PREFETCH_DEPTH == MAX_PREFETCH_DEPTH


def test_help_lists_the_commands_and_no_argument_prints_it(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"  {name}  " in out
    assert cli.main([]) == 2  # no command is a usage error: the help goes to stderr, nothing runs
    assert capsys.readouterr().err == out


def test_demo_passes_and_says_so(capsys):
    from offload_core.cli import democli

    assert democli.main(["--device", "cpu", "--layers", "2", "--mib", "0.01"]) == 0
    out = capsys.readouterr().out
    assert out.count(" yes    yes ") == 5 and "every mode returned every layer bit-identical" in out


def test_demo_fails_when_a_round_trip_is_not_exact(monkeypatch, capsys):
    from offload_core.cli import demo, democli

    class Corrupting(demo.KVStore):
        def get(self, key):
            k, v = super().get(key)
            return k + 1, v  # what a broken tier would hand back

    monkeypatch.setattr(demo, "KVStore", Corrupting)
    assert democli.main(["--device", "cpu", "--layers", "2", "--mib", "0.01"]) == 1
    captured = capsys.readouterr()
    rows = captured.out.splitlines()[2:]
    assert len(rows) == 5 and all(row.split()[2] == "NO" for row in rows)  # the "exact" column
    assert "FAILED: gpu, ram_sync, ram_async, file_sync, file_async" in captured.err


BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = set(sys.argv.pop(1).split(","))

    class Blocker:  # what a Python without these packages says when they are imported or looked up
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Blocker())
    exec(sys.argv.pop(1))
""")


@pytest.mark.parametrize("blocked", ["diffusers", "PIL"])
def test_bench_without_its_extra_names_the_extra(blocked):
    code = "import runpy, sys; sys.argv[0] = 'offload_core'; runpy.run_module('offload_core', run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", BLOCKER, blocked, code, "bench"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and done.stdout == ""
    assert f"{blocked} missing" in done.stderr and 'pip install "comfyui-kv-offload[bench]"' in done.stderr
    assert done.stderr.count("\n") == 1


def test_diffusers_adapter_without_diffusers_names_the_extra():
    code = "from offload_core.diffusers import enable_kv_offload"
    done = subprocess.run([sys.executable, "-c", BLOCKER, "diffusers", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        'ModuleNotFoundError: offload_core.diffusers needs diffusers 0.42.x, which is not installed: '
        'pip install "comfyui-kv-offload[diffusers]"')
