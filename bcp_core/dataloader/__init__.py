"""Dataloader state that survives a change of data-parallel degree (paper §3.3, Fig. 9, §4.5).

A loader's state is split into a replicated part (configuration identical on every rank, saved once)
and sharded parts: one per *read unit*, i.e. per DP rank and read worker (one in-process unit when a
rank has no workers). Each unit owns disjoint remaining work: documents not read yet and a token
buffer. Units are saved as sharded objects (`ObjectShard`), so the metadata's `sharded_objects`
section is the paper's LoaderShardtoByteMap and a loading rank reads only the units it needs.

Resharding (docs/dataloader.md): the saved units, in global order (DP rank major, worker minor),
tile [0, 1) in equal intervals, and so do the new units. A new unit takes from every saved unit it
overlaps the same fraction of that unit's remaining work (`split_unit_state`) and joins the pieces
(`merge_unit_states`). Every remaining token therefore lands in exactly one new unit.
"""

from ..errors import LoaderStateError, ReadWorkerError
from .packed import PackedTokenLoader
from .protocol import (MappedLoader, OpaqueLoader, ReshardableLoader, checkpointable, loadable_loader_state,
                       saved_loader_state, unit_overlaps)

__all__ = ["LoaderStateError", "ReadWorkerError", "ReshardableLoader", "OpaqueLoader", "MappedLoader",
           "PackedTokenLoader", "checkpointable", "saved_loader_state", "loadable_loader_state", "unit_overlaps"]
