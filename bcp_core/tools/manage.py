"""`bcp ls`, `bcp latest`, `bcp prune`: the step directories of a checkpoint root (bcp_core.layout)."""

from __future__ import annotations

from dataclasses import asdict

from .. import layout
from ..errors import ToolError


def list_checkpoints(root: str) -> list[dict]:
    """step_* checkpoints under root, oldest first, complete or not, the one `load(root)` uses marked latest."""
    return [asdict(e) for e in layout.list_checkpoints(root)]


def latest_checkpoint(root: str) -> str:
    """Path of the checkpoint `load(root)` would use (raises if there is no complete one)."""
    return layout.resolve(root).root


def prune_checkpoints(root: str, keep_last: int, keep_every: int | None = None, dry_run: bool = False) -> dict:
    """Delete complete checkpoints except the newest `keep_last`, every step divisible by `keep_every`,
    the tracker's and the latest; and incomplete ones older than the latest (`layout.prune`). What
    could not be deleted is listed under "failed", each with the reason."""
    if keep_last < 1:
        raise ToolError("--keep-last must be at least 1")
    if keep_every is not None and keep_every < 1:
        raise ToolError("--keep-every must be at least 1")
    result = layout.prune(root, keep_last, keep_every, dry_run=dry_run)
    return {"removed": list(result.removed), "kept": list(result.kept), "dry_run": dry_run,
            "failed": [{"name": name, "error": why} for name, why in result.failed]}
