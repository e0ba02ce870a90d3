"""Offline tools over checkpoints, and the `bcp` command line that drives them.

- `read`: opening a checkpoint, reading tensors in bounded memory, progress bars, capped JSON files;
- `inspect`, `verify`: what a checkpoint holds, and whether it is whole (metadata and headers only;
  nothing is ever unpickled);
- `rename`: key rules and in-place key renames; `convert`: export to HF / torch.save (the output
  whole or absent); `importing`: import from HF / DCP / torch.save;
- `manage`: list, latest and prune over a checkpoint root;
- `report`: per-rank phase timings as a heat map and timeline;
- `cli`: `bcp` / `python -m bcp_core`, a thin layer over the functions re-exported here.
"""

from ..errors import ToolError
from .convert import export_checkpoint
from .importing import import_checkpoint
from .inspect import format_inspect, inspect_checkpoint
from .manage import latest_checkpoint, list_checkpoints, prune_checkpoints
from .read import read_blocks, read_tensor
from .rename import rename_checkpoint
from .verify import verify_checkpoint

__all__ = [
    "inspect_checkpoint", "format_inspect", "verify_checkpoint", "export_checkpoint", "import_checkpoint",
    "rename_checkpoint", "list_checkpoints", "latest_checkpoint", "prune_checkpoints", "read_blocks",
    "read_tensor", "ToolError",
]
