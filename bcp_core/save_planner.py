"""Save planning: what each rank holds, what each rank writes, and the metadata that results.

1. Every rank describes what it holds (`local_save_plan`): a `SaveStructure` (keys, shapes, boxes,
   grid indices; the same from save to save while the layout does not change, so its digest keys
   the plan cache) and the values that change every save.
2. The requests travel up the communication tree, each leader merging its subtree's
   (`plan_message`, `merge_plan_messages`: replicated entries grouped). The coordinator checks the
   structures agree, writes each distinct box once, giving replicated boxes to the least-loaded
   holder (worst-fit on bytes, paper §4.1), and spreads object shards (`global_save_plan`): one
   `Assignment` per rank.
3. After writing, every rank reports its pieces (`WriteReport`); the coordinator turns the reports
   into the checkpoint's metadata (`build_metadata`).

Records (`PlanRequest`, `PlanReply`, `WriteReport`, ...) travel between ranks through the safe
codec (`codec.to_wire`), never pickled.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from . import codec, metrics
from .engine import WrittenPiece
from .errors import MetadataError, PlanError, SaveError
from .flatten import SaveLeaf
from .metadata import (CheckpointMetadata, ObjectPiece, ObjectValue, PerRankMeta, Piece, ShardedObjectMeta,
                       TensorMeta, brief, dtype_from_name, dtype_name, element_size, parse_json)
from .shards import LocalTensor, ObjectShard, is_tensor_like, local_tensor, tiling_fault
from .utils import digest, gc_paused

log = logging.getLogger("bcp")


# ----------------------------------------------------------------------------- records

class TensorEntry(NamedTuple):
    """A tensor this rank holds: its global shape and the boxes ([offsets, lengths]) it has.

    It travels as its canonical JSON text (`text`): replicas hold identical entries, so the tree's
    leaders group the ranks' entries by their text on the way up (`merge_plan_messages`) and the
    coordinator parses each distinct one once (at 8,960 ranks of a 405B model, 43 thousand distinct
    entries of 469 thousand; bench/plan_scale.py)."""
    fqn: str
    dtype: str
    shape: list[int]
    boxes: list[list[list[int]]]

    def text(self) -> str:
        return json.dumps(self, separators=(",", ":"))

    @classmethod
    def parse(cls, text: str) -> TensorEntry:
        """The entry `text` holds; PlanError naming it if it is not one."""
        return cls.parse_all([text])[0]

    @classmethod
    def parse_all(cls, texts) -> list[TensorEntry]:
        """The entries `texts` hold; PlanError naming the first that is not one (`parse_entries`)."""
        return [cls(*e) for e in parse_entries(list(texts))]


def parse_entries(texts: list) -> list[list]:
    """The entries `texts` hold, each as its list [fqn, dtype, shape, boxes], in one JSON parse;
    PlanError naming the first that is not one. Each text is checked first by one regular expression
    (`_ENTRY`): two strings, then non-negative integers in exactly an entry's nesting, so what the
    parse gives needs no check of its own."""
    try:
        well_formed = all(map(_ENTRY.fullmatch, texts))
    except TypeError:  # not a string
        well_formed = False
    if well_formed:
        try:
            parsed = parse_json("[" + ",".join(texts) + "]", "tensor entries")
        except MetadataError:
            parsed = None
        if parsed is not None and len(parsed) == len(texts):
            return parsed
    bad = next((t for t in texts if not _one_entry(t)), texts[0] if texts else "")
    raise PlanError(f"malformed tensor entry in a rank's plan request: {str(bad)[:200]!r}")


def _one_entry(text) -> bool:
    """Whether `text` alone is a well-formed entry (to name the first one that is not)."""
    if type(text) is not str or not _ENTRY.fullmatch(text):
        return False
    try:
        return type(parse_json(text, "tensor entry")) is list
    except MetadataError:
        return False


_STR = r'"[^"\\]*(?:\\.[^"\\]*)*"'  # a JSON string's characters and escapes (json checks the escapes)
_INTS = r"(?:\d+(?:,\d+)*)?"
_BOX = rf"\[\[{_INTS}\],\[{_INTS}\]\]"
# [fqn,dtype,[shape],[[[offs],[lens]],...]]
_ENTRY = re.compile(rf"\[{_STR},{_STR},\[{_INTS}\],\[(?:{_BOX}(?:,{_BOX})*)?\]\]")


class PerRankEntry(NamedTuple):
    """A per-rank (extra_state) value: a tensor (dtype, shape) or an object (None, None)."""
    fqn: str
    dtype: str | None
    shape: list[int] | None


class ShardEntry(NamedTuple):
    """A shard of a sharded object this rank holds."""
    fqn: str
    grid: list[int]
    index: list[int]


@codec.record
@dataclass(frozen=True)
class SaveStructure:
    """What the coordinator plans from. `tensors` holds each TensorEntry's text; the other entries
    arrive from other ranks as plain lists in the NamedTuples' field order, so readers unpack them
    by name (`for fqn, grid, index in ...`)."""

    tensors: tuple[str, ...]
    objects: tuple[str, ...]           # replicated non-tensor values
    per_rank: tuple[PerRankEntry, ...]
    sharded_objects: tuple[ShardEntry, ...]

    def digest(self) -> str:
        return digest(json.dumps(codec.to_wire(self), separators=(",", ":")).encode())


@codec.record
@dataclass(frozen=True)
class TensorBoxKey:
    """Piece key: box `offsets`/`lengths` of tensor `fqn`."""
    fqn: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@codec.record
@dataclass(frozen=True)
class ObjectShardKey:
    """Piece key: shard `index` of sharded object `fqn`."""
    fqn: str
    index: tuple[int, ...]


@codec.record
@dataclass(frozen=True)
class RankValueKey:
    """Piece key: this rank's per-rank tensor `fqn`."""
    fqn: str


