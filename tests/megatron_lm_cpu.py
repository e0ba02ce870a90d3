"""Megatron-LM's own training loop (`pretrain_gpt.py`) on CPU with gloo, for the tests that run it
(tests/jobs/megatron_lm_pretrain.py, tests/test_megatron_lm.py). On a GPU machine do not use it.

`use_release(release)` comes first, before anything imports `megatron`: Megatron-LM's source tree of
that release goes first on the path (tests/megatron_releases.py: $BCP_MEGATRON_LM/core_v<release>,
with tests/megatron_py311's import stand-ins, in this process and in every process it starts), with
the installed wheel's compiled dataset helpers (the trees are read-only). The CPU stand-ins,
`install()` and `install_in_spawned_process()`, are recipes/_megatron_lm_cpu.py's (its recipe,
recipes/megatron_lm_pretrain.py, runs the same loop).
"""

from __future__ import annotations

import os
import sys

import megatron_releases

RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes")
if RECIPES not in sys.path:
    sys.path.append(RECIPES)  # recipes/_megatron_lm_cpu.py, here and in the processes that re-import this

from _megatron_lm_cpu import install, install_in_spawned_process, preload_tensors_copying, use_wheel_helpers  # noqa: E402,F401


def use_release(release: str) -> str:
    """Import Megatron-LM `release` ("0.19.0") from its source tree in this process and in the
    processes it starts (before `megatron` is imported anywhere here); the tree's path."""
    tree = megatron_releases.tree(release)
    if tree is None:
        raise RuntimeError(megatron_releases.skip_reason(release, need_tree=True))
    # the processes Megatron spawns (its checkpoint writers' result queue, the persistent async
    # worker) start a new interpreter: PYTHONPATH gives them the tree and the import stand-ins
    os.environ.update(megatron_releases.env(release, need_tree=True))
    megatron_releases.activate(release, need_tree=True)  # also pretrain_gpt.py's siblings (gpt_builders...)
    if not use_wheel_helpers():
        raise RuntimeError("no megatron/core/datasets/helpers_cpp*.so in site-packages: install megatron-core")
    return tree
