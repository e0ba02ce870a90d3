"""Optional dependencies: which extra of the distribution brings which module, and one-line errors.

    from bcp_core.extras import require
    s3fs = require("s3fs", "s3", "s3:// paths")

``require`` imports and returns the module, or raises ``MissingExtraError`` whose message is one
line: ``bcp: s3:// paths needs s3fs, which is not installed: pip install "bcp-checkpoint[s3]"``.
The names of the distribution, its extras and their modules live here and nowhere else.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtraError

DISTRIBUTION = "bcp-checkpoint"

# extra -> the modules it installs that bcp imports (pyproject.toml's [project.optional-dependencies]).
EXTRAS: dict[str, tuple[str, ...]] = {
    "s3": ("s3fs",),
    "report": ("matplotlib",),
    "lightning": ("lightning",),
    "accelerate": ("accelerate",),
    "hf": ("transformers", "accelerate"),
    "megatron": ("megatron.core",),
    "deepspeed": ("deepspeed",),
    "torchdata": ("torchdata",),
}


def install_command(extra: str) -> str:
    """``pip install "bcp-checkpoint[<extra>]"``."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; the extras are {', '.join(EXTRAS)}")
    return f'pip install "{DISTRIBUTION}[{extra}]"'


def _not_installed(e: ImportError, module: str) -> bool:
    """Whether `e` says that `module` itself (or a package above it) is absent, rather than that it
    is installed but failed to import."""
    if not isinstance(e, ModuleNotFoundError) or e.name is None:
        return False
    return module == e.name or module.startswith(e.name + ".")


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import and return `module`, which `feature` needs and the distribution's `extra` installs.

    Raises ``MissingExtraError`` (a ``BCPError`` and an ``ImportError``, chained to the original)
    with a one-line message naming the extra to install when the import fails.
    """
    command = install_command(extra)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if _not_installed(e, module):
            why = "which is not installed"
        else:
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            why = f"which failed to import ({reason})"
        raise MissingExtraError(f"bcp: {feature} needs {module}, {why}: {command}",
                                module=module, extra=extra, feature=feature) from e


def require_extra(extra: str, feature: str) -> None:
    """``require`` every module of `extra` (see ``EXTRAS``), in order."""
    install_command(extra)
    for module in EXTRAS[extra]:
        require(module, extra, feature)
