"""Save planning: what each rank holds, what each rank writes, and the metadata that results.

1. Every rank describes what it holds (`local_save_plan`): a `SaveStructure` (keys, shapes, boxes,
   grid indices; the same from save to save while the layout does not change, so its digest keys
   the plan cache) and the values that change every save.
2. The requests travel up the communication tree, each leader merging its subtree's
   (`plan_message`, `merge_plan_messages`: replicated entries grouped). The coordinator reads them
   (`read_plan_messages`) and plans (`global_save_plan`): it checks the structures agree, writes
   each distinct box once (`distinct_boxes`), giving replicated boxes to the least-loaded holder
   (`balance`: worst-fit on bytes, paper §4.1), and spreads object shards (`spread_shards`): one
   `Assignment` per rank.
3. After writing, every rank reports its pieces (`WriteReport`); the coordinator turns the reports
   into the checkpoint's metadata (`build_metadata`).

The records (plan_records.py) travel between ranks through the safe codec, never pickled.
"""

from __future__ import annotations

import itertools
import json
import logging
import math

import torch

from . import codec, metrics
from .errors import MetadataError, PlanError, SaveError
from .flatten import SaveLeaf
from .metadata import (CheckpointMetadata, ObjectPiece, ObjectValue, PerRankMeta, Piece, ShardedObjectMeta,
                       TensorMeta, brief, dtype_from_name, dtype_name, element_size, parse_json)
from .plan_records import (Assignment, GatheredRequests, GlobalSavePlan, LocalSavePlan, ObjectShardKey,
                           PerRankEntry, PlanMessage, PlanReply, PlanRequest, SaveId, SaveStructure, ShardEntry,
                           TensorBoxKey, TensorEntry, WriteReport)
from .shards import LocalTensor, ObjectShard, is_tensor_like, local_tensor, tiling_fault
from .utils import digest, gc_paused

log = logging.getLogger("bcp")


# ----------------------------------------------------------------------------- local plan

def local_save_plan(leaves: list[SaveLeaf], rank: int, allow_pickle: bool) -> LocalSavePlan:
    """This rank's structure, and the values and tensors its writes read."""
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
            st_shards.append(ShardEntry(leaf.fqn, tuple(v.grid), tuple(v.index)))
            shard_values.append(data)
            shard_digests.append(digest(data))
        elif leaf.per_rank:
            if isinstance(v, torch.Tensor):
                if v.__class__ is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
                    raise PlanError(f"{leaf.fqn}: per-rank (extra_state) tensors must be plain tensors, "
                                    f"got {type(v).__name__}")
                st_per_rank.append(PerRankEntry(leaf.fqn, dtype_name(v.dtype), tuple(v.shape)))
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
    return LocalSavePlan(structure, structure.digest(), tuple(tensors), tuple(stepped), tuple(per_rank_tensors),
                         tuple(shard_values), objects, per_rank, tuple(shard_digests), object_digests)


# ----------------------------------------------------------------------------- plan requests up the tree
#
# A subtree's plan requests travel as one `PlanMessage`, its ranks in rank order. Tree leaders merge
# their children's messages (`Comm.gather(merge=)`): the data-parallel replicas of a weight shard, and
# requests alike but for their key, reach the coordinator once per subtree rather than once per rank,
# and the coordinator neither decodes nor groups them again. Messages cross the Comm as JSON
# (`PlanMessage.to_json`): these functions take and give that form.

def plan_message(request: PlanRequest, rank: int) -> dict:
    """The message of the subtree of rank `rank` alone."""
    return PlanMessage.of_request(request, rank).to_json()


