"""Test processes of megatron-core 0.17+ on Python 3.11 without a GPU (README.md beside this)."""
import importlib.util
import os
import sys
import typing

if not hasattr(typing, "override"):
    from typing_extensions import override

    typing.override = override


def _recipes_cpu_stand_ins():
    """recipes/_megatron_lm_cpu.py, imported once under its own name."""
    if "_megatron_lm_cpu" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes", "_megatron_lm_cpu.py")
        spec = importlib.util.spec_from_file_location("_megatron_lm_cpu", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["_megatron_lm_cpu"] = module
        spec.loader.exec_module(module)
    return sys.modules["_megatron_lm_cpu"]


_recipes_cpu_stand_ins().without_triton()