PieceKey = TensorBoxKey | ObjectShardKey | RankValueKey


@codec.record
@dataclass(frozen=True)
class Assignment:
    """What one rank writes: boxes as (tensor index, box index) into its plan, object shard indices."""
    boxes: tuple[tuple[int, int], ...]
    shards: tuple[int, ...]


@codec.record
@dataclass(frozen=True)
class SaveId:
    """Which save a message belongs to: the role's count of collective operations (the same on
    every rank, since every rank takes part in every one), the step and the checkpoint path."""
    number: int
    step: int | None
    path: str

    def __str__(self) -> str:
        return f"save #{self.number} (step {self.step}) to {self.path}"


# Planning, in one or two rounds of the save's messages (checkpointer.py): every rank sends a
# PlanRequest; the coordinator answers UseCachedPlan, a PlanReply per rank, ResendStructure (then
# every rank sends its structure again and gets a PlanReply), or SaveFailed.

@codec.record
@dataclass(frozen=True)
class PlanRequest:
    """Rank -> coordinator: this rank's structure digest and either the id of the cached plan it
    would reuse or the structure itself; or why it cannot save. `writable`: the boxes ((tensor,
    box) indices) this rank can write, when it staged only some (its cached assignment); None: all."""
    save: SaveId
    key: str | None
    plan: str | None
    structure: SaveStructure | None
    writable: tuple[tuple[int, int], ...] | None = None
    error: str | None = None


@codec.record
@dataclass(frozen=True)
class UseCachedPlan:
    """Coordinator -> every rank: every rank's structure is the one planned before; use the cached plan."""
    save: SaveId


@codec.record
@dataclass(frozen=True)
class ResendStructure:
    """Coordinator -> every rank: some ranks hold a cached plan and others not, or the structures
    changed on some ranks only: send the structure, the whole job plans again."""
    save: SaveId


@codec.record
@dataclass(frozen=True)
class PlanReply:
    """Coordinator -> each rank: its assignment, the job's file token and the plan's id."""
    save: SaveId
    assignment: Assignment
    token: str
    plan_id: str


