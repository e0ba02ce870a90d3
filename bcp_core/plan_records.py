"""The records of a save and a load: what the planners make, the engine and staging execute, and
ranks send each other. Every record is a frozen dataclass with named fields.

A save:

    SaveLeaf (flatten) -> LocalSavePlan (its SaveStructure: TensorEntry, PerRankEntry, ShardEntry)
    PlanRequest -> PlanMessage (up the tree) -> GatheredRequests -> GlobalSavePlan -> Assignment
    UseCachedPlan | ResendStructure | PlanReply | SaveFailed                (answers to a PlanRequest)
    WriteItem -> WrittenPiece (keyed by TensorBoxKey | ObjectShardKey | RankValueKey) -> WriteReport
    Committed | SaveFailed                                                  (answers to a WriteReport)

A load:

    LoadTarget (flatten) -> LoadPlan: ReadItem (bytes to read), ValueLoad (values to hand over)

Records that travel between ranks are registered with the safe codec (`codec.record`): each
field is checked against its annotation when decoded, never pickled. Two forms are kept compact
on purpose, for jobs of thousands of ranks: a tensor entry travels as its canonical JSON text
(`TensorEntry.text`; replicas hold identical texts, which the tree's leaders group without
decoding them), and a subtree's plan requests as one `PlanMessage` (a JSON object of named lists).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from . import codec
from .errors import MetadataError, PlanError
from .metadata import Piece, parse_json
from .shards import LocalTensor
from .utils import digest

if TYPE_CHECKING:
    from .flatten import LoadTarget


# ----------------------------------------------------------------------------- what a rank holds

@dataclass(frozen=True)
class TensorEntry:
    """A tensor this rank holds: its global shape and the boxes ([offsets, lengths]) it has.

    It travels as its canonical JSON text (`text`: `[fqn, dtype, shape, boxes]`): replicas hold
    identical entries, so the tree's leaders group the ranks' entries by their text on the way up
    (`save_planner.merge_plan_messages`) and the coordinator parses each distinct one once (at
    8,960 ranks of a 405B model, 43 thousand distinct entries of 469 thousand; bench/plan_scale.py)."""

    fqn: str
    dtype: str
    shape: list[int]
    boxes: list[list[list[int]]]

    def text(self) -> str:
        return json.dumps([self.fqn, self.dtype, self.shape, self.boxes], separators=(",", ":"))

    @classmethod
    def parse(cls, text: str) -> TensorEntry:
        """The entry `text` holds; PlanError naming it if it is not one."""
        return cls.parse_all([text])[0]

    @classmethod
    def parse_all(cls, texts) -> list[TensorEntry]:
        """The entries `texts` hold; PlanError naming the first that is not one."""
        return [cls(*row) for row in cls.rows(texts)]

    @staticmethod
    def rows(texts) -> list[list]:
        """The entries `texts` hold as rows, their fields in this class's order, in one JSON parse;
        PlanError naming the first that is not one. For the coordinator, which reads tens of
        thousands at once (at 8,960 ranks, building a record of each took 0.07 s, a seventh of its
        planning). Each text is checked first by one regular expression (`_ENTRY`): two strings,
        then non-negative integers in exactly an entry's nesting, so what the parse gives needs no
        check of its own."""
        texts = list(texts)
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


@codec.record
@dataclass(frozen=True)
class PerRankEntry:
    """A per-rank (extra_state) value: a tensor (dtype, shape) or an object (None, None)."""
    fqn: str
    dtype: str | None
    shape: tuple[int, ...] | None


@codec.record
@dataclass(frozen=True)
class ShardEntry:
    """A shard of a sharded object this rank holds: its index in the object's grid."""
    fqn: str
    grid: tuple[int, ...]
    index: tuple[int, ...]


@codec.record
@dataclass(frozen=True)
class SaveStructure:
    """What the coordinator plans from: the same from save to save while the layout does not
    change, so its digest keys the plan cache. `tensors` holds each TensorEntry's text."""

    tensors: tuple[str, ...]
    objects: tuple[str, ...]           # replicated non-tensor values
    per_rank: tuple[PerRankEntry, ...]
    sharded_objects: tuple[ShardEntry, ...]

    def digest(self) -> str:
        return digest(json.dumps(codec.to_wire(self), separators=(",", ":")).encode())


@dataclass(frozen=True)
class LocalSavePlan:
    """This rank's side of a save: the structure it plans from and what the writes read.

    `tensors[i]` and `structure.tensors[i]` describe the same tensor, as do `shard_values[i]` and
    `structure.sharded_objects[i]`. The values (non-tensor values, per-rank values, shard digests)
    change every save; they travel with the write report instead of the plan.
    """

    structure: SaveStructure
    key: str                                          # the structure's digest
    tensors: tuple[tuple[str, LocalTensor], ...]
    stepped: tuple[bool, ...]                         # tensors[i] changes in place only in an optimizer step
    per_rank_tensors: tuple[tuple[str, torch.Tensor], ...]
    shard_values: tuple[bytes, ...]                   # each object shard's JSON bytes
    objects: dict = field(default_factory=dict)       # fqn -> encoded value (replicated)
    per_rank: dict = field(default_factory=dict)      # fqn -> encoded value (per-rank objects)
    shard_digests: tuple[str, ...] = ()
    object_digests: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- what a rank writes

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


@dataclass(frozen=True)
class GlobalSavePlan:
    """The coordinator's plan: what each rank writes, and the layout the metadata will describe."""

    assignments: tuple[Assignment, ...]
    tensor_info: dict[str, tuple[str, list[int]]]  # fqn -> (dtype name, global shape)
    object_keys: tuple[str, ...]
    per_rank: dict[str, str]                       # fqn -> "tensor" or "object"
    sharded_grids: dict[str, tuple[int, ...]]      # fqn -> grid of each sharded object
    shard_holders: dict[tuple, list[tuple[int, int]]]  # (fqn, index) -> [(rank, local shard i)]
    bytes_per_rank: tuple[int, ...]


