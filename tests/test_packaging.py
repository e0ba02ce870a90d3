"""The project installs, from the local tree, into a fresh virtual environment under its distribution
name, and both entry points (the `bcp` script, `python -m bcp_core`) run there; its one compiled
module is built where a C compiler is, and left out, with the install still working, where none is.

Offline and quick: the new environment has no pip and no packages of its own; a .pth file puts this
test environment's site-packages (torch, pip, setuptools...) behind its own, and the project is
installed non-editable with --no-deps --no-build-isolation from a copy of the source tree (so no
build output lands in the checkout). That directory's own .pth files are not run from there, so an
editable install of the project in the test environment stays invisible to the new one.
"""

from __future__ import annotations

import os
import platform
import shutil
import site
import subprocess
import sys
import sysconfig
import venv

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST = "bcp-checkpoint"


def _run(cmd, cwd, env, timeout=120) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} -> {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


def _install(tmp_path, extra_env: dict | None = None) -> tuple[str, str, dict]:
    """A fresh venv with the project installed from a copy of the source tree: (python, bindir, env)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    for pkg in ("bcp_core", "bcp_integrations"):  # without the checkout's build of _memcopy
        shutil.copytree(os.path.join(REPO, pkg), src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc",
                                                                                          "*.so"))

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env_dir)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = str(bindir / ("python.exe" if os.name == "nt" else "python"))
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    outer = [p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
    with open(os.path.join(purelib, "_outer_site_packages.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(outer)) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INDEX"] = "1"
    cwd = tmp_path  # not the checkout: `python -m` would find ./bcp_core first
    _run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", str(src)], cwd,
         env | (extra_env or {}), timeout=300)

    shown = _run([python, "-m", "pip", "show", "-f", DIST], cwd, env).stdout
    assert f"Name: {DIST}" in shown
    platlib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    location = _run([python, "-c", "import bcp_core; print(bcp_core.__file__)"], cwd, env).stdout.strip()
    assert os.path.realpath(location).startswith(os.path.realpath(platlib)), location  # the fresh install
    return python, str(bindir), env


# a save and load of a tensor large enough for memcopy's compiled copy, and whether it was there
_ROUND_TRIP = """
import tempfile, torch
import bcp_core as bcp
from bcp_core import memcopy
t = torch.arange(3 << 18, dtype=torch.float32)
path = tempfile.mkdtemp()
bcp.save(path, {"t": t})
out = {"t": torch.zeros_like(t)}
bcp.load(path, out)
assert torch.equal(out["t"], t)
print(memcopy.NON_TEMPORAL)
"""

NATIVE = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and shutil.which("cc") is not None


def test_installs_into_a_fresh_venv_and_runs_both_entry_points(tmp_path):
    """Built where a C compiler is (this machine and CI's): the non-temporal copy is there and used."""
    python, bindir, env = _install(tmp_path)
    script = os.path.join(bindir, "bcp.exe" if os.name == "nt" else "bcp")
    for cmd in ([script, "--help"], [python, "-m", "bcp_core", "--help"]):
        out = _run(cmd, tmp_path, env)
        assert out.stdout.lower().startswith("usage:"), (cmd, out.stdout)
        assert "inspect" in out.stdout and "verify" in out.stdout
    native = _run([python, "-c", _ROUND_TRIP], tmp_path, env).stdout.strip()
    if NATIVE:
        assert native == "True", "bcp_core._memcopy was not built: loads copy with numpy (memcopy.py)"


@pytest.mark.slow  # a second install (20 s); the default tier keeps the one with the compiler
def test_installs_and_loads_without_a_c_compiler(tmp_path):
    """The compiled copy is optional: with no working compiler the install succeeds without it and
    a load copies with numpy."""
    python, _, env = _install(tmp_path, {"CC": "false", "LDSHARED": "false"})
    assert _run([python, "-c", _ROUND_TRIP], tmp_path, env).stdout.strip() == "False"
