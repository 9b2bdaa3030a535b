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


def test_the_test_command_says_the_lint_ran_and_ends_with_pytests_summary():
    import shutil
    import subprocess

    done = subprocess.run(["bash", "scripts/test.sh", "-q", "-p", "no:cacheprovider", "tests/test_release.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(r"^\d+ passed", lines[-1]), lines[-3:]  # pytest's summary closes the output
    assert any(re.match(r"test\.sh: (actionlint ran on \d+ workflows|SKIPPED actionlint)", x) for x in lines)
    if shutil.which("node"):
        assert any(re.match(r"test\.sh: node --test tests/web .*pass \d+ fail 0", x) for x in lines), lines