@codec.record
@dataclass(frozen=True)
class SaveFailed:
    """Coordinator -> every rank: this save fails everywhere, for this reason (naming the rank)."""
    save: SaveId
    error: str


@codec.record
@dataclass(frozen=True)
class WriteReport:
    """Rank -> coordinator after writing: the pieces written and this save's values (or an error)."""
    save: SaveId
    key: str | None
    objects: dict                 # fqn -> encoded value (rank 0's are saved)
    per_rank: dict                # fqn -> encoded value, or [dtype, shape, digest] of a per-rank tensor
    shard_digests: tuple[str, ...]
    object_digests: dict          # fqn -> digest of the encoded value
    pieces: tuple[WrittenPiece, ...]
    metrics: tuple = ()           # this rank's phase records (docs/monitoring.md)
    error: str | None = None


@codec.record
@dataclass(frozen=True)
class Committed:
    """Coordinator -> every rank: the checkpoint is committed."""
    save: SaveId


@gc_paused  # one reply per rank: see utils.gc_paused
def plan_replies(gplan: GlobalSavePlan, save: SaveId, token: str, plan_id: str) -> list[dict]:
    """Each rank's PlanReply as `codec.to_wire` gives it, ready for the scatter: only the assignment
    differs from rank to rank, the rest is encoded once."""
    reply = codec.to_wire(PlanReply(save, Assignment((), ()), token, plan_id))
    fields = reply["fields"]
    return [{"record": reply["record"], "fields": [fields[0], codec.to_wire(a), *fields[2:]]}
            for a in gplan.assignments]


def failed_report(save: SaveId, error: str) -> WriteReport:
    return WriteReport(save, None, {}, {}, (), {}, (), (), error)


# ----------------------------------------------------------------------------- plan requests up the tree
#
# A subtree's plan requests travel as one message (a plain JSON object), its ranks in rank order:
#   "keys": each rank's structure digest (PlanRequest.key);
#   "bodies", "body": the rest of each rank's request, without its tensor entries, as JSON texts, each
#       distinct one once ("bodies"), and which one each rank sent ("body": indices);
#   "counts": how many tensor entries each rank had;
#   "texts", "held": the entries grouped as `group_entries` groups them, each distinct text once, with
#       the ranks holding it ([rank, entry index, ...]).
# Tree leaders merge their children's messages (`Comm.gather(merge=)`): the data-parallel replicas of a
# weight shard, and requests alike but for their key, reach the coordinator once per subtree rather than
# once per rank, and the coordinator neither decodes nor groups them again.

def plan_message(request: PlanRequest, rank: int) -> dict:
    """The message of the subtree of rank `rank` alone."""
    texts = list(request.structure.tensors) if request.structure is not None else []
    body = replace(request, key=None, structure=None if request.structure is None else
                   replace(request.structure, tensors=()))
    return {"keys": [request.key], "bodies": [json.dumps(codec.to_wire(body), separators=(",", ":"))],
            "body": [0], "counts": [len(texts)], "texts": texts, "held": [[rank, ti] for ti in range(len(texts))]}


@gc_paused  # the coordinator merges every rank's message: see utils.gc_paused
def merge_plan_messages(parts: list) -> dict:
    """The message of consecutive subtrees whose messages are `parts` (in rank order). A part that is
    not a plan message goes on as one rank's request that the coordinator cannot read (and names)."""
    keys, bodies, body, counts, texts, held = [], [], [], [], [], []
    body_index: dict[str, int] = {}
    text_index: dict[str, int] = {}
    for part in parts:
        if not _is_plan_message(part):
            part = {"keys": [None], "bodies": [""], "body": [0], "counts": [0], "texts": [], "held": []}
        keys += part["keys"]
        counts += part["counts"]
        to = []  # index in `bodies` of each of the part's bodies
        for b in part["bodies"]:
            i = body_index.get(b)
            if i is None:
                i = body_index[b] = len(bodies)
                bodies.append(b)
            to.append(i)
        body += [to[i] for i in part["body"]]
        for text, h in zip(part["texts"], part["held"]):
            i = text_index.get(text)
            if i is None:
                text_index[text] = len(texts)
                texts.append(text)
                held.append(list(h))  # a copy: the parts stay as they were
            else:
                held[i] += h
    return {"keys": keys, "bodies": bodies, "body": body, "counts": counts, "texts": texts, "held": held}


