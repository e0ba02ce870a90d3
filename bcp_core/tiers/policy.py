"""`Tiers`: where the checkpoints of a tiered root live, how many copies, how often to disk.

    tiers = bcp.Tiers("memory://run7", durable="/shared/run7", replicas=1, persist_every=4)
    bcp.save(tiers, state, step=n, async_save=True)   # every step: memory + replicas; every 4th: disk too
    bcp.load(tiers, state)                            # the newest whole step, from wherever it survives

The policy is a value: the same on every rank (the failure domain aside, which is per node).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..storage import storage_for
from ..storage.base import scheme_of

# What a node-local tier may be: storage whose files this process reaches with POSIX calls.
_NODE_LOCAL = ("memory", "file")
FAILURE_DOMAIN_ENV = "BCP_FAILURE_DOMAIN"


@dataclass(frozen=True)
class Tiers:
    """A tiered checkpoint root (docs/tiers.md).

    memory: each node's own fast storage, `memory://NAME` (RAM; `BCP_MEMORY_DIR` says where) or a
        node-local directory. Every rank writes its pieces there; the step is committed there once
        every piece has `replicas + 1` copies on distinct nodes.
    durable: a root every node reaches (shared file system, `s3://`...), or None. Every
        `persist_every`-th step is drained to it from memory in the background and committed
        there as an ordinary bcp checkpoint (`step_<n>` with its `latest` tracker), loadable
        anywhere without bcp's tiers.
    replicas: copies of each node's pieces on other nodes (k). Never two copies on one node, and
        with failure domains never two in one domain; the job needs k + 1 nodes (domains).
    persist_every: drain every N-th step (step % N == 0); needs `durable`.
    keep_in_memory: the newest committed steps each node keeps (M); a step leaves memory only
        once a newer one is committed there (and, if it is being drained, once drained).
    keep_durable: the newest steps kept in `durable` (None: all).
    bandwidth: bytes per second each rank may send to replicate (None: as fast as it goes).
    failure_domain: this node's failure domain (a rack, a power feed); None: $BCP_FAILURE_DOMAIN,
        else every node is a domain of its own. Given on some nodes, it must be given on all.
    """

    memory: str
    durable: str | None = None
    replicas: int = 1
    persist_every: int | None = None
    keep_in_memory: int = 2
    keep_durable: int | None = None
    bandwidth: float | None = None
    failure_domain: str | None = None

    def __post_init__(self):
        memory = os.fspath(self.memory)
        object.__setattr__(self, "memory", memory)
        if scheme_of(memory) not in _NODE_LOCAL:
            raise ValueError(f"Tiers(memory={memory!r}): the memory tier is each node's own storage, "
                             "memory://NAME or a node-local directory")
        if self.durable is not None:
            durable = os.fspath(self.durable)
            object.__setattr__(self, "durable", durable)
            if scheme_of(durable) == "memory":
                raise ValueError(f"Tiers(durable={durable!r}): durable storage must outlive a node and be "
                                 "reached by every node (a shared file system, s3://...), not memory://")
            if durable.rstrip("/") == memory.rstrip("/"):
                raise ValueError(f"Tiers: memory and durable are the same root {memory!r}")
        _check_int("replicas", self.replicas, 0)
        _check_int("keep_in_memory", self.keep_in_memory, 1)
        if self.keep_durable is not None:
            _check_int("keep_durable", self.keep_durable, 1)
            if self.durable is None:
                raise ValueError(f"Tiers(keep_durable={self.keep_durable!r}) without durable: there is no durable "
                                 "root to keep steps in")
        if self.persist_every is not None:
            _check_int("persist_every", self.persist_every, 1)
        if (self.durable is None) != (self.persist_every is None):
            raise ValueError("Tiers: durable and persist_every go together (a durable root and how often to "
                             f"drain to it); got durable={self.durable!r}, persist_every={self.persist_every!r}")
        if self.bandwidth is not None and (isinstance(self.bandwidth, bool) or
                                           not isinstance(self.bandwidth, (int, float)) or self.bandwidth <= 0):
            raise ValueError(f"Tiers(bandwidth={self.bandwidth!r}): bytes per second, > 0, or None")
        if self.failure_domain is not None and (not isinstance(self.failure_domain, str) or not self.failure_domain):
            raise ValueError(f"Tiers(failure_domain={self.failure_domain!r}): a non-empty string, or None")

    @property
    def label(self) -> str:
        """How a tiered save names itself to every rank (`SaveId.path`): the same on every node,
        where a node-local directory may be mounted at another path on each."""
        where = self.memory if scheme_of(self.memory) == "memory" else "node-local directories"
        return f"tiers in {where}" + (f" and {self.durable}" if self.durable else "")

    def domain(self) -> str | None:
        """This node's failure domain: the field, else $BCP_FAILURE_DOMAIN, else None."""
        return self.failure_domain or os.environ.get(FAILURE_DOMAIN_ENV) or None

    def persists(self, step: int) -> bool:
        """Whether `step` is drained to durable storage."""
        return self.persist_every is not None and step % self.persist_every == 0

    def memory_root(self):
        """This node's memory tier (storage)."""
        return storage_for(self.memory, fsync=False)

    def durable_root(self):
        return storage_for(self.durable) if self.durable is not None else None


def _check_int(name: str, value, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"Tiers({name}={value!r}): an integer >= {lowest}")
