"""Where each node's replicas go, and which rank sends to which.

Nodes are numbered 0..m-1 in rank order (a node holds consecutive ranks). Node x's k replicas go
to k other nodes, each in a failure domain other than x's and than each other's (with no domains
given, every node is its own). Among the nodes that qualify, the one holding the fewest replicas
so far is taken first, then the nearest after x in ring order: with k = 1 and no domains that is
the ring x -> x+1, and in general every node holds about k nodes' replicas.

Rank i of node x (its i-th rank) sends its files to rank i mod n_y of each replica node y, so a
node's ranks share the sending and the receiving.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import BCPError


class PlacementError(BCPError):
    """The job cannot hold the copies asked for: too few nodes or failure domains."""


@dataclass(frozen=True)
class Placement:
    """The replica nodes of each node, and the ranks of each node (group ranks, in order)."""

    node_ranks: tuple[tuple[int, ...], ...]
    replica_nodes: tuple[tuple[int, ...], ...]

    def node_of(self, rank: int) -> int:
        return next(x for x, ranks in enumerate(self.node_ranks) if rank in ranks)

    def destinations(self, rank: int) -> list[int]:
        """The ranks `rank` sends its files to, one per replica node."""
        x = self.node_of(rank)
        i = self.node_ranks[x].index(rank)
        return [self.node_ranks[y][i % len(self.node_ranks[y])] for y in self.replica_nodes[x]]

    def sources(self, rank: int) -> list[int]:
        """The ranks that send their files to `rank`, in rank order."""
        return sorted(r for ranks in self.node_ranks for r in ranks if rank in self.destinations(r))

    def holders(self, node: int) -> tuple[int, ...]:
        """The nodes holding node `node`'s files: itself, then its replica nodes."""
        return (node, *self.replica_nodes[node])


def nodes_of(node_ids: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each node, from each rank's node id (`Comm.nodes`): nodes numbered in rank order."""
    out: list[list[int]] = []
    for r, n in enumerate(node_ids):
        if r == 0 or n != node_ids[r - 1]:
            out.append([])
        out[-1].append(r)
    return tuple(tuple(ranks) for ranks in out)


def place(node_ranks: tuple[tuple[int, ...], ...], domains: Sequence[str | None], k: int) -> Placement:
    """The placement of k replicas of each node (module doc). `domains`: each node's failure
    domain, or None for all of them."""
    m = len(node_ranks)
    given = [d is not None for d in domains]
    if any(given) and not all(given):
        missing = [x for x, d in enumerate(domains) if d is None]
        raise PlacementError(f"a failure domain was given on some nodes but not on node(s) {missing}: give "
                             "every node one (Tiers.failure_domain or $BCP_FAILURE_DOMAIN), or none")
    labels = list(domains) if all(given) and m else [f"node {x}" for x in range(m)]
    if k and m < k + 1:
        raise PlacementError(f"replicas={k} needs at least {k + 1} nodes (each copy on a node of its own); this "
                             f"job has {m}. Use replicas={max(0, m - 1)}, or more nodes")
    held = [0] * m
    replicas = []
    for x in range(m):
        chosen: list[int] = []
        while len(chosen) < k:
            taken = {labels[x], *(labels[c] for c in chosen)}
            ok = [y for y in range(m) if labels[y] not in taken]
            if not ok:
                kinds = sorted(set(labels))
                raise PlacementError(
                    f"replicas={k} needs {k + 1} failure domains (no two copies in one); the job's nodes are in "
                    f"{len(kinds)}: {', '.join(map(repr, kinds))}")
            y = min(ok, key=lambda y: (held[y], (y - x) % m))
            chosen.append(y)
            held[y] += 1
        replicas.append(tuple(chosen))
    return Placement(node_ranks, tuple(replicas))
