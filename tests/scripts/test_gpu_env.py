"""The GPU check's environment (scripts/gpu_env.py): what the host lacks comes from the wheel folder, nothing
from a network, and the host's own python is left as it was.

The host here is the test's own python; the folder holds a real wheel built in the test (no index is asked:
pip runs with --no-index, and the need exists nowhere else)."""

import base64
import hashlib
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_env.py"


def make_wheel(folder: pathlib.Path, name: str, version: str) -> None:
    """A minimal, valid pure-Python wheel of `name` with one module saying its version."""
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join(record + [f"{name}-{version}.dist-info/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def run_env(tmp_path, wheels, *needs):
    cmd = [sys.executable, str(SCRIPT), "--wheels", str(wheels), "--env", str(tmp_path / "env"), "--device", "cpu"]
    for need in needs:
        cmd += ["--need", need]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def env_python(result) -> str:
    return next(line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("python: "))


def test_a_missing_need_comes_from_the_folder_and_the_host_stays_as_it_was(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "kvo_probe", "1.2")
    result = run_env(tmp_path, wheels, "kvo_probe>=1.1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "from the wheel folder (no network): kvo_probe>=1.1" in result.stdout
    assert "in the environment: kvo_probe 1.2" in result.stdout
    probe = "import kvo_probe, torch; print(kvo_probe.VERSION, torch.__version__)"
    seen = subprocess.run([env_python(result), "-c", probe], capture_output=True, text=True, check=True).stdout
    assert seen.split()[0] == "1.2"  # ours, and the host's torch beside it
    host = subprocess.run([sys.executable, "-c", "import kvo_probe"], capture_output=True, text=True)
    assert host.returncode != 0, "the host's python was changed"


def test_what_the_host_has_is_not_installed_again(tmp_path):
    result = run_env(tmp_path, tmp_path / "no-such-folder", "torch")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "from the wheel folder: nothing (the host has every need)" in result.stdout


def test_a_version_the_host_does_not_satisfy_counts_as_missing(tmp_path):
    result = run_env(tmp_path, tmp_path / "no-such-folder", "torch<1")
    assert result.returncode == 1
    assert "there is no wheel folder" in result.stderr and "gpu_wheels.sh --python" in result.stderr


def test_a_need_the_folder_lacks_fails_with_the_command_that_makes_the_folder(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "kvo_probe", "1.2")
    result = run_env(tmp_path, wheels, "kvo_probe>=2")
    assert result.returncode == 1
    assert "without a network" in result.stderr and "gpu_wheels.sh --python" in result.stderr