_MESSAGE_LISTS = ("keys", "bodies", "body", "counts", "texts", "held")


def _is_plan_message(m) -> bool:
    """Whether `m` has a plan message's form (what merging relies on; the coordinator checks the rest)."""
    return (type(m) is dict and all(type(m.get(k)) is list for k in _MESSAGE_LISTS)
            and len(m["keys"]) == len(m["body"]) == len(m["counts"]) and len(m["texts"]) == len(m["held"])
            and set(map(type, m["bodies"])) <= {str} and set(map(type, m["texts"])) <= {str}
            and set(map(type, m["held"])) <= {list} and set(map(type, m["body"])) <= {int}
            and (not m["body"] or 0 <= min(m["body"]) and max(m["body"]) < len(m["bodies"])))


@dataclass
class GatheredRequests:
    """Every rank's PlanRequest on the coordinator (their structures without tensor entries) and the
    entries, grouped (`group_entries`)."""

    requests: list[PlanRequest]
    entries: dict[str, list[int]]


def _entries_fit(counts: list, held: list, world: int) -> bool:
    """Whether the grouped entries hold as many (rank, entry index) pairs as the ranks had entries,
    each of a rank of the job and an index within the most any rank had (checked on all the pairs at
    once: each `held` list has an even length, so their concatenation keeps the pairs aligned)."""
    if set(map(type, counts)) - {int} or not all(held) or any(len(h) % 2 for h in held):
        return False
    pairs = list(itertools.chain.from_iterable(held))
    if set(map(type, pairs)) - {int} or len(pairs) != 2 * sum(counts):
        return False
    ranks, indices = pairs[::2], pairs[1::2]
    return not pairs or (min(ranks) >= 0 and max(ranks) < world and min(indices) >= 0
                         and max(indices) < max(counts))


@gc_paused
def read_plan_messages(message, world: int, save: SaveId) -> GatheredRequests:
    """The coordinator's view of the merged plan message of every rank: SaveError naming a rank whose
    request is not one, PlanError if the grouped entries do not fit the requests."""
    if not _is_plan_message(message) or len(message["keys"]) != world:
        raise SaveError(f"the ranks' plan requests for {save} arrived malformed ({brief(message)})")
    bodies = []
    for i, text in enumerate(message["bodies"]):
        try:
            bodies.append(codec.from_wire(parse_json(text, "plan request"), PlanRequest))
        except MetadataError as e:
            r = next((r for r, b in enumerate(message["body"]) if b == i), "?")
            raise SaveError(f"rank {r} sent an unexpected message for {save}: {e}") from None
    keys = message["keys"]
    if set(map(type, keys)) - {str, type(None)}:
        r = next(r for r, k in enumerate(keys) if k is not None and type(k) is not str)
        raise SaveError(f"rank {r} sent an unexpected message for {save}: key {brief(keys[r])}")
    requests = [PlanRequest(save=b.save, key=k, plan=b.plan, structure=b.structure, writable=b.writable,
                            error=b.error) for k, b in zip(keys, map(bodies.__getitem__, message["body"]))]
    entries = dict(zip(message["texts"], message["held"]))
    if len(entries) != len(message["held"]) or not _entries_fit(message["counts"], message["held"], world):
        raise PlanError(f"the ranks' tensor entries for {save} arrived inconsistent with their requests")
    return GatheredRequests(requests, entries)


# ----------------------------------------------------------------------------- local plan

