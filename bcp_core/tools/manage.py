"""`bcp ls`, `bcp latest`, `bcp prune`: the step directories of a checkpoint root (bcp_core.layout)."""

from __future__ import annotations

from dataclasses import asdict

from .. import layout
from ..errors import ToolError
from ..metadata import METADATA_FILE
from ..storage import storage_for


def list_checkpoints(root: str) -> list[dict]:
    """step_* checkpoints under root, oldest first, complete or not, the one `load(root)` uses marked latest."""
    return [asdict(e) for e in layout.list_checkpoints(root)]


def latest_checkpoint(root: str) -> str:
    """Path of the checkpoint `load(root)` would use (raises if there is no complete one)."""
    return layout.resolve(root).root


def prune_checkpoints(root: str, keep_last: int, keep_every: int | None = None, dry_run: bool = False) -> dict:
    """Delete complete checkpoints except the newest `keep_last`, every step divisible by `keep_every`,
    and the latest one. Incomplete checkpoints older than the latest complete one are deleted (their
    saves ended long ago); newer ones may be saves in progress and are kept."""
    if keep_last < 1:
        raise ToolError("--keep-last must be at least 1")
    st = storage_for(root)
    ckpts = [e for e in layout.list_checkpoints(root) if e.name]
    latest = next((c for c in ckpts if c.latest), None)
    complete = [c for c in ckpts if c.complete]
    keep = {c.name for c in complete[-keep_last:]}
    if keep_every:
        keep |= {c.name for c in complete if c.step % keep_every == 0}
    if latest:
        keep.add(latest.name)
    remove, kept = [], []
    for c in ckpts:
        if c.complete:
            (kept if c.name in keep else remove).append(c)
        elif latest is not None and c.step < latest.step:
            remove.append(c)
        else:
            kept.append(c)
    if not dry_run:
        for c in remove:
            # Metadata first: a deletion cut short leaves an incomplete checkpoint, never a corrupt "complete" one.
            if c.complete:
                st.remove(f"{c.name}/{METADATA_FILE}")
            st.remove(c.name)
    return {"removed": [c.name for c in remove], "kept": [c.name for c in kept], "dry_run": dry_run}
