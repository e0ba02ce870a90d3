"""Planning communication between ranks, through the job's c10d key-value store, over a tree.

Plans and commit reports are small JSON messages. They travel through the store every
`torch.distributed` job already has (the TCPStore behind the default group), under keys private
to bcp, so planning never touches the training (NCCL or gloo) groups, needs no process group of
its own, never pickles, and may run on a background thread. Every wait has a timeout; a rank that
does not arrive produces an error naming the missing ranks and the phase instead of a hang. A message
larger than one store value may be (8 MiB on torch's TCPStore) travels in parts (`PART_BYTES`).

Each operation is named by its caller after what it belongs to (`s12/commit`: the commit of save 12
of a role; `l3/verify`: the verification of load 3): every rank names the same operation the same
way, so its messages meet under the same keys whatever else runs, and two different operations
never share a key. One `Comm` serves each (tag, set of ranks) for the life of the process
(`comm_for`); how long an operation may wait is an argument of the operation, not of the Comm.

Messages flow over a tree (paper §5.2), so that no rank waits on, or decodes, thousands of
messages: the ranks of one node form the first level under the node's lowest rank (its leader);
node leaders are grouped `fan_in` at a time under the lowest rank of each group, and so on until
one root, the coordinator (rank 0). No tree node has more than `fan_in` children. A gather sends
each subtree's messages as one combined message (concatenated JSON, never re-encoded on the way),
or, given a merge function, what each leader merged of its subtree (a save's plan requests: the
replicas of an entry grouped, so the coordinator reads each once per subtree); a broadcast or
scatter walks the tree down. The node size comes from the launcher
(`LOCAL_WORLD_SIZE`), or `BCP_LOCAL_WORLD_SIZE` to simulate several nodes on one machine;
`BCP_FAN_IN` overrides the fan-in.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import metrics
from .errors import BCPError, CommTimeoutError
from .metadata import parse_json
from .utils import gc_paused

DEFAULT_TIMEOUT = timedelta(minutes=10)
DEFAULT_FAN_IN = 32

# First byte of a message sent down the tree: one value for every rank, or one per rank.
_ALL, _EACH = b"A", b"E"

# The most bytes one store value holds: torch's TCPStore server (libuv, the default) drops the
# connection of a client that sets a value over 8 MiB (its MAX_PAYLOAD_LEN), and the other ranks
# waited for that message until their timeout. A larger message goes in parts of this size
# (`_PARTS` and their count under its key, set last), removed by its one reader once read.
PART_BYTES = 4 << 20
_PARTS = b"\x00"  # never the first byte of a message (JSON, _ALL, _EACH)


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError) as e:  # pragma: no cover - torch internals moved
        raise BCPError(f"cannot reach the process group's key-value store on torch {dist.__name__}: {e}") from None


_THREAD = threading.local()


def _thread_store(base):
    """This thread's own connection to the job's store `base`.

    A store client runs one operation at a time. Sharing one, a blocking wait in one thread (a
    save's commit round in the background, torch creating a group on the main thread) holds up
    every other thread's messages, and two ranks waiting on each other that way deadlock.
    """
    stores = getattr(_THREAD, "stores", None)
    if stores is None:
        stores = _THREAD.stores = {}
    entry = stores.get(id(base))
    if entry is None or entry[0] is not base:
        entry = stores[id(base)] = (base, base.clone())  # `base` kept: its id stays its own
    return entry[1]


def _forget_in_child() -> None:
    """A forked child shares its parent's sockets: it must not talk through the parent's connections."""
    global _THREAD
    _THREAD = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@dataclass(frozen=True)
class Tree:
    """The communication tree over group ranks 0..n-1.

    `children[r]` lists, per tree level that rank r leads (lowest level first), the ranks it
    receives from there. Every subtree is a contiguous range of ranks, `r .. r + span[r] - 1`,
    so concatenating a rank's own message and its children's subtree messages in rank order
    gives its subtree's messages in rank order.
    """

    parent: tuple[int | None, ...]
    children: tuple[tuple[tuple[int, ...], ...], ...]
    span: tuple[int, ...]

    @property
    def depth(self) -> int:
        """Hops from the deepest rank up to the root."""
        deepest = 0
        for r in range(len(self.parent)):
            d, p = 0, self.parent[r]
            while p is not None:
                d, p = d + 1, self.parent[p]
            deepest = max(deepest, d)
        return deepest

    def ancestors(self, rank: int) -> list[int]:
        """From the root down to `rank`'s parent."""
        out = []
        p = self.parent[rank]
        while p is not None:
            out.append(p)
            p = self.parent[p]
        return out[::-1]

    def leaders(self) -> list[int]:
        return [r for r, levels in enumerate(self.children) if levels]


def build_tree(nodes: Sequence[int], fan_in: int) -> Tree:
    """The tree for ranks whose node ids are `nodes` (one per group rank, in rank order).

    Level 0: the ranks of a node, under the node's lowest rank (a node with more than `fan_in`
    other ranks is cut into several blocks). Each next level groups the previous level's leaders,
    `fan_in + 1` at a time, under the lowest of them, until a single root is left.
    """
    if fan_in < 1:
        raise BCPError(f"fan_in must be at least 1, got {fan_in}")
    n = len(nodes)
    blocks: list[list[int]] = []
    start = 0
    for r in range(1, n + 1):
        if r == n or nodes[r] != nodes[start]:
            blocks.extend(list(range(b, min(b + fan_in + 1, r))) for b in range(start, r, fan_in + 1))
            start = r
    parent: list[int | None] = [None] * n
    children: list[list[tuple[int, ...]]] = [[] for _ in range(n)]
    while True:
        for block in blocks:
            if len(block) > 1:
                children[block[0]].append(tuple(block[1:]))
            for c in block[1:]:
                parent[c] = block[0]
        leaders = [block[0] for block in blocks]
        if len(leaders) <= 1:
            break
        blocks = [leaders[i:i + fan_in + 1] for i in range(0, len(leaders), fan_in + 1)]
    span = [1] * n
    for r in range(n - 1, -1, -1):  # children have higher ranks than their leader
        span[r] += sum(span[c] for level in children[r] for c in level)
    return Tree(tuple(parent), tuple(tuple(levels) for levels in children), tuple(span))


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise BCPError(f"environment variable {name}={value!r} is not an integer") from None


class Comm:
    """Message exchange for planning; rank 0 of the group is the coordinator.

    `local_world_size`: ranks per node, nodes holding consecutive global ranks (default:
    `BCP_LOCAL_WORLD_SIZE`, else the launcher's `LOCAL_WORLD_SIZE`, else one node).
    `fan_in`: the most children any tree node has (default: `BCP_FAN_IN`, else 32).

    Operations are named by the caller (module doc); the coordinator deletes an operation's keys
    once every rank has sent the next gather, so callers run their operations of one Comm in the
    same order on every rank (a role's saves do: they run one after another).
    """

    def __init__(self, group=None, tag: str = "default", *, fan_in: int | None = None,
                 local_world_size: int | None = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.collectives = 0  # operations performed, for tests and metrics
        self.max_wait_keys = 0  # the most messages this rank waited on at once (the fan-in it saw)
        self._stale: list[str] = []  # keys every rank has finished with, deleted by the coordinator
        if not self.distributed:
            self.rank, self.world_size = 0, 1
            self.nodes = [0]
            self.tree = build_tree([0], 1)
            return
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        members = list(dist.get_process_group_ranks(group)) if group is not None else list(range(self.world_size))
        # Keys are private to bcp, this role, this set of ranks and this launch of the workers: an
        # elastic restart keeps the launcher's store, and the new workers' operation names restart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"bcp/{tag}/{_members_id(members)}/a{attempt}/"
        self._base_store = _default_store()
        fan_in = fan_in if fan_in is not None else _env_int("BCP_FAN_IN") or DEFAULT_FAN_IN
        local = local_world_size or _env_int("BCP_LOCAL_WORLD_SIZE") or _env_int("LOCAL_WORLD_SIZE")
        if local is not None and local < 1:
            raise BCPError(f"local world size must be at least 1, got {local}")
        # a node holds consecutive global ranks; a subgroup's members are placed by their global rank
        self.nodes = [m // local for m in members] if local else [0] * len(members)
        self.tree = build_tree(self.nodes, fan_in)

    @property
    def _store(self):
        return _thread_store(self._base_store)

    def private_store(self, name: str):
        """A connection of its own to the job's store, under keys private to this Comm and `name`
        (`name` must be the same on every rank using it): for a gloo group bcp makes itself,
        named alike on every member whatever groups the job made before."""
        return dist.PrefixStore(f"{self._prefix}{name}/", self._base_store.clone())

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def node_leaders(self) -> list[int]:
        """The lowest group rank of each node, in node order."""
        return [r for r in range(self.world_size) if r == 0 or self.nodes[r] != self.nodes[r - 1]]

    def _key(self, op: str) -> str:
        """The keys' base of an exchange `op` (counted)."""
        self.collectives += 1
        return self._op_key(op)

    def _op_key(self, op: str) -> str:
        if not op or "//" in op or op.startswith("/") or op.endswith("/"):
            raise BCPError(f"bad operation name {op!r}")
        return f"{self._prefix}{op}"

    # -- up the tree -------------------------------------------------------------------------------

    def _up(self, base: str, mine: Any, op: str, timeout: timedelta, merge: Callable[[list], Any] | None = None):
        """This subtree's messages, sent to the parent or returned on the coordinator: as one JSON
        array in rank order (`mine`: this rank's message, encoded), or, with `merge`, what `merge`
        makes of this rank's object `mine` and the children's subtree objects, in rank order."""
        parts = [mine]
        levels = self.tree.children[self.rank]
        if levels:
            # lets a waiting ancestor tell a leader that never came from one still waiting below
            self._store.set(f"{base}/{self.rank}/a", b"")
        for kids in levels:
            keys = [f"{base}/{c}" for c in kids]
            self._wait_up(base, keys, kids, op, timeout)
            received = self._get_all(keys)
            if merge is None:
                parts.extend(v[1:-1] for v in received)  # strip each array's brackets
            else:
                parts.extend(_decode_all(received))
        combined = b"[" + b",".join(parts) + b"]" if merge is None else merge(parts)
        if not self.is_coordinator:
            self._set(f"{base}/{self.rank}", combined if merge is None else _encode(combined))
            return None
        # Every rank has sent this operation, so all have finished the operations before it.
        for k in self._stale:
            self._store.delete_key(k)
        self._stale = [f"{base}/{r}" for r in range(1, self.world_size)] + \
                      [f"{base}/{r}/a" for r in self.tree.leaders()]
        return combined

    def _wait_up(self, base: str, keys: list[str], kids: Sequence[int], op: str, timeout: timedelta) -> None:
        self.max_wait_keys = max(self.max_wait_keys, len(keys))
        try:
            with metrics.phase("wait"):  # time spent on other ranks, kept apart from this rank's own work
                self._store.wait(keys, timeout)
        except Exception as e:  # noqa: BLE001 - the store raises a bare RuntimeError/DistStoreError on timeout
            missing = [m for c in kids for m in self._missing_below(base, c)]
            raise self._timeout(op, missing or list(kids), e, timeout) from None

    def _missing_below(self, base: str, rank: int) -> list[int]:
        """The ranks of `rank`'s subtree that never sent: a leader that arrived is waiting on someone."""
        if self._store.check([f"{base}/{rank}"]):
            return []
        if not self.tree.children[rank] or not self._store.check([f"{base}/{rank}/a"]):
            return [rank]
        return [m for kids in self.tree.children[rank] for c in kids for m in self._missing_below(base, c)]

    # -- down the tree -----------------------------------------------------------------------------

    def _down(self, base: str, message: bytes | None, op: str, timeout: timedelta, items: list | None = None) -> bytes:
        """The coordinator's `message` (tagged _ALL, or _EACH with the coordinator's per-rank `items`)
        arrives at every rank; returns this rank's copy."""
        if not self.is_coordinator:
            key = f"{base}/d/{self.rank}"
            self.max_wait_keys = max(self.max_wait_keys, 1)
            try:
                # Twice the timeout: the coordinator may itself be waiting up to `timeout` for a
                # missing rank, and its error naming that rank should reach us, not a second timeout.
                with metrics.phase("wait"):
                    self._store.wait([key], 2 * timeout)
            except Exception as e:  # noqa: BLE001 - see _wait_up
                chain = self.tree.ancestors(self.rank) + [self.rank]
                # the first rank on the path from the root that did not pass the message on
                stuck = next((a for a, b in zip(chain, chain[1:]) if not self._store.check([f"{base}/d/{b}"])),
                             chain[-2])
                raise self._timeout(op, [stuck], e, 2 * timeout) from None
            message = self._get_all([key])[0]
        else:
            self._stale.extend(f"{base}/d/{r}" for r in range(1, self.world_size))
        kids = [c for level in self.tree.children[self.rank] for c in level]
        if message[:1] == _EACH:
            if items is None:
                items = _decode(message[1:])
            for c, sub in subtree_messages(self.tree, self.rank, items).items():
                self._set(f"{base}/d/{c}", sub)
            return _EACH + _encode(items[:1])
        for c in kids:
            self._set(f"{base}/d/{c}", message)
        return message

    # -- messages of any size ------------------------------------------------------------------

    def _set(self, key: str, message: bytes) -> None:
        """Send `message` under `key`, in parts if the store would refuse it whole (`PART_BYTES`)."""
        if len(message) <= PART_BYTES:
            self._store.set(key, message)
            return
        n = -(-len(message) // PART_BYTES)
        for i in range(n):
            self._store.set(f"{key}/p{i}", message[i * PART_BYTES:(i + 1) * PART_BYTES])
        self._store.set(key, _PARTS + str(n).encode())  # last: the reader waits for it

    def _get_all(self, keys: list[str]) -> list[bytes]:
        """The messages under `keys` (all there), each read by this rank alone: the parts of one
        sent in parts are joined and removed from the store."""
        messages = self._store.multi_get(keys)
        for i, (key, message) in enumerate(zip(keys, messages)):
            if message[:1] == _PARTS:
                parts = [f"{key}/p{k}" for k in range(int(message[1:]))]
                messages[i] = b"".join(self._store.get(p) for p in parts)
                for p in parts:
                    self._store.delete_key(p)
        return messages

    def _timeout(self, op: str, missing: list[int], cause: Exception, waited: timedelta) -> CommTimeoutError:
        return CommTimeoutError(
            f"bcp {op}: rank {self.rank} waited {waited} for rank(s) {missing} "
            f"that never arrived ({type(cause).__name__}); they may have crashed or be stuck elsewhere")

    # -- operations --------------------------------------------------------------------------------

    def gather(self, obj: Any, op: str, timeout: timedelta = DEFAULT_TIMEOUT,
               merge: Callable[[list], Any] | None = None) -> Any:
        """Every rank's `obj` on the coordinator (in rank order); None elsewhere.

        With `merge`, each tree node passes up what `merge(parts)` makes of its subtree instead of
        the concatenation: `parts` are its own `obj` and its children's results, in rank order, and
        `obj` is a result for one rank (of the type merge returns), so merging consecutive
        subtrees in any grouping gives the same (save_planner.merge_plan_messages). The
        coordinator returns merge's result over every rank.
        """
        if not self.distributed:
            self.collectives += 1
            return [obj] if merge is None else merge([obj])
        combined = self._up(self._key(op), _encode(obj) if merge is None else obj, op, timeout, merge)
        return combined if combined is None or merge is not None else _decode(combined)

    def broadcast(self, obj: Any, op: str, timeout: timedelta = DEFAULT_TIMEOUT) -> Any:
        """The coordinator's `obj` on every rank (`obj` is read on the coordinator only)."""
        if not self.distributed:
            self.collectives += 1
            return obj
        message = _ALL + _encode(obj) if self.is_coordinator else None
        return _unpack(self._down(self._key(op), message, op, timeout))

    def scatter(self, objs: list[Any] | None, op: str, timeout: timedelta = DEFAULT_TIMEOUT) -> Any:
        """`objs[r]` on rank r (`objs` is read on the coordinator only).

        Each leader receives only its subtree's part, so no rank handles every rank's message.
        The coordinator may `broadcast` under the same name instead (one answer for all ranks, an
        error say): ranks calling `scatter` receive the broadcast value.
        """
        if self.is_coordinator and (objs is None or len(objs) != self.world_size):
            raise BCPError(f"scatter needs one object per rank ({self.world_size}), got "
                           f"{None if objs is None else len(objs)}")
        if not self.distributed:
            self.collectives += 1
            return objs[0]
        # the coordinator encodes only each child's part, never the whole list
        return _unpack(self._down(self._key(op), _EACH if self.is_coordinator else None, op, timeout, objs))

    def all_gather(self, obj: Any, op: str, timeout: timedelta = DEFAULT_TIMEOUT) -> list[Any]:
        if not self.distributed:
            self.collectives += 1
            return [obj]
        base = self._key(op)
        combined = self._up(base, _encode(obj), op, timeout)
        return _decode(self._down(base, _ALL + combined if combined is not None else None, op, timeout)[1:])

    # -- a value the first proposer fixes for every rank (no waiting) ---------------------------

    def propose(self, name: str, value: str) -> str:
        """Set `name` to `value` unless some rank set it first; returns the value that holds."""
        if not self.distributed:
            return value
        return self._store.compare_set(f"{self._prefix}{name}", "", value).decode()

    def settle(self, op: str, outcome: str) -> str:
        """Set the outcome of operation `op` to `outcome` unless a rank set one first; returns the
        outcome that holds. One atomic step of the store, so two ranks that each act on their own
        outcome (the coordinator commits, a rank gives up waiting) cannot both go ahead. The
        coordinator forgets it with the operation's other keys."""
        if not self.distributed:
            return outcome
        key = f"{self._op_key(op)}/outcome"
        held = self._store.compare_set(key, "", outcome).decode()
        if self.is_coordinator:
            self._stale.append(key)
        return held

    def peek(self, name: str) -> str | None:
        """The value of `name` if some rank proposed one, without waiting (one store round trip)."""
        if not self.distributed:
            return None
        key = f"{self._prefix}{name}"
        return self._store.get(key).decode() if self._store.check([key]) else None

    def barrier(self, op: str, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if not self.distributed:
            self.collectives += 1
            return
        base = self._key(op)
        done = self._up(base, b"0", op, timeout)
        self._down(base, _ALL + b"0" if done is not None else None, op, timeout)

    # -- bytes from each node's lowest rank to the node's other ranks (gloo) ---------------------

    def node_broadcast(self, read: Callable[[], bytes], op: str, what: str,
                       timeout: timedelta = DEFAULT_TIMEOUT) -> bytes:
        """`read()` on the lowest rank of each node, its bytes (`what` they are, for messages) on
        every rank of that node, over a gloo group of the node, bounded by `timeout`: for bytes too
        large for the store that every rank of a node would otherwise read alike (a checkpoint's
        metadata). A leader that cannot read sends a failure mark; its node's ranks raise naming it."""
        node = self.nodes[self.rank]
        local = [r for r in range(self.world_size) if self.nodes[r] == node]
        leader = local[0]
        data, error = b"", None
        if self.rank == leader:
            try:
                data = read()
            except Exception as e:  # noqa: BLE001 - the node's other ranks are told, then this rank raises it
                error = e
        if len(local) > 1:
            group = self._node_group(local, timeout)
            size = torch.tensor([-1 if error is not None else len(data)], dtype=torch.int64)
            self._bounded(group.broadcast(size, 0), leader, op, what, timeout)
            if size.item() < 0:
                raise BCPError(f"{op}: rank {leader}, which reads {what} for its node, could not read it")
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == leader and data else \
                torch.empty(int(size.item()), dtype=torch.uint8)
            if buf.numel():
                self._bounded(group.broadcast(buf, 0), leader, op, what, timeout)
            data = buf.numpy().tobytes()
        if error is not None:
            raise error
        return data

    def _node_group(self, local: list[int], timeout: timedelta):
        """A gloo group of this node's ranks (group ranks `local`), made once per Comm.

        It is made outside torch's group registry, on a store prefix private to the Comm and the
        node: the same name on every member whatever groups each has made before. (torch names a
        group made with `use_local_synchronization=True` after the number of groups *this* rank
        knows, which differs between ranks once a framework made groups only some ranks belong to
        — Megatron's pipeline and embedding groups — so the members waited under different keys,
        forever.)"""
        key = (id(self), tuple(local))
        group = _NODE_GROUPS.get(key)
        if group is None:
            store = self.private_store(f"node{self.nodes[self.rank]}")
            group = _NODE_GROUPS[key] = dist.ProcessGroupGloo(store, local.index(self.rank), len(local), timeout)
        return group

    def _bounded(self, work, leader: int, op: str, what: str, timeout: timedelta) -> None:
        try:
            work.wait(timeout)
        except RuntimeError as e:
            raise CommTimeoutError(f"bcp {op}: rank {self.rank} waited {timeout} for {what} from rank "
                                   f"{leader} ({e})") from None


_NODE_GROUPS: dict[tuple, Any] = {}  # (id of a Comm, its node's ranks) -> the node's gloo group


_COMMS: dict[tuple, Comm] = {}


def save_tag(role: str) -> str:
    """The Comm tag of a save role's exchanges: in a namespace of its own, so that no role name (a
    user's "load", say) shares a Comm with the loads, the preemption handler or the drains, whose
    operations would then remove each other's keys."""
    return f"save/{role}"


def comm_for(group=None, tag: str = "default") -> Comm:
    """The process's Comm for `tag` over `group`'s ranks (created at the first call).

    One per (tag, set of ranks, store): its operation names never repeat, so keys never collide,
    whatever timeouts the operations use.
    """
    if dist.is_available() and dist.is_initialized():
        members = tuple(dist.get_process_group_ranks(group)) if group is not None else \
            tuple(range(dist.get_world_size()))
        key = (tag, members, id(_default_store()))  # a re-initialised process group has a new store
    else:
        key = (tag, None, None)
    comm = _COMMS.get(key)
    if comm is None:
        comm = _COMMS[key] = Comm(group, tag)
    return comm


def subtree_messages(tree: Tree, rank: int, items: list) -> dict[int, bytes]:
    """What `rank` sends each child in a scatter: the items of the child's subtree (`items` are
    those of `rank`'s own subtree, in rank order)."""
    return {c: _EACH + _encode(items[c - rank:c - rank + tree.span[c]])
            for level in tree.children[rank] for c in level}


def _unpack(message: bytes) -> Any:
    value = _decode(message[1:])
    return value[0] if message[:1] == _EACH else value


def _members_id(members) -> str:
    members = list(members)
    if members == list(range(len(members))):
        return f"w{len(members)}"
    import hashlib
    return hashlib.blake2b(",".join(map(str, members)).encode(), digest_size=8).hexdigest()


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@gc_paused  # a leader's children's messages: many small objects together (see _decode)
def _decode_all(messages: list[bytes]) -> list[Any]:
    return [parse_json(m, "bcp message") for m in messages]


def _decode(data: bytes) -> Any:
    # a gathered plan of a large job is millions of small objects: see planner.gc_paused
    return gc_paused(parse_json)(data, "bcp message") if len(data) > 1 << 20 else parse_json(data, "bcp message")
