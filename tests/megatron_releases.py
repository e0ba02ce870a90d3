"""The megatron-core releases the project's Megatron tests run against, and how a process gets one.

0.16.1 is the installed wheel (the last that installs on Python 3.11). 0.17.1 and 0.19.0 are
Megatron-LM source trees (`../shared/megatron_lm/core_v<release>/`, found through the environment
variable BCP_MEGATRON_LM, which .ci/run sets); their `megatron/` goes first on the path and
shadows the wheel, with the stand-ins of tests/megatron_py311/ (README there). Without the
variable the tests of those releases skip, saying why. Megatron-LM's training loop
(`megatron.training`, `pretrain_gpt.py`) exists only in the trees, 0.16.1's included.
"""

from __future__ import annotations

import contextlib
import enum
import os
import pickle
import platform
import runpy
import sys

import pytest

INSTALLED = "0.16.1"
RELEASES = ("0.16.1", "0.17.1", "0.19.0")
# the default tier runs the installed wheel and the newest tree; the release between them, whose
# interfaces are 0.16's on one side of each change and 0.19's on the other, runs in the slow tier
SLOW = ("0.17.1",)
# tests that launch Megatron-LM per release run the newest in the default tier (a launch takes
# 10-40 s; the default tier must stay under 6 minutes), every release in the slow tier
ALL_BUT_NEWEST = tuple(r for r in RELEASES if r != RELEASES[-1])
ENV_VAR = "BCP_MEGATRON_LM"
PY311 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_py311")


def skip_without_megatron_core() -> None:
    """At a test module's top: skip it where no megatron-core is installed, without importing it (a
    rank forked later may still switch release, which it cannot once megatron is imported)."""
    import importlib.util
    spec = importlib.util.find_spec("megatron")
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations or not any(os.path.isdir(os.path.join(loc, "core")) for loc in locations):
        pytest.skip("megatron-core is not installed (pip install \"bcp-checkpoint[megatron]\")",
                    allow_module_level=True)


def tree(release: str) -> str | None:
    """The Megatron-LM source tree of `release`, or None where BCP_MEGATRON_LM does not lead to one."""
    root = os.environ.get(ENV_VAR)
    path = os.path.join(root, f"core_v{release}") if root else None
    return path if path and os.path.isdir(os.path.join(path, "megatron", "core")) else None


def skip_reason(release: str, need_tree: bool = False) -> str | None:
    """Why `release` cannot run here (None if it can)."""
    if release == INSTALLED and not need_tree:
        return None
    if tree(release) is None:
        return (f"Megatron-LM core_v{release} sources not found: set {ENV_VAR} to the folder holding "
                f"core_v{release}/ (../shared/megatron_lm; .ci/run sets it)")
    return None


def params(need_tree: bool = False, releases=RELEASES, slow=SLOW) -> list:
    """pytest params, one per release, skipped where the release is absent; those in `slow` marked
    slow (SLOW, or ALL_BUT_NEWEST for a test launching whole jobs)."""
    return [pytest.param(r, id=f"mcore{r}", marks=[
        pytest.mark.skipif(skip_reason(r, need_tree) is not None, reason=skip_reason(r, need_tree) or ""),
        *([pytest.mark.slow] if r in slow else [])]) for r in releases]


def pythonpath(release: str, need_tree: bool = False) -> list[str]:
    """Folders that go first on a process's path for `release`."""
    if release == INSTALLED and not need_tree:
        return []
    return [tree(release), PY311]


def env(release: str, need_tree: bool = False) -> dict:
    """Environment entries for a subprocess (torchrun) running `release`."""
    first = pythonpath(release, need_tree)
    if not first:
        return {}
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([*first, *([rest] if rest else [])])}


class _Probe(enum.Enum):
    MEMBER = 1


def megatron_common_pt_unloadable(release: str) -> str | None:
    """Why Megatron-LM `release` cannot resume here from a checkpoint whose non-sharded values
    Megatron pickled itself into common.pt (torch_dist's, up to 0.18), or None where it can."""
    if b"getattr" not in pickle.dumps(_Probe.MEMBER) or tuple(int(x) for x in release.split(".")[:2]) >= (0, 19):
        return None
    return (f"Python {platform.python_version()} pickles enum members through getattr, which "
            f"torch.load(weights_only=True) refuses whatever is allowed: Megatron-LM {release} cannot load "
            "the common.pt Megatron itself wrote for torch_dist (its args hold enums). bcp writes its "
            "own with enum members by value (tests/test_megatron_contract.py)")


def activate(release: str, need_tree: bool = False) -> None:
    """In a fresh process that has not imported megatron yet (a rank of tests/dist.py): use `release`."""
    first = pythonpath(release, need_tree)
    if not first:
        return
    if any(m == "megatron" or m.startswith("megatron.") for m in sys.modules):
        raise RuntimeError(f"megatron is already imported in this process; cannot switch to {release}")
    sys.path[:0] = first
    runpy.run_path(os.path.join(PY311, "sitecustomize.py"))


def check_active(release: str) -> None:
    """Assert that the imported megatron-core is `release`'s minor release (a shadowing mistake fails
    loudly; the core_v0.19.0 tree calls itself 0.19.1)."""
    from megatron.core import package_info
    minor = release.rsplit(".", 1)[0] + "."
    assert package_info.__version__.startswith(minor), (package_info.__version__, release)


@contextlib.contextmanager
def torch_dist_on_cpu():
    """Around a torch_dist save or load in a CPU rank: no-ops for the two CUDA calls Megatron's
    torch_dist backend makes even for CPU tensors (notes §4), and leave for it to start its
    writer-results Manager process, which a daemonic test rank may not do."""
    import multiprocessing

    import torch
    saved = torch.cuda.synchronize, torch.cuda.current_device
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    config["daemon"] = False
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved
        config["daemon"] = daemon
