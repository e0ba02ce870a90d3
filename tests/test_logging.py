"""Library code speaks only through logging.getLogger("bcp") (or warnings): nothing on stdout.

The CLI (bcp_core/tools/) is the one part that prints: its output is the point.
"""

from __future__ import annotations

import ast
import logging
import os

import torch

import bcp_core as bcp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_PARTS = ("bcp_core/tools/", "bcp_core/__main__.py")


def _library_sources():
    for pkg in ("bcp_core", "bcp_integrations"):
        for dirpath, _, files in os.walk(os.path.join(REPO, pkg)):
            for name in files:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, REPO).replace(os.sep, "/")
                if name.endswith(".py") and not rel.startswith(CLI_PARTS):
                    yield rel, path


def _writes_to_std_streams(tree: ast.AST):
    """print(...) calls and sys.stdout/sys.stderr(.buffer).write(...) calls."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "print":
            yield node.lineno, "print("
        elif isinstance(f, ast.Attribute) and f.attr in ("write", "writelines"):
            target = ast.unparse(f.value)
            if target.startswith(("sys.stdout", "sys.stderr", "sys.__stdout__", "sys.__stderr__")):
                yield node.lineno, f"{target}.{f.attr}("


def test_library_code_has_no_print_or_stream_writes():
    found = []
    for rel, path in _library_sources():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=rel)
        found += [f"{rel}:{line}: {what}" for line, what in _writes_to_std_streams(tree)]
    assert not found, "library code must log through logging.getLogger('bcp'):\n" + "\n".join(found)


def test_library_leaves_logging_configuration_to_the_application():
    logger = logging.getLogger("bcp")
    assert logger.handlers == [] and logger.propagate


def test_save_and_load_print_nothing(tmp_path, capfd):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optim.step()
    root = str(tmp_path / "root")
    state = {"model": model, "optimizer": optim, "extra_state": {"step": 1, "rng": bcp.rng.rng_state()}}
    bcp.save(root, state, step=1)
    bcp.prepare_save(state, async_save=True)
    state["extra_state"]["step"] = 2
    bcp.save(root, state, step=2, async_save=True).wait()

    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    fresh_optim = torch.optim.Adam(fresh.parameters())
    loaded = {"model": fresh, "optimizer": fresh_optim, "extra_state": {}}
    bcp.load(root, loaded)
    bcp.inspect(root)
    assert loaded["extra_state"]["step"] == 2  # the root's latest checkpoint
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k

    out, err = capfd.readouterr()
    assert out == "", out
    assert err == "", err
