"""The published CI: the matrix runs the README's test command on every system and on the oldest and newest
Python the pack supports; actionlint itself runs in scripts/test.sh."""

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="reading the workflows needs pyyaml (in the test extra)")

ROOT = Path(__file__).resolve().parent.parent


def _workflow(name):
    return yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())


def test_the_matrix_runs_the_readme_test_command_everywhere():
    job = next(iter(_workflow("tests.yml")["jobs"].values()))
    matrix = job["strategy"]["matrix"]
    assert {"ubuntu", "macos", "windows"} <= {os_name.split("-")[0] for os_name in matrix["os"]}
    oldest = re.search(r'requires-python = ">=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert oldest in matrix["python"] and max(matrix["python"], key=lambda v: tuple(map(int, v.split(".")))) >= "3.13"
    commands = [step.get("run", "") for step in job["steps"]]
    assert any(c.startswith("bash scripts/test.sh") for c in commands)
    assert "bash scripts/test.sh" in (ROOT / "README.md").read_text()


def test_the_registry_is_published_on_a_version_bump_only():
    publish = _workflow("publish.yml")
    on = publish.get("on", publish.get(True))  # YAML 1.1 reads a bare `on` as True
    assert on["push"]["paths"] == ["pyproject.toml"]