@dataclass
class LocalSavePlan:
    """This rank's side of a save: the structure it plans from and what the writes read.

    `tensors[i]` and `structure.tensors[i]` describe the same tensor, as do `shard_values[i]` and
    `structure.sharded_objects[i]`. `values` change every save (non-tensor values, per-rank values,
    shard digests); they travel with the write report instead of the plan.
    """

    structure: SaveStructure
    key: str
    tensors: list[tuple[str, LocalTensor]]
    stepped: list[bool]                         # tensors[i] changes in place only in an optimizer step
    per_rank_tensors: list[tuple[str, torch.Tensor]]
    shard_values: list[bytes]                   # each object shard's JSON bytes
    objects: dict = field(default_factory=dict)
    per_rank: dict = field(default_factory=dict)
    shard_digests: tuple[str, ...] = ()
    object_digests: dict = field(default_factory=dict)


def local_save_plan(leaves: list[SaveLeaf], rank: int, allow_pickle: bool) -> LocalSavePlan:
    tensors: list[tuple[str, LocalTensor]] = []
    stepped: list[bool] = []
    st_tensors, st_objects, st_per_rank, st_shards = [], [], [], []
    per_rank_tensors, shard_values = [], []
    objects, per_rank, shard_digests, object_digests = {}, {}, [], {}
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, ObjectShard):
            if v.index is None or len(v.index) != len(v.grid) or any(
                    not 0 <= i < g for i, g in zip(v.index, v.grid)):
                raise PlanError(f"{leaf.fqn}: object shard index {v.index} does not lie in grid {v.grid}")
            data = json.dumps(codec.encode(v.value, leaf.fqn, allow_pickle), separators=(",", ":")).encode()
            st_shards.append(ShardEntry(leaf.fqn, list(v.grid), list(v.index)))
            shard_values.append(data)
            shard_digests.append(digest(data))
        elif leaf.per_rank:
            if isinstance(v, torch.Tensor):
                if v.__class__ is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
                    raise PlanError(f"{leaf.fqn}: per-rank (extra_state) tensors must be plain tensors, "
                                    f"got {type(v).__name__}")
                st_per_rank.append(PerRankEntry(leaf.fqn, dtype_name(v.dtype), list(v.shape)))
                per_rank_tensors.append((leaf.fqn, v.detach()))
            else:
                st_per_rank.append(PerRankEntry(leaf.fqn, None, None))
                per_rank[leaf.fqn] = codec.encode(v, leaf.fqn, allow_pickle)
        elif is_tensor_like(v):
            lt = local_tensor(v)
            tensors.append((leaf.fqn, lt))
            stepped.append(leaf.stepped)
            st_tensors.append(TensorEntry(leaf.fqn, dtype_name(lt.dtype), list(lt.global_shape),
                                          [[list(b.offsets), list(b.lengths)] for b in lt.boxes]).text())
        else:
            # replicated values: the coordinator's copy is saved; the others send a digest so a value
            # that differs between ranks (and would be lost) is reported
            st_objects.append(leaf.fqn)
            encoded = codec.encode(v, leaf.fqn, allow_pickle)
            if rank == 0:
                objects[leaf.fqn] = encoded
            object_digests[leaf.fqn] = digest(json.dumps(encoded, sort_keys=True).encode())
    structure = SaveStructure(tuple(st_tensors), tuple(st_objects), tuple(st_per_rank), tuple(st_shards))
    return LocalSavePlan(structure, structure.digest(), tensors, stepped, per_rank_tensors, shard_values, objects,
                         per_rank, tuple(shard_digests), object_digests)


# ----------------------------------------------------------------------------- global plan

@dataclass
class GlobalSavePlan:
    """The coordinator's plan: what each rank writes, and the layout the metadata will describe."""

    assignments: list[Assignment]
    tensor_info: dict[str, tuple[str, list[int]]]  # fqn -> (dtype name, global shape)
    object_keys: list[str]
    per_rank: dict[str, str]                       # fqn -> "tensor" or "object"
    sharded_grids: dict[str, list[int]]            # fqn -> grid of each sharded object
    shard_holders: dict[tuple, list[tuple[int, int]]]  # (fqn, index) -> [(rank, local shard i)]
    bytes_per_rank: list[int]


