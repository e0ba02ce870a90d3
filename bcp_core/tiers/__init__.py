"""Tiered checkpoints: every step in each node's memory, replicated to other nodes, drained to
durable storage; recovery from the newest whole step at any world size (docs/tiers.md).

    policy.py       `Tiers`: the memory and durable roots, replicas, persist_every, what to keep
    placement.py    which nodes hold each node's replicas (failure domains), which rank sends to which
    transport.py    bytes between ranks over a gloo group of bcp's own, every wait bounded
    memory_tier.py  a tiered save as the save driver runs it: replicate, then record on every node
    replication.py  each node's files copied to its replica nodes before the step commits
    copy_check.py   whether a copy of a data file is the file the save wrote
    fetch.py        a tiered load's byte ranges a node lacks: who sends which, the view, the transfers
    drain.py        every N-th step from memory to durable storage, in the background
    recovery.py     `bcp.load(tiers, state)`: the newest whole step, fetched from the nodes holding it;
                    `locate(tiers)` finds it first, for callers that ask its metadata what to load,
                    and `load_newest(tiers, state_for)` loads what they make of it (another step's
                    metadata if damaged copies leave the first incomplete)
"""

from .policy import Tiers
from .recovery import Located, load_newest, locate

__all__ = ["Tiers", "Located", "load_newest", "locate"]
