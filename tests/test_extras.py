"""A missing optional dependency is one line naming the extra to install, never a traceback.

Each dependency is hidden from a child process by a stub package first on PYTHONPATH whose import
fails the way Python fails for an absent module (ModuleNotFoundError naming it), or, for an
installed but broken one, with a plain ImportError.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import bcp_core as bcp
from bcp_core.errors import BCPError, MissingExtraError
from bcp_core.extras import EXTRAS, install_command, require

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ABSENT = 'raise ModuleNotFoundError(f"No module named {__name__!r}", name=__name__)\n'
BROKEN = 'raise ImportError("hidden for the test")\n'


def _env(tmp_path, hidden: dict[str, str]) -> dict[str, str]:
    """Environment whose PYTHONPATH starts with stub packages `hidden` (top-level name -> body)."""
    stubs = tmp_path / "hidden"
    for name, body in hidden.items():
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(body)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(stubs), REPO, env.get("PYTHONPATH")) if p)
    return env


_IMPORT = textwrap.dedent("""
    import importlib, json, sys
    from bcp_core.errors import BCPError, MissingExtraError
    try:
        importlib.import_module(sys.argv[1])
    except MissingExtraError as e:
        print(json.dumps({"message": str(e), "extra": e.extra, "module": e.module, "name": e.name,
                          "is_import_error": isinstance(e, ImportError), "is_bcp_error": isinstance(e, BCPError)}))
    else:
        print(json.dumps(None))
""")


def _start_import(tmp_path, package: str, hidden: dict[str, str]) -> subprocess.Popen:
    """A child importing `package` with `hidden` stubbed out; `_import_result` reads what it raised."""
    return subprocess.Popen([sys.executable, "-c", _IMPORT, package], env=_env(tmp_path, hidden), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _import_result(proc: subprocess.Popen) -> dict | None:
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return json.loads(out)


def _import_with_hidden(tmp_path, package: str, hidden: dict[str, str]) -> dict | None:
    return _import_result(_start_import(tmp_path, package, hidden))


INTEGRATIONS = [  # package, hidden top-level package, module named in the message, extra, feature
    ("lightning", "lightning", "lightning", "lightning", "the Lightning integration"),
    ("accelerate", "accelerate", "accelerate", "accelerate", "the Accelerate integration"),
    ("hf", "transformers", "transformers", "hf", "the HF Transformers integration"),
    ("hf", "accelerate", "accelerate", "hf", "the HF Transformers integration"),  # the Trainer needs it
    ("megatron", "megatron", "megatron.core", "megatron", "the Megatron-core integration"),
]


@pytest.fixture(scope="module")
def integrations_without_frameworks(tmp_path_factory) -> dict:
    """Each INTEGRATIONS case's child process, all started at once (each mostly imports): what its
    import of the integration raised, by (package, hidden)."""
    procs = {(package, hidden): _start_import(tmp_path_factory.mktemp(f"{package}_without_{hidden}"),
                                              f"bcp_integrations.{package}", {hidden: ABSENT})
             for package, hidden, *_ in INTEGRATIONS}
    try:
        return {case: _import_result(proc) for case, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()


@pytest.mark.parametrize("package,hidden,module,extra,feature", INTEGRATIONS,
                         ids=[f"{p}-without-{h}" for p, h, *_ in INTEGRATIONS])
def test_integration_without_its_framework_is_one_line(integrations_without_frameworks, package, hidden, module,
                                                       extra, feature):
    got = integrations_without_frameworks[(package, hidden)]
    assert got is not None, f"bcp_integrations.{package} imported with {hidden} hidden"
    assert got["message"] == (f"bcp: {feature} (bcp_integrations.{package}) needs {module}, which is not installed: "
                              f'pip install "bcp-checkpoint[{extra}]"')
    assert got["extra"] == extra and got["module"] == got["name"] == module
    assert got["is_import_error"] and got["is_bcp_error"]


def test_framework_that_fails_to_import_is_one_line_too(tmp_path):
    got = _import_with_hidden(tmp_path, "bcp_integrations.lightning", {"lightning": BROKEN})
    assert got["message"] == ("bcp: the Lightning integration (bcp_integrations.lightning) needs lightning, "
                              "which failed to import (ImportError: hidden for the test): "
                              'pip install "bcp-checkpoint[lightning]"')


def test_require():
    assert require("json", "report", "a test") is json
    with pytest.raises(MissingExtraError) as info:
        require("bcp_no_such_module.sub", "s3", "reading s3:// paths")
    e = info.value
    assert isinstance(e, ImportError) and isinstance(e, BCPError) and isinstance(e, bcp.MissingExtraError)
    assert str(e) == ('bcp: reading s3:// paths needs bcp_no_such_module.sub, which is not installed: '
                      'pip install "bcp-checkpoint[s3]"')
    assert isinstance(e.__cause__, ModuleNotFoundError) and (e.module, e.extra) == ("bcp_no_such_module.sub", "s3")
    back = pickle.loads(pickle.dumps(e))  # crosses process boundaries (spawned ranks) intact
    assert str(back) == str(e) and (back.module, back.extra, back.feature) == (e.module, e.extra, e.feature)
    with pytest.raises(ValueError, match="unknown extra"):
        require("json", "nope", "a test")


def test_extras_table_matches_pyproject():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["name"] == "bcp-checkpoint"
    declared = project["optional-dependencies"]
    assert set(EXTRAS) <= set(declared)
    for extra in EXTRAS:
        assert install_command(extra) == f'pip install "bcp-checkpoint[{extra}]"'


# ----------------------------------------------------------------------------- the CLI: exit status 2, one line

def _cli_with_hidden(tmp_path, hidden: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bcp_core", *argv], env=_env(tmp_path, {hidden: ABSENT}),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def _assert_one_line(out: subprocess.CompletedProcess, extra: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert f'pip install "bcp-checkpoint[{extra}]"' in lines[0]


def test_cli_report_without_matplotlib(tmp_path):
    root = str(tmp_path / "root")
    bcp.save(root, {"model": torch.nn.Linear(4, 4)}, step=1).wait()  # writes bcp_metrics.jsonl beside it
    out = _cli_with_hidden(tmp_path, "matplotlib", "report", root, "--out", str(tmp_path / "rep"))
    _assert_one_line(out, "report")


def test_cli_s3_path_without_s3fs(tmp_path):
    out = _cli_with_hidden(tmp_path, "s3fs", "inspect", "s3://bucket/ckpt")
    _assert_one_line(out, "s3")
