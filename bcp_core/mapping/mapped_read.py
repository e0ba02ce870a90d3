"""The mapped read: a `Mapping` (declaration.py) bound to one checkpoint (`MappedCheckpoint`). It checks
every source against the declaration, gives the load the metadata it sees (target keys, shapes, the
sources' dtypes), finds the source byte ranges behind each target box, zeroes what no copy covers,
and reads the step counter the target optimizer gets. Below `declaration.py`: it knows a mapping
by the fields it reads.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import codec
from ..engine import ShardReader
from ..errors import BCPError, MappingError
from ..load_planner import ReadItem, box_read_items
from ..metadata import CheckpointMetadata, ObjectValue, TensorMeta, read_capped
from ..shards import Box, intersect, local_tensor
from .rules import Copy, Shape, inside, shape_str


@dataclass(frozen=True)
class _Read:
    """Target box [t_off, +lengths) of a checkpoint key := source key `source` at `s_off`."""

    t_off: tuple[int, ...]
    t_len: tuple[int, ...]
    source: str
    s_off: tuple[int, ...]
    s_len: tuple[int, ...]


@dataclass
class MappedCheckpoint:
    """A mapping bound to one checkpoint: `metadata` is what the load sees (target keys), `reads`
    what lies behind each target key's boxes."""

    mapping: Any  # a declaration.Mapping
    source: CheckpointMetadata
    storage: Any = None
    check_files: Callable[[str, TensorMeta], None] = lambda fqn, tm: None
    optimizer: bool = True
    metadata: CheckpointMetadata = field(init=False)
    reads: dict[str, list[_Read]] = field(init=False, default_factory=dict)
    zeros: dict[str, list[tuple[tuple, tuple]]] = field(init=False, default_factory=dict)
    optional: set[str] = field(init=False, default_factory=set)   # target keys the mapping does not carry
    _zero_views: list[torch.Tensor] = field(init=False, default_factory=list)
    _checked: set[str] = field(init=False, default_factory=set)
    _prefixed: dict[str, str] = field(init=False, default_factory=dict)  # a state key -> its prefixed key

    def __post_init__(self):
        m, md = self.mapping, self.source
        src, tgt = m.source_keys, m.target_keys
        # sources saved under another name by this checkpoint's layout (Mapping.alternatives)
        names = {n: alt for n, alt in m.alternatives.items() if n in m.sources and n not in m.unread and
                 src.weight_key(n) not in md.tensors and src.weight_key(alt) in md.tensors}
        if names:
            self.mapping = m = m.read_as(names)
        if src.state_prefix is not None:
            prefix = re.compile(src.state_prefix)
            for key in md.tensors:
                found = prefix.match(key)
                if found:  # two optimizers' state under one key is no state of one parameter: left out
                    short = key[found.end():]
                    self._prefixed[short] = "" if short in self._prefixed else key
        self._check_sources()
        self._check_unread()
        shapes = {k: tuple(_resolved(s, k, m.read_copies)) for k, s in m.targets.items()}
        tensors: dict[str, TensorMeta] = {}
        objects: dict[str, ObjectValue] = {}
        by_target: dict[str, list[Copy]] = {}
        for c in m.read_copies:
            by_target.setdefault(c.target.key, []).append(c)
        with_state = self.optimizer and self._optimizer_present()
        step = None
        for name, shape in shapes.items():
            copies = by_target.get(name, [])
            for out in (name, m.alternatives[name]) if name in m.alternatives else (name,):
                slots = [(tgt.weight_key(out), src.weight_key)]
                if with_state and name not in m.weights_only and name not in m.no_state:
                    slots += [(tgt.state_key(out, s), lambda n, s=s: src.state_key(n, s)) for s in tgt.moments]
                    if tgt.master is not None:
                        master = src.master
                        slots.append((tgt.state_key(out, tgt.master),
                                      (lambda n: src.state_key(n, master)) if master else src.weight_key))
                for key, source_key in slots:
                    dtype = self._add(key, shape, [(c, self._found(source_key(c.source.key))) for c in copies])
                    tensors[key] = TensorMeta(dtype, shape, ())
            if with_state and name not in m.weights_only and name not in m.no_state and tgt.step is not None \
                    and copies:
                key = tgt.step.format(name=name)
                if src.step is not None:
                    s_key = src.step.format(name=copies[0].source.key)
                    tm = self._source(s_key, "the step counter")
                    self.reads[key] = [_Read((), (), s_key, (), ())]
                    tensors[key] = TensorMeta(tm.dtype, (), ())
                else:
                    step = self._step() if step is None else step
                    objects[key] = ObjectValue(codec.encode(torch.tensor(float(step)), key))
        if tgt.groups is not None:
            self.optional.add(tgt.groups)
        self.metadata = CheckpointMetadata(md.world_size, md.framework, md.files, tensors, objects, {}, {},
                                           md.checksum_block_bytes, md.user, md.version)

    # -- checks against the checkpoint

    def _found(self, key: str) -> str:
        """`key`, or the one key of the checkpoint that is `key` behind the source's state prefix."""
        if key in self.source.tensors:
            return key
        return self._prefixed.get(key) or key

    def _source(self, key: str, what: str) -> TensorMeta:
        tm = self.source.tensors.get(key)
        if tm is None:
            raise MappingError(f"mapping {self.mapping.name!r}: {what} {key!r} is not in the checkpoint "
                               f"(it has {len(self.source.tensors)} tensors, e.g. "
                               f"{', '.join(sorted(self.source.tensors)[:4])})")
        return tm

    def _check_sources(self) -> dict[str, tuple[int, ...]]:
        """Every declared source parameter's weight is in the checkpoint with the declared shape;
        returns their shapes."""
        m, out = self.mapping, {}
        for name, shape in m.sources.items():
            if name in m.unread:
                continue
            key = m.source_keys.weight_key(name)
            tm = self._source(key, "source")
            if len(tm.shape) != len(shape) or any(s is not None and s != t for s, t in zip(shape, tm.shape)):
                raise MappingError(f"mapping {m.name!r}: {key!r} has shape {tuple(tm.shape)} in the checkpoint, "
                                   f"the mapping declares {shape_str(shape)} (check the model config)")
            out[name] = tuple(tm.shape)
        for c in m.read_copies:
            inside(c.source, out[c.source.key], f"mapping {m.name!r}: {m.source_keys.weight_key(c.source.key)!r} "
                                                 f"of shape {out[c.source.key]}")
        return out

    def _check_unread(self) -> None:
        """A `complete` mapping reads every model tensor of the checkpoint: one that no source names (nor
        a tied source, nor a name the mapping leaves by design) means the config disagrees with the
        checkpoint, which a load or export would silently turn into another model."""
        m = self.mapping
        if not m.complete or m.source_keys.model is None:
            return
        names = set(m.sources)  # a source saved under both of its names (Mapping.alternatives) is read once
        names |= {x for pair in m.alternatives.items() if names & set(pair) for x in pair}
        used = {m.source_keys.weight_key(n) for n in names}
        unread: dict[str | None, list[str]] = {}
        for key in sorted(self.source.tensors):
            name = m.source_keys.name_of(key)
            if key in used or name is None or _NOT_WEIGHTS.search(name):
                continue
            why = next((w for pattern, w in m.leaves if re.match(pattern, name)), "")
            if why is not None:
                unread.setdefault(why, []).append(key)
        if not unread:
            return
        parts = []
        for why, keys in sorted(unread.items(), key=lambda kv: kv[0] == ""):
            shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            parts.append(f"{shown} ({why})" if why else shown)
        count = sum(map(len, unread.values()))
        raise MappingError(f"mapping {m.name!r}: the config disagrees with the checkpoint: the checkpoint holds "
                           f"{count} model tensor{'s' if count > 1 else ''} the config does not read: "
                           f"{'; '.join(parts)}. Loading or exporting it would make another model than the one "
                           "saved: fix the config")

    def _optimizer_present(self) -> bool:
        """Whether the source holds optimizer state: every parameter's moments, or none at all."""
        m = self.mapping
        keys = [self._found(m.source_keys.state_key(n, s)) for n in m.sources
                if n not in m.unread and n not in m.no_state for s in m.source_keys.moments]
        have = [k for k in keys if k in self.source.tensors]
        if have and len(have) != len(keys):
            missing = sorted(set(keys) - set(have))
            raise MappingError(f"mapping {m.name!r}: the checkpoint holds optimizer state for some parameters but "
                               f"not {len(missing)} others, e.g. {', '.join(missing[:3])}")
        return bool(have)

    def _add(self, key: str, shape: tuple, parts: list[tuple[Copy, str]]) -> torch.dtype:
        """Record the reads behind target `key`; returns its dtype (that of its sources)."""
        reads, dtypes = [], set()
        for c, s_key in parts:
            tm = self._source(s_key, "source")
            if tuple(tm.shape) != self._shape_of(c.source.key):
                raise MappingError(f"mapping {self.mapping.name!r}: {s_key!r} has shape {tuple(tm.shape)}, its "
                                   f"parameter {self.mapping.source_keys.weight_key(c.source.key)!r} "
                                   f"{self._shape_of(c.source.key)}")
            dtypes.add(tm.dtype)
            reads.append(_Read(c.target.offsets, c.target.lengths, s_key, c.source.offsets, c.source.lengths))
        if len(dtypes) > 1:
            raise MappingError(f"mapping {self.mapping.name!r}: {key!r} would be made of sources of dtypes "
                               f"{sorted(map(str, dtypes))}")
        self.reads[key] = reads
        self.zeros[key] = _uncovered(shape, [(r.t_off, r.t_len) for r in reads])
        return dtypes.pop() if dtypes else torch.float32

    def _shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self.source.tensors[self.mapping.source_keys.weight_key(name)].shape)

    def _step(self) -> int:
        """The source's single step counter (Megatron: the optimizer's param groups in its common
        state): the object, committed with the checkpoint, before the file, which older saves wrote."""
        m = self.mapping
        if m.step is not None:
            return m.step
        keys = m.source_keys
        name = None
        if self.storage is not None:
            if keys.common_object in self.source.sharded_objects:
                name = keys.common_object
            elif keys.common_file and self.storage.exists(keys.common_file):
                name = keys.common_file
        found: set = set()
        if name is not None:
            try:
                common = torch.load(io.BytesIO(self._common_bytes(name)), map_location="cpu", weights_only=True)
            except BCPError:
                raise
            except Exception as e:  # noqa: BLE001 - named in the error below
                raise MappingError(f"mapping {m.name!r}: cannot read the step counter from {name} "
                                   f"({type(e).__name__}: {e}); pass step= to the mapping") from None
            found = _steps(common)
        if len(found) != 1:
            where = f"{name}" if name else "the checkpoint"
            raise MappingError(f"mapping {m.name!r}: {where} holds {'no' if not found else sorted(found)} optimizer "
                               "step counter(s) in param groups; pass step= to the mapping")
        return int(found.pop())

    def _common_bytes(self, name: str) -> bytes:
        """The torch.save bytes of the source's common state: the file `name` (its size checked before
        it is read), or the sharded object `name`."""
        if name == self.mapping.source_keys.common_file:
            return read_capped(self.storage, name)
        value = ShardReader(self.storage, self.source, name, allow_pickle=False, verify=True)[(0,)]
        if not isinstance(value, bytes):
            raise MappingError(f"mapping {self.mapping.name!r}: the object {name!r} holds a {type(value).__name__}, "
                               "not the torch.save bytes of a common state")
        return value

    def source_step(self) -> int | None:
        """The source optimizer's step counter, or None when the checkpoint holds no optimizer state:
        for a target that keeps one step outside its parameters (Megatron's param groups). Read
        from the source's per-parameter counters (which must agree), or as `_step` finds it."""
        m = self.mapping
        if not self._optimizer_present():
            return None
        if m.source_keys.step is None:
            return self._step()
        keys = [m.source_keys.step.format(name=n) for n in m.sources if n not in m.unread and n not in m.no_state]
        keys = [k for k in keys if k in self.source.tensors and not self.source.tensors[k].shape]
        if not keys:
            return self._step()
        from ..engine import read_all
        values = {k: torch.empty((), dtype=self.source.tensors[k].dtype) for k in keys}
        items = [item for k, v in values.items() for item in box_read_items(k, self.source.tensors[k], Box((), (), v))]
        read_all(self.storage, self.source.files, self.source.checksum_block_bytes, items, True, 4)
        found = {int(v.item()) for v in values.values()}
        if len(found) != 1:
            if m.step is not None:
                return m.step
            raise MappingError(f"mapping {m.name!r}: the source's parameters were stepped {sorted(found)} times; "
                               "pass step= to the mapping")
        return found.pop()

    # -- the load's reads

    def read_items(self, fqn: str, tm: TensorMeta, target: Any, fresh: bool = False) -> list[ReadItem]:
        """What to read (from source pieces) to fill the local boxes of `target`, the target key `fqn`."""
        if tuple(target.shape) != tuple(tm.shape):
            raise MappingError(f"mapping {self.mapping.name!r}: {fqn!r} is {tuple(tm.shape)} by the mapping, the "
                               f"target has {tuple(target.shape)}")
        if target.dtype != tm.dtype:
            raise MappingError(f"mapping {self.mapping.name!r}: {fqn!r} has dtype {tm.dtype} in the checkpoint, the "
                               f"target {target.dtype}; cast the target")
        items: list[ReadItem] = []
        for box in local_tensor(target).boxes:
            items.extend(self.box_read_items(fqn, box, fresh))
        return items

    def box_read_items(self, fqn: str, box: Box, fresh: bool = False) -> list[ReadItem]:
        items = []
        for r in self.reads[fqn]:
            inter = intersect(box.offsets, box.lengths, r.t_off, r.t_len)
            if inter is None:
                continue
            io_, il = inter
            view = _narrow(box, io_, il)
            k = len(r.t_off) - len(r.s_off)
            for _ in range(max(k, 0)):
                view = view.squeeze(0)
            for _ in range(max(-k, 0)):
                view = view.unsqueeze(0)
            shift = [i - t for i, t in zip(io_[max(k, 0):], r.t_off[max(k, 0):])]
            s_off = tuple(r.s_off[:max(-k, 0)]) + tuple(s + d for s, d in zip(r.s_off[max(-k, 0):], shift))
            s_len = tuple(r.s_len[:max(-k, 0)]) + tuple(il[max(k, 0):])
            tm = self.source.tensors[r.source]
            if r.source not in self._checked:
                self.check_files(r.source, tm)
                self._checked.add(r.source)
            items.extend(box_read_items(r.source, tm, Box(s_off, s_len, view), fresh))
        for off, ln in self.zeros.get(fqn, ()):
            inter = intersect(box.offsets, box.lengths, off, ln)
            if inter is not None:
                self._zero_views.append(_narrow(box, *inter))
        return items

    def fill_zeros(self) -> None:
        """Zero the target elements no source covers in the boxes read so far (run once every read is
        verified)."""
        with torch.no_grad():
            for v in self._zero_views:
                v.zero_()
        self._zero_views.clear()


