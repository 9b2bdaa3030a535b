"""What a registry and a new user see: licence, metadata, the one version, the changelog, the icon."""

import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import offload_core
from offload_core._version import from_pyproject

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()
VERSION = re.search(r'^version = "([^"]+)"', PYPROJECT, re.M).group(1)


def test_version_is_written_once_and_read_from_pyproject():
    assert offload_core.__version__ == VERSION
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)  # the registry wants X.Y.Z
    assert not re.search(r'__version__\s*=\s*"', (ROOT / "offload_core" / "__init__.py").read_text())


def test_a_clone_loaded_without_install_reports_its_own_pyproject_version(tmp_path):
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "offload_core", clone / "offload_core", ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "pyproject.toml").write_text(PYPROJECT.replace(f'version = "{VERSION}"', 'version = "9.8.7"', 1))
    code = "import sys; sys.path.insert(0, sys.argv[1]); import offload_core; print(offload_core.__version__)"
    done = subprocess.run([sys.executable, "-c", code, str(clone)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "9.8.7"  # not the installed metadata's version


def test_someone_elses_pyproject_is_not_read(tmp_path):
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "another"\nversion = "3.0.0"\n')
    assert from_pyproject(str(other)) is None
    assert from_pyproject(str(tmp_path / "missing.toml")) is None


def test_registry_fields_are_filled():
    for line in ('license = { text = "Apache-2.0" }', 'PublisherId = "kv-offload"', 'DisplayName = "KV Offload"',
                 'Repository = "https://github.com/kv-offload/comfyui-kv-offload"', "Documentation = ", "Issues = ",
                 "requires-comfyui = "):
        assert line in PYPROJECT
    icon_url = re.search(r'^Icon = "([^"]+)"', PYPROJECT, re.M).group(1)
    assert icon_url.endswith("/main/icon.png")


def test_icon_is_a_square_png_within_the_registry_limit():
    data = (ROOT / "icon.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width == height <= 400


def test_licence_and_changelog():
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(VERSION)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M)
    assert f"[{VERSION}]: https://github.com/kv-offload/comfyui-kv-offload/" in changelog