def group_entries(structures: list[SaveStructure]) -> dict[str, list[int]]:
    """The ranks' tensor entries grouped by their text (replicas hold identical ones), in the order the
    ranks first hold them: each text -> the ranks holding it, as one flat list [rank, entry index,
    rank, entry index, ...] in rank order."""
    entries: dict[str, list[int]] = {}
    for r, structure in enumerate(structures):
        for ti, text in enumerate(structure.tensors):
            held = entries.get(text)
            if held is None:
                entries[text] = [r, ti]
            else:
                held += (r, ti)
    return entries


@metrics.timed("plan")
@gc_paused
def global_save_plan(structures: list[SaveStructure], writable: list[set[tuple[int, int]] | None] | None = None,
                     entries: dict[str, list[int]] | None = None) -> GlobalSavePlan:
    """Who writes what. `writable[r]`, if given and not None, limits rank r to those boxes ((tensor,
    box) indices): an asynchronous save staged only its cached assignment and can write no other.
    `entries`: the structures' tensor entries already grouped (`group_entries`; the tree merges
    them on the way up, `merge_plan_messages`), the structures' own `tensors` then unused."""
    world = len(structures)
    if entries is None:
        entries = group_entries(structures)
    # Each distinct entry is read once. A box's holders are kept as (ranks holding an entry, box
    # index) pairs, the ranks as the entry's flat [rank, entry index, ...] list.
    tensor_info: dict[str, tuple[str, list[int], int]] = {}   # fqn -> dtype, shape, first rank
    holders: dict[tuple, list[tuple[list[int], int]]] = {}  # (fqn, offs, lens) -> [(held, bi)]
    for (fqn, dt, shape, boxes), held in zip(parse_entries(list(entries)), entries.values()):
        seen = tensor_info.setdefault(fqn, (dt, shape, held[0]))
        if (seen[0], seen[1]) != (dt, shape):
            raise PlanError(f"tensor {fqn!r}: rank {seen[2]} has dtype {seen[0]} shape {tuple(seen[1])} "
                            f"but rank {held[0]} has dtype {dt} shape {tuple(shape)}")
        for bi, (offs, lens) in enumerate(boxes):
            holders.setdefault((fqn, tuple(offs), tuple(lens)), []).append((held, bi))
    del entries
    _check_coverage(tensor_info, holders)

    # Worst-fit: boxes held by one rank are fixed; replicated boxes go, largest first, to the
    # holder with the fewest bytes so far (ties: lowest rank).
    load = [0] * world
    writes: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    replicated = []
    esize = {dt: element_size(dtype_from_name(dt)) for dt in {v[0] for v in tensor_info.values()}}
    for key, segments in holders.items():
        if writable is not None:
            able = [([x for r, ti in zip(held[::2], held[1::2]) if writable[r] is None or (ti, bi) in writable[r]
                      for x in (r, ti)], bi) for held, bi in segments]
            segments = [(held, bi) for held, bi in able if held]
            if not segments:
                raise PlanError(f"tensor {key[0]!r} box offsets {list(key[1])} lengths {list(key[2])}: ranks "
                                f"{_ranks(holders[key])} hold it but none staged it for this save (the structure "
                                "changed on some ranks since the plan they reused); the next save plans afresh")
        nbytes = math.prod(key[2]) * esize[tensor_info[key[0]][0]]
        if len(segments) == 1 and len(segments[0][0]) == 2:
            (r, ti), bi = segments[0][0], segments[0][1]
            load[r] += nbytes
            writes[r].append((ti, bi))
        else:
            replicated.append((nbytes, key, segments))
    replicated.sort(key=lambda x: (-x[0], x[1]))
    least_loaded = load.__getitem__
    for nbytes, _, segments in replicated:
        best = None
        for held, bi in segments:
            ranks = held[::2]
            r = min(ranks, key=least_loaded)  # the first of the least loaded: `held` is in rank order
            if best is None or (load[r], r) < best[:2]:
                best = (load[r], r, held[2 * ranks.index(r) + 1], bi)
        _, r, ti, bi = best
        load[r] += nbytes
        writes[r].append((ti, bi))

    grids: dict[str, list[int]] = {}
    shard_holders: dict[tuple, list[tuple[int, int]]] = {}
    for r, structure in enumerate(structures):
        for i, (fqn, grid, index) in enumerate(structure.sharded_objects):
            if grids.setdefault(fqn, grid) != grid:
                raise PlanError(f"sharded object {fqn!r}: ranks disagree on its grid ({grids[fqn]} vs {grid} "
                                f"on rank {r})")
            shard_holders.setdefault((fqn, tuple(index)), []).append((r, i))
    shards: list[list[int]] = [[] for _ in range(world)]
    for hs in shard_holders.values():  # shards are small: spread them by count
        r, i = min(hs, key=lambda h: (len(shards[h[0]]), h[0]))
        shards[r].append(i)

    object_keys = list(structures[0].objects)
    for r, structure in enumerate(structures[1:], start=1):
        extra = set(structure.objects) - set(object_keys)
        if extra:
            raise PlanError(f"non-tensor value {min(extra)!r} exists on rank {r} but not on rank 0; "
                            "values that differ per rank belong under 'extra_state'")
    per_rank: dict[str, str] = {}
    for r, structure in enumerate(structures):
        for fqn, dt, _ in structure.per_rank:
            kind = "object" if dt is None else "tensor"
            if per_rank.setdefault(fqn, kind) != kind:
                raise PlanError(f"per-rank value {fqn!r} is a {kind} on rank {r} but a {per_rank[fqn]} on "
                                "another rank")
    info = {k: (v[0], v[1]) for k, v in tensor_info.items()}
    assignments = [Assignment(tuple(w), tuple(s)) for w, s in zip(writes, shards)]
    return GlobalSavePlan(assignments, info, object_keys, per_rank, grids, shard_holders, load)


