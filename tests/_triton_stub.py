"""Stand-ins for the Megatron modules that define triton kernels, on CPU-only torch (no triton).

Megatron imports triton at module level where it defines GPU kernels: megatron.training.initialize
imports the batch-invariant kernels (0.16+), and from 0.18 on megatron.core itself imports the MoE
paged-stash kernels (through the pipeline schedules). None of those kernels runs in a CPU job. Each
such module is replaced by one whose every name exists and raises when called, so its importers
import. A stand-in `triton` package would not do: torch takes an importable triton for a real one
(torch._inductor then imports triton.backends).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

#: the Megatron modules (0.16.1 to 0.19.0) that import triton at module level and are imported by
#: Megatron-LM's GPT training loop
KERNEL_MODULES = (
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",
    "megatron.core.transformer.moe.ops.paged_stash",
)


class _Unavailable:
    """A name of a kernel module: may be imported and referred to, never called."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} needs triton, which CPU-only torch does not have")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{name}.{attr}")
    module.__getattr__ = __getattr__
    return module


def install_triton_stub() -> None:
    """Put the stand-ins in sys.modules, unless triton is installed (then the real modules import)."""
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    for name in KERNEL_MODULES:
        sys.modules.setdefault(name, _stand_in(name))
