"""Tiered checkpoints: every step in each node's memory, replicated to other nodes, drained to
durable storage; recovery from the newest whole step at any world size (docs/tiers.md).

    policy.py       `Tiers`: the memory and durable roots, replicas, persist_every, what to keep
    placement.py    which nodes hold each node's replicas (failure domains), which rank sends to which
    transport.py    bytes between ranks over a gloo group of bcp's own, every wait bounded
    memory_tier.py  a tiered save as the save driver runs it: replicate, then record on every node
    replication.py  each node's files copied to its replica nodes before the step commits
    drain.py        every N-th step from memory to durable storage, in the background
    recovery.py     `bcp.load(tiers, state)`: the newest whole step, fetched from the nodes holding it;
                    `locate(tiers)` finds it first, for callers that ask its metadata what to load
"""

from .policy import Tiers
from .recovery import Located, locate

__all__ = ["Tiers", "Located", "locate"]