def _ranks(segments: list[tuple[list[int], int]]) -> list[int]:
    """The ranks holding a box, from its holders' (held, bi) pairs."""
    return sorted({r for held, _ in segments for r in held[::2]})


def _check_coverage(tensor_info, holders) -> None:
    """The distinct boxes the ranks hold of each tensor tile its global shape exactly (identical boxes
    are replicas: `holders` has one key for them). Tensors sharded alike (an optimizer's states of
    one parameter) are checked once."""
    boxes_of: dict[str, list[tuple[tuple, tuple]]] = {}
    for fqn, offs, lens in holders:
        boxes_of.setdefault(fqn, []).append((offs, lens))
    tiled: set[tuple] = set()
    for fqn, (_, shape, _) in tensor_info.items():
        boxes = boxes_of.get(fqn, [])
        layout = (tuple(shape), tuple(boxes))
        if layout in tiled:
            continue
        fault = tiling_fault(shape, boxes)
        if fault is None:
            tiled.add(layout)
            continue
        held = " and ".join(f"offsets {list(boxes[i][0])} lengths {list(boxes[i][1])} (ranks "
                            f"{_ranks(holders[(fqn, *boxes[i])])})" for i in fault.at)
        what = f"boxes {held} {fault.problem}" if fault.at else f"the ranks' boxes {fault.problem}"
        raise PlanError(f"tensor {fqn!r} of shape {tuple(shape)}: {what}; the ranks disagree about its sharding "
                        "or some part of it is held by no rank")


# ----------------------------------------------------------------------------- metadata

