"""The environment of `scripts/gpu_check.sh` on a GPU host that reaches no package index.

Run by the host's python (the one with CUDA torch). What that python lacks of the check's needs (diffusers, pytest:
the `--need` requirements) is installed from a wheel folder made beforehand by `scripts/gpu_wheels.sh`, never from
a network, into an environment of our own (`--env`): a venv without pip whose `host.pth` puts the host's
site-packages after its own, so the host's torch, CUDA libraries and transformers are used as they are, nothing of
the host is changed, and a package the folder brings shadows the host's only where the host's does not satisfy
a need. pip itself comes from the folder too (a pip wheel runs as it is), so the host needs no pip of its own.

Prints one line per fact (python, torch, CUDA, what was installed) and, last, the environment's python on a line
`python: PATH`; exit 1 with the reason and the fix when a need cannot be met.

Usage: HOST_PYTHON scripts/gpu_env.py --wheels DIR --env DIR [--need REQ ...] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata as md
import os
import re
import site
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_extra_spec(name: str) -> str:
    """`name`'s requirement as pyproject.toml's test extra writes it (e.g. `diffusers>=0.42,<0.43`)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    test = re.search(r"^test = \[(.*?)\]$", text, re.M | re.S).group(1)
    found = re.search(rf'"({re.escape(name)}(?:[<>=!~][^";]*)?)"', test)
    return found.group(1) if found else name


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0]


def missing(needs: list[str]) -> list[str]:
    """The needs the running python does not satisfy (absent, or a version outside the requirement)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # no `packaging` on the host: only absence is checked, pip then sees to the versions
        Requirement = None
    out = []
    for need in needs:
        try:
            have = md.version(_name(need))
        except md.PackageNotFoundError:
            out.append(need)
            continue
        spec = Requirement(need).specifier if Requirement else None
        if spec and not spec.contains(have, prereleases=True):
            out.append(need)
    return out


def host_site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return [d for i, d in enumerate(dirs) if os.path.isdir(d) and d not in dirs[:i]]


def make_env(env_dir: str) -> str:
    """A venv at `env_dir` (no pip) that sees the host's packages after its own; its python."""
    venv.EnvBuilder(with_pip=False, clear=False, symlinks=os.name != "nt").create(env_dir)
    python = os.path.join(env_dir, "Scripts" if os.name == "nt" else "bin", "python")
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(own, "host.pth"), "w") as f:
        f.write("\n".join(host_site_dirs()) + "\n")
    return python


def pip_command(python: str, wheels: str) -> list[str]:
    """pip from the wheel folder (a pip wheel runs as it is), else the host's own pip as the environment sees it."""
    pips = sorted(glob.glob(os.path.join(wheels, "pip-*.whl")))
    if pips:
        return [python, os.path.join(pips[-1], "pip")]
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
        return [python, "-m", "pip"]
    raise SystemExit(f"gpu_env: no pip: none on the host and no pip wheel in the wheel folder {wheels!r}; make the "
                     "folder again with `bash scripts/gpu_wheels.sh` on a machine with a package index.")


def install(python: str, wheels: str, needs: list[str]) -> None:
    if not os.path.isdir(wheels):
        raise SystemExit(f"gpu_env: this host lacks {' '.join(needs)} and there is no wheel folder {wheels!r}: on a "
                         "machine with a package index run `bash scripts/gpu_wheels.sh --python "
                         f"{sys.version_info.major}.{sys.version_info.minor}` and copy gpu-wheels/ into this checkout "
                         "(or point GPU_CHECK_WHEELS at it).")
    cmd = pip_command(python, wheels) + ["install", "-q", "--disable-pip-version-check", "--no-index",
                                         "--find-links", wheels, "--no-warn-script-location", *needs]
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull)
    if subprocess.run(cmd, env=env).returncode != 0:
        raise SystemExit(f"gpu_env: could not install {' '.join(needs)} from {wheels!r} without a network (above: "
                         "pip's reason). The folder must be made for this host's Python "
                         f"{sys.version_info.major}.{sys.version_info.minor} and machine: on a machine with an index, "
                         f"`bash scripts/gpu_wheels.sh --python {sys.version_info.major}.{sys.version_info.minor}`.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheels", required=True, help="the wheel folder made by scripts/gpu_wheels.sh")
    p.add_argument("--env", required=True, help="where to make the check's environment (made anew each run)")
    p.add_argument("--need", action="append", help="a requirement (default: diffusers and pytest as pyproject.toml "
                                                   "names them)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a CPU-only stand-in of the host (torch without CUDA is then accepted)")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu_env: {sys.executable} has torch {torch.__version__} without a usable CUDA device; "
                         "run the check with PYTHON=/path/to/the/python/with/CUDA/torch.")
    needs = args.need or [test_extra_spec("diffusers"), test_extra_spec("pytest")]
    print(f"host python: {sys.executable} {sys.version.split()[0]}")
    print(f"torch: {torch.__version__}, CUDA {torch.version.cuda}, device "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}")
    lacking = missing(needs)
    python = make_env(args.env)
    if lacking:
        print(f"from the wheel folder (no network): {' '.join(lacking)}")
        install(python, args.wheels, lacking)
    else:
        print("from the wheel folder: nothing (the host has every need)")
    check = "import importlib.metadata as m, sys; print(', '.join(f'{n} {m.version(n)}' for n in sys.argv[1:]))"
    names = [_name(n) for n in needs]
    print("in the environment: " + subprocess.run([python, "-c", check, *names], capture_output=True, text=True,
                                                  check=True).stdout.strip())
    print(f"python: {python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
