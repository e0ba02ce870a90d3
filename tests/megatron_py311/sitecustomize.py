"""Test processes of megatron-core 0.17+ on Python 3.11 without a GPU (README.md beside this)."""
import importlib.util
import sys
import types
import typing

if not hasattr(typing, "override"):
    from typing_extensions import override

    typing.override = override

TRITON_KERNEL_MODULES = ("megatron.core.transformer.moe.ops.paged_stash",
                         "megatron.core.transformer.custom_layers.batch_invariant_kernels")


def _kernel_stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr} needs triton, which this test machine lacks")
        return unavailable
    module.__getattr__ = __getattr__
    return module


if importlib.util.find_spec("triton") is None:
    for _name in TRITON_KERNEL_MODULES:
        sys.modules.setdefault(_name, _kernel_stand_in(_name))