@gc_paused  # builds an object per saved piece: see utils.gc_paused
def build_metadata(gplan: GlobalSavePlan, rank_keys: list[str], reports: list[WriteReport], framework: str,
                   user_metadata: dict) -> CheckpointMetadata:
    """The checkpoint's metadata from every rank's report (raises SaveError naming failed ranks)."""
    errors = [r.error for r in reports if r.error]
    if errors:
        raise SaveError("; ".join(errors))
    changed = [r for r, rep in enumerate(reports) if rep.key != rank_keys[r]]
    if changed:
        raise SaveError(f"ranks {changed} saved a state whose structure differs from the plan")

    files: list[str] = []
    file_index: dict[str, int] = {}
    pieces: dict[str, list[Piece]] = {fqn: [] for fqn in gplan.tensor_info}
    shards: dict[str, list[ObjectPiece]] = {fqn: [] for fqn in gplan.sharded_grids}
    rank_tensor: dict[tuple[str, int], Piece] = {}
    for rank, rep in enumerate(reports):
        for w in rep.pieces:
            fi = file_index.setdefault(w.file, len(file_index))
            if fi == len(files):
                files.append(w.file)
            key, crc = w.key, tuple(w.checksums)
            if isinstance(key, TensorBoxKey):
                pieces[key.fqn].append(Piece(tuple(key.offsets), tuple(key.lengths), fi, w.byte_offset, w.nbytes,
                                             crc, rank))
            elif isinstance(key, ObjectShardKey):
                shards[key.fqn].append(ObjectPiece(tuple(key.index), fi, w.byte_offset, w.nbytes, crc, rank))
            else:
                rank_tensor[(key.fqn, rank)] = Piece((), (), fi, w.byte_offset, w.nbytes, crc, rank)

    for (fqn, index), holders in gplan.shard_holders.items():
        digests = {reports[r].shard_digests[i] for r, i in holders}
        if len(digests) > 1:
            raise SaveError(f"sharded object {fqn!r} index {list(index)}: ranks {[r for r, _ in holders]} hold "
                            "different values for the same shard")

    per_rank: dict[str, PerRankMeta] = {}
    for fqn, kind in sorted(gplan.per_rank.items()):
        variants: list = []
        ids: dict[str, int] = {}
        ranks: list[int | None] = []
        for rank, rep in enumerate(reports):
            v = rep.per_rank.get(fqn)
            if v is None:
                ranks.append(None)
                continue
            ident = f"{v[0]}{v[1]}{v[2]}" if kind == "tensor" else repr(v)
            if ident not in ids:
                ids[ident] = len(variants)
                if kind == "tensor":
                    p = rank_tensor[(fqn, rank)]
                    shape = tuple(v[1])
                    variants.append(TensorMeta(dtype_from_name(v[0]), shape, (Piece(
                        (0,) * len(shape), shape, p.file, p.byte_offset, p.nbytes, p.checksums, rank),)))
                else:
                    variants.append(ObjectValue(v))
            ranks.append(ids[ident])
        first = next(r for r in ranks if r is not None)  # ranks without the value load rank 0's
        per_rank[fqn] = PerRankMeta(tuple(first if r is None else r for r in ranks), tuple(variants))

    tensors = {fqn: TensorMeta(dtype_from_name(dt), tuple(shape), tuple(sorted(pieces[fqn], key=lambda p: p.offsets)))
               for fqn, (dt, shape) in sorted(gplan.tensor_info.items())}
    sharded = {fqn: ShardedObjectMeta(tuple(grid), tuple(sorted(shards[fqn], key=lambda p: p.index)))
               for fqn, grid in sorted(gplan.sharded_grids.items())}
    objects = {k: ObjectValue(reports[0].objects[k]) for k in sorted(gplan.object_keys)}
    _warn_differing_values(reports)
    return CheckpointMetadata(world_size=len(reports), framework=framework, files=tuple(files), tensors=tensors,
                              objects=objects, per_rank=per_rank, sharded_objects=sharded, user=user_metadata)


def _warn_differing_values(reports: list[WriteReport]) -> None:
    """Replicated values are saved from rank 0; say so loudly when another rank's value differs."""
    differ: dict[str, list[int]] = {}
    ref = reports[0].object_digests
    for r, rep in enumerate(reports[1:], start=1):
        for k, d in rep.object_digests.items():
            if ref.get(k) != d:
                differ.setdefault(k, []).append(r)
    if differ:
        log.warning("bcp: non-tensor values differ between ranks and only rank 0's is saved: %s. Values "
                    "that differ per rank belong under 'extra_state' (or in a sharded object).",
                    ", ".join(f"{k} (ranks {v})" for k, v in sorted(differ.items())[:8]))
