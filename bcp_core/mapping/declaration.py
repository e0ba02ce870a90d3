"""`Mapping`: a declared mapping between two models' tensors — every target parameter made of source
regions (`rules.Copy`), every parameter's global shape on both sides, how each framework names a
parameter and its optimizer state (`rules.KeyScheme`), and its exact inverse. `Mapping.bind` applies
it to one checkpoint (`mapped_read.MappedCheckpoint`). The declared model families are built by
`decoder.py` from `families.py` (docs/mapping.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..errors import MappingError
from ..metadata import CheckpointMetadata, TensorMeta
from .mapped_read import MappedCheckpoint
from .rules import Copy, KeyScheme, Region, Shape, check_disjoint, inside


@dataclass(frozen=True)
class Mapping:
    """Target parameters made of source regions. `sources` and `targets` declare every parameter's
    global shape (None on an axis: any size holding what is read). `weights_only`: target parameters
    tied to another (one tensor in the model, no optimizer state of their own). `unread`: source
    parameters tied to another, whose copies are kept for the inverse but not read (the inverse's
    `weights_only`). `no_state`: parameters of either side that no optimizer steps (buffers, e.g. a
    router's expert bias): their weights are read, no optimizer state is looked for or made. `step`:
    the step counter to give the target optimizer when the source's cannot be read. `alternatives`:
    parameters some layouts of a framework name otherwise (name -> the other name): a source is read
    under the other name when the checkpoint has only that one, and a target is offered under both.
    `complete`: the mapping reads a whole model: every model tensor of the source checkpoint (by its
    `source_keys.model`) is a source, or binding it fails naming those it would leave unread (a config
    that disagrees with the checkpoint: an untied output layer, a bias, a norm, a layer it does not
    declare). `leaves`: (regular expression, why) for source parameter names the mapping does not read,
    matched from the start: `why` None when it leaves them by design (a Megatron model's multi-token
    prediction layers when the target holds none), else what of the config disagrees, for the error.
    `target_leaves`: the same for the target's names (the inverse's `leaves`)."""

    name: str
    sources: dict[str, Shape]
    targets: dict[str, Shape]
    copies: tuple[Copy, ...]
    source_keys: KeyScheme
    target_keys: KeyScheme
    weights_only: frozenset[str] = frozenset()
    unread: frozenset[str] = frozenset()
    step: int | None = None
    alternatives: dict[str, str] = field(default_factory=dict)
    no_state: frozenset[str] = frozenset()
    complete: bool = False
    leaves: tuple[tuple[str, str | None], ...] = ()
    target_leaves: tuple[tuple[str, str | None], ...] = ()

    def __post_init__(self):
        for c in self.copies:
            for side, region, shapes in (("source", c.source, self.sources), ("target", c.target, self.targets)):
                shape = shapes.get(region.key)
                if shape is None:
                    raise MappingError(f"mapping {self.name!r}: {side} {region.key!r} of a copy is not declared")
                inside(region, shape, f"mapping {self.name!r}: {side} {region.key!r}")
        check_disjoint(self.name, self.read_copies)

    @property
    def read_copies(self) -> tuple[Copy, ...]:
        return tuple(c for c in self.copies if c.source.key not in self.unread)

    def inverse(self) -> Mapping:
        """The mapping back: every copy reversed. A tied target (`weights_only`) becomes an unread
        source: the parameter it is tied to is read instead. `m.inverse().inverse() == m`."""
        return Mapping(self.name.removeprefix("inverse of ") if self.name.startswith("inverse of ") else
                       f"inverse of {self.name}", dict(self.targets), dict(self.sources),
                       tuple(c.inverse() for c in self.copies), self.target_keys, self.source_keys,
                       weights_only=self.unread, unread=self.weights_only, step=self.step,
                       alternatives=dict(self.alternatives), no_state=self.no_state, complete=self.complete,
                       leaves=self.target_leaves, target_leaves=self.leaves)

    def read_as(self, names: dict[str, str]) -> Mapping:
        """This mapping reading each source parameter `a` of `names` under the name `names[a]`."""
        def named(r: Region) -> Region:
            return replace(r, key=names.get(r.key, r.key))
        return replace(self, sources={names.get(k, k): v for k, v in self.sources.items()},
                       copies=tuple(Copy(c.target, named(c.source)) for c in self.copies),
                       unread=frozenset(names.get(k, k) for k in self.unread),
                       no_state=self.no_state | frozenset(names[k] for k in self.no_state if k in names))

    def with_step(self, step: int) -> Mapping:
        """This mapping, handing the target optimizer `step` when the source's step cannot be read."""
        return replace(self, step=step)

    def with_keys(self, source_keys: KeyScheme | None = None, target_keys: KeyScheme | None = None) -> Mapping:
        return replace(self, source_keys=source_keys or self.source_keys, target_keys=target_keys or self.target_keys)

    def bind(self, md: CheckpointMetadata, storage=None,
             check_files: Callable[[str, TensorMeta], None] = lambda fqn, tm: None,
             optimizer: bool = True) -> MappedCheckpoint:
        """This mapping applied to the checkpoint `md` (in `storage`), a `MappedCheckpoint`: the metadata
        the load sees (target keys, shapes, dtypes) and the source byte ranges behind each target box.
        Checks every source against the declaration first, and, for a `complete` mapping, that it reads
        every model tensor of the checkpoint. `optimizer=False`: the weights only (an export)."""
        return MappedCheckpoint(self, md, storage, check_files, optimizer)