# model tensors no mapping reads: Transformer Engine's extra state, rotary frequencies (buffers from the config)
_NOT_WEIGHTS = re.compile(r"(^|\.)(_extra_state(/.*)?|inv_freq)$")


def _narrow(box: Box, offsets, lengths) -> torch.Tensor:
    view = box.view
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        view = view.narrow(d, o - box.offsets[d], n)
    return view


def _resolved(shape: Shape, name: str, copies: tuple[Copy, ...]) -> tuple[int, ...]:
    """A target's shape with open axes (None) set to the least size holding its copies."""
    out = []
    for d, s in enumerate(shape):
        if s is None:
            ends = [c.target.offsets[d] + c.target.lengths[d] for c in copies if c.target.key == name]
            s = max(ends, default=0)
        out.append(s)
    return tuple(out)


def _uncovered(shape: tuple[int, ...], boxes: list[tuple[tuple, tuple]]) -> list[tuple[tuple, tuple]]:
    """The parts of `shape` outside every box, as boxes."""
    rest = [((0,) * len(shape), tuple(shape))] if math.prod(shape) else []
    for b_off, b_len in boxes:
        nxt = []
        for off, ln in rest:
            if intersect(off, ln, b_off, b_len) is None:
                nxt.append((off, ln))
                continue
            off, ln = list(off), list(ln)
            for d in range(len(shape)):  # peel off the parts before and after the box, axis by axis
                lo, hi = max(off[d], b_off[d]), min(off[d] + ln[d], b_off[d] + b_len[d])
                if lo > off[d]:
                    nxt.append((tuple(off), tuple(ln[:d] + [lo - off[d]] + ln[d + 1:])))
                if hi < off[d] + ln[d]:
                    nxt.append((tuple(off[:d] + [hi] + off[d + 1:]),
                                tuple(ln[:d] + [off[d] + ln[d] - hi] + ln[d + 1:])))
                off[d], ln[d] = lo, hi - lo
        rest = nxt
    return rest


def _steps(value: Any) -> set:
    """Every `step` of a param-group list found anywhere in `value` (Megatron's common state)."""
    found: set = set()
    if isinstance(value, dict):
        groups = value.get("param_groups")
        if isinstance(groups, list):
            found.update(g["step"] for g in groups if isinstance(g, dict) and g.get("step") is not None)
        for v in value.values():
            found |= _steps(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            found |= _steps(v)
    found = {int(s.item()) if isinstance(s, torch.Tensor) else int(s) for s in found}
    return found