@dataclass(frozen=True)
class WriteItem:
    """One piece to write: its header name, its bytes' tensor (on the host and contiguous, or on a
    CUDA device in a synchronous save) and its piece key (saying what the bytes are; passed through
    to the report; None for padding between pieces, engine.write)."""

    name: str
    tensor: torch.Tensor
    key: PieceKey | None


@codec.record
@dataclass(frozen=True)
class WrittenPiece:
    """Where a written piece's bytes are: file (relative to the checkpoint), byte range, checksums."""

    key: Any
    file: str
    byte_offset: int
    nbytes: int
    checksums: tuple[int, ...]


# ----------------------------------------------------------------------------- a save's messages
#
# Planning, in one or two rounds of the save's messages (save_rounds.py): every rank sends a
# PlanRequest; the coordinator answers UseCachedPlan, a PlanReply per rank, ResendStructure (then
# every rank sends its structure again and gets a PlanReply), or SaveFailed. Committing: every rank
# sends a WriteReport; the coordinator answers Committed or SaveFailed.

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

    @staticmethod
    def failed(save: SaveId, error: str) -> WriteReport:
        """The report of a rank that could not write its part."""
        return WriteReport(save, None, {}, {}, (), {}, (), (), error)


@codec.record
@dataclass(frozen=True)
class Committed:
    """Coordinator -> every rank: the checkpoint is committed."""
    save: SaveId


@dataclass(frozen=True)
class PlanMessage:
    """The plan requests of a subtree of ranks (consecutive, in rank order) on their way up the tree,
    sent as one JSON object of these named lists (`to_json`, `from_json`):

    - `keys`: each rank's structure digest (PlanRequest.key);
    - `bodies`: the rest of each distinct request, without its tensor entries, as JSON text, each once;
    - `body`: which of `bodies` each rank sent (indices);
    - `counts`: how many tensor entries each rank had;
    - `texts`: each distinct tensor entry text once (TensorEntry.text);
    - `held`: for each text, the ranks holding it, as one flat list [rank, entry index, ...].
    """

    keys: list
    bodies: list
    body: list
    counts: list
    texts: list
    held: list

    @staticmethod
    def of_request(request: PlanRequest, rank: int) -> PlanMessage:
        """The message of the subtree of rank `rank` alone."""
        texts = list(request.structure.tensors) if request.structure is not None else []
        body = replace(request, key=None, structure=None if request.structure is None else
                       replace(request.structure, tensors=()))
        return PlanMessage([request.key], [json.dumps(codec.to_wire(body), separators=(",", ":"))], [0],
                           [len(texts)], texts, [[rank, ti] for ti in range(len(texts))])

    @staticmethod
    def unreadable() -> PlanMessage:
        """What stands for one rank whose message is not a plan message (the coordinator names it)."""
        return PlanMessage([None], [""], [0], [0], [], [])

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in _MESSAGE_FIELDS}

    @staticmethod
    def from_json(m: Any) -> PlanMessage | None:
        """The message JSON object `m` holds if it has a plan message's form (what merging relies
        on; the coordinator checks the rest), else None."""
        if not (type(m) is dict and len(m) == len(_MESSAGE_FIELDS)
                and all(type(m.get(k)) is list for k in _MESSAGE_FIELDS)):
            return None
        message = PlanMessage(**m)
        well_formed = (
            len(message.keys) == len(message.body) == len(message.counts) and len(message.texts) == len(message.held)
            and set(map(type, message.bodies)) <= {str} and set(map(type, message.texts)) <= {str}
            and set(map(type, message.held)) <= {list} and set(map(type, message.body)) <= {int}
            and (not message.body or 0 <= min(message.body) and max(message.body) < len(message.bodies)))
        return message if well_formed else None


_MESSAGE_FIELDS = tuple(f.name for f in fields(PlanMessage))


@dataclass(frozen=True)
class GatheredRequests:
    """Every rank's PlanRequest on the coordinator (their structures without tensor entries) and the
    entries, grouped: each text -> the ranks holding it ([rank, entry index, ...], rank order)."""

    requests: tuple[PlanRequest, ...]
    entries: dict[str, list[int]]


# ----------------------------------------------------------------------------- a load

@dataclass(frozen=True)
class ReadItem:
    """Copy the part `offsets/lengths` (global coordinates) of `piece` into `dest`. `fresh`: `dest`
    was made for this load and is not the caller's yet, so it may be read into before the load is
    known to succeed."""

    fqn: str
    piece: Piece
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dest: torch.Tensor
    fresh: bool = False


@dataclass(frozen=True)
class ValueLoad:
    """A non-tensor value for a target: `fetch()` decodes or reads it and checks that the target
    takes it, changing nothing of the caller's; `hand_over(value)` gives it to the target."""

    fqn: str
    fetch: Callable[[], Any]
    hand_over: Callable[[Any], None]


@dataclass(frozen=True)
class LoadPlan:
    """What one rank does to load: read byte ranges, then hand over new tensors and values."""

    items: tuple[ReadItem, ...] = ()
    values: tuple[ValueLoad, ...] = ()
    late: tuple[tuple[LoadTarget, torch.Tensor], ...] = ()  # new tensors, set once read
    missing: tuple[str, ...] = ()     # requested but not in the checkpoint
    unexpected: tuple[str, ...] = ()  # in the checkpoint under a requested module/optimizer