@gc_paused  # the coordinator merges every rank's message: see utils.gc_paused
def merge_plan_messages(parts: list) -> dict:
    """The message of consecutive subtrees whose messages are `parts` (in rank order). A part that is
    not a plan message goes on as one rank's request that the coordinator cannot read (and names)."""
    keys, bodies, body, counts, texts, held = [], [], [], [], [], []
    body_index: dict[str, int] = {}
    text_index: dict[str, int] = {}
    for raw in parts:
        part = PlanMessage.from_json(raw) or PlanMessage.unreadable()
        keys += part.keys
        counts += part.counts
        to = []  # index in `bodies` of each of the part's bodies
        for b in part.bodies:
            i = body_index.get(b)
            if i is None:
                i = body_index[b] = len(bodies)
                bodies.append(b)
            to.append(i)
        body += [to[i] for i in part.body]
        for text, h in zip(part.texts, part.held):
            i = text_index.get(text)
            if i is None:
                text_index[text] = len(texts)
                texts.append(text)
                held.append(list(h))  # a copy: the parts stay as they were
            else:
                held[i] += h
    return PlanMessage(keys, bodies, body, counts, texts, held).to_json()


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
def read_plan_messages(raw, world: int, save: SaveId) -> GatheredRequests:
    """The coordinator's view of the merged plan message of every rank: SaveError naming a rank whose
    request is not one, PlanError if the grouped entries do not fit the requests."""
    message = PlanMessage.from_json(raw)
    if message is None or len(message.keys) != world:
        raise SaveError(f"the ranks' plan requests for {save} arrived malformed ({brief(raw)})")
    bodies = []
    for i, text in enumerate(message.bodies):
        try:
            bodies.append(codec.from_wire(parse_json(text, "plan request"), PlanRequest))
        except MetadataError as e:
            r = next((r for r, b in enumerate(message.body) if b == i), "?")
            raise SaveError(f"rank {r} sent an unexpected message for {save}: {e}") from None
    keys = message.keys
    if set(map(type, keys)) - {str, type(None)}:
        r = next(r for r, k in enumerate(keys) if k is not None and type(k) is not str)
        raise SaveError(f"rank {r} sent an unexpected message for {save}: key {brief(keys[r])}")
    requests = tuple(PlanRequest(save=b.save, key=k, plan=b.plan, structure=b.structure, writable=b.writable,
                                 error=b.error) for k, b in zip(keys, map(bodies.__getitem__, message.body)))
    entries = dict(zip(message.texts, message.held))
    if len(entries) != len(message.held) or not _entries_fit(message.counts, message.held, world):
        raise PlanError(f"the ranks' tensor entries for {save} arrived inconsistent with their requests")
    return GatheredRequests(requests, entries)


@gc_paused  # one reply per rank: see utils.gc_paused
def plan_replies(gplan: GlobalSavePlan, save: SaveId, token: str, plan_id: str) -> list[dict]:
    """Each rank's PlanReply as `codec.to_wire` gives it, ready for the scatter: only the assignment
    differs from rank to rank, the rest is encoded once."""
    reply = codec.to_wire(PlanReply(save, Assignment((), ()), token, plan_id))
    fields = reply["fields"]
    return [{"record": reply["record"], "fields": [fields[0], codec.to_wire(a), *fields[2:]]}
            for a in gplan.assignments]


# ----------------------------------------------------------------------------- global plan

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
    tensor_info, holders = distinct_boxes(entries if entries is not None else group_entries(structures))
    writes, load = balance(tensor_info, holders, writable, world)
    grids, shard_holders, shards = spread_shards(structures)
    object_keys, per_rank = _values(structures)
    info = {k: (v[0], v[1]) for k, v in tensor_info.items()}
    assignments = tuple(Assignment(tuple(w), tuple(s)) for w, s in zip(writes, shards))
    return GlobalSavePlan(assignments, info, object_keys, per_rank, grids, shard_holders, tuple(load))


# A box's holders are kept as (ranks holding an entry, box index) pairs, the ranks as the entry's flat
# [rank, entry index, ...] list (`group_entries`).
Holders = list[tuple[list[int], int]]


def distinct_boxes(entries: dict[str, list[int]]) -> tuple[dict[str, tuple[str, list[int], int]],
                                                            dict[tuple, Holders]]:
    """Dedup: each distinct entry read once, each distinct box of a tensor with every rank holding it,
    the boxes checked to tile each tensor. Returns fqn -> (dtype, shape, first rank holding it), and
    (fqn, offsets, lengths) -> its holders."""
    tensor_info: dict[str, tuple[str, list[int], int]] = {}
    holders: dict[tuple, Holders] = {}
    for (fqn, dt, shape, boxes), held in zip(TensorEntry.rows(entries), entries.values()):
        seen = tensor_info.setdefault(fqn, (dt, shape, held[0]))
        if (seen[0], seen[1]) != (dt, shape):
            raise PlanError(f"tensor {fqn!r}: rank {seen[2]} has dtype {seen[0]} shape {tuple(seen[1])} "
                            f"but rank {held[0]} has dtype {dt} shape {tuple(shape)}")
        for bi, (offs, lens) in enumerate(boxes):
            holders.setdefault((fqn, tuple(offs), tuple(lens)), []).append((held, bi))
    _check_coverage(tensor_info, holders)
    return tensor_info, holders


def balance(tensor_info: dict[str, tuple], holders: dict[tuple, Holders],
            writable: list[set[tuple[int, int]] | None] | None, world: int) -> tuple[list[list[tuple[int, int]]],
                                                                                   list[int]]:
    """Worst-fit: boxes held by one rank are that rank's; replicated boxes go, largest first, to the
    holder with the fewest bytes so far (ties: lowest rank). Returns each rank's (tensor index, box
    index) writes and its bytes."""
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
    return writes, load


def spread_shards(structures: list[SaveStructure]) -> tuple[dict[str, tuple[int, ...]],
                                                             dict[tuple, list[tuple[int, int]]], list[list[int]]]:
    """Each distinct object shard to one of its holders (shards are small: spread by count). Returns
    each sharded object's grid, each shard's holders ((rank, local shard index)) and each rank's shards."""
    world = len(structures)
    grids: dict[str, tuple[int, ...]] = {}
    shard_holders: dict[tuple, list[tuple[int, int]]] = {}
    for r, structure in enumerate(structures):
        for i, entry in enumerate(structure.sharded_objects):
            if grids.setdefault(entry.fqn, entry.grid) != entry.grid:
                raise PlanError(f"sharded object {entry.fqn!r}: ranks disagree on its grid ({list(grids[entry.fqn])} "
                                f"vs {list(entry.grid)} on rank {r})")
            shard_holders.setdefault((entry.fqn, entry.index), []).append((r, i))
    shards: list[list[int]] = [[] for _ in range(world)]
    for hs in shard_holders.values():
        r, i = min(hs, key=lambda h: (len(shards[h[0]]), h[0]))
        shards[r].append(i)
    return grids, shard_holders, shards


def _values(structures: list[SaveStructure]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The replicated values (rank 0's keys; no rank may have others) and the kind of each per-rank value."""
    object_keys = structures[0].objects
    for r, structure in enumerate(structures[1:], start=1):
        extra = set(structure.objects) - set(object_keys)
        if extra:
            raise PlanError(f"non-tensor value {min(extra)!r} exists on rank {r} but not on rank 0; "
                            "values that differ per rank belong under 'extra_state'")
    per_rank: dict[str, str] = {}
    for r, structure in enumerate(structures):
        for entry in structure.per_rank:
            kind = "object" if entry.dtype is None else "tensor"
            if per_rank.setdefault(entry.fqn, kind) != kind:
                raise PlanError(f"per-rank value {entry.fqn!r} is a {kind} on rank {r} but a {per_rank[entry.fqn]} "
                                "on another rank")
    return tuple(object_keys), per_rank


def _ranks(segments: Holders) -> list[int]:
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
