"""Declared mappings between two models' tensors: load a checkpoint of one model family into another.

A `Mapping` says, for every parameter of the target model, which regions of which source parameters
it is made of (`Copy`: a box of a target parameter := a box of a source parameter). Everything else
follows from that list: the model weights, the optimizer state kept per parameter (Adam's moments,
a master copy), the step counter. A mapped load is an ordinary bcp load whose targets are assembled
from source boxes: each rank reads only the byte ranges of the source pieces its own boxes need,
verified, all or nothing; nothing is gathered and no full tensor is built in between.

    m = bcp.mapping.megatron_to_hf(hf_model.config)          # bcp_core/mapping/llama.py
    bcp.load(path, {"model": hf_model, "optimizer": opt}, mapping=m)
    bcp.load(path2, megatron_state, framework="megatron", mapping=m.inverse())

Every mapping has an exact inverse (`Mapping.inverse`). A source whose shape disagrees with the
declaration, a missing source, a target of another shape or two sources for one element raise
`MappingError` naming the key and the shapes. Target elements no copy covers (vocabulary padding)
are zero. docs/mapping.md has the rules and the layout facts the declared families rely on.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import codec
from ..errors import MappingError
from ..load_planner import ReadItem, box_read_items
from ..metadata import CheckpointMetadata, ObjectValue, TensorMeta
from ..shards import Box, intersect, local_tensor

Shape = tuple  # of int, or None for "any size that holds what is read" (a padded vocabulary)


# ----------------------------------------------------------------------------- the declaration

@dataclass(frozen=True)
class Region:
    """A box of parameter `key` (a parameter name, without the checkpoint's prefixes)."""

    key: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self):
        if len(self.offsets) != len(self.lengths) or any(o < 0 for o in self.offsets) or \
                any(n <= 0 for n in self.lengths):
            raise MappingError(f"region of {self.key!r}: offsets {self.offsets} and lengths {self.lengths} "
                               "do not make a box")


@dataclass(frozen=True)
class Copy:
    """`target` := `source`, element for element. Both boxes have the same lengths once the side with
    more axes drops its leading ones, which must have length 1 (a layer index: stacking)."""

    target: Region
    source: Region

    def __post_init__(self):
        t, s = self.target.lengths, self.source.lengths
        k = len(t) - len(s)
        longer = t if k > 0 else s
        if any(n != 1 for n in longer[:abs(k)]) or t[max(k, 0):] != s[max(-k, 0):]:
            raise MappingError(f"copy {self.source.key!r}{list(s)} -> {self.target.key!r}{list(t)}: the boxes "
                               "differ in shape (only leading axes of length 1 may be added or dropped)")

    def inverse(self) -> Copy:
        return Copy(self.source, self.target)


@dataclass(frozen=True)
class KeyScheme:
    """How a framework names a parameter and its optimizer state in a bcp checkpoint.

    `weight` and `state` are format strings over `name` (the parameter) and `state` (the state's
    name). `moments`: per-parameter optimizer state shaped like the parameter. `master`: the state
    holding an fp32 master copy of the weight, if the optimizer keeps one (filled from the weight
    when the source has none). `step`: the per-parameter step counter's key, or None when the
    framework keeps one step for all, outside the parameters (`common_file`, a torch.save file of
    the checkpoint directory, read with `weights_only=True`). `groups`: the optimizer's param groups,
    which a mapping between frameworks does not carry (the target keeps its own hyperparameters).
    """

    weight: str
    state: str
    moments: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    master: str | None = None
    step: str | None = None
    common_file: str | None = None
    groups: str | None = None

    def weight_key(self, name: str) -> str:
        return self.weight.format(name=name)

    def state_key(self, name: str, state: str) -> str:
        return self.state.format(name=name, state=state)


def torch_scheme(model: str = "model", optimizer: str = "optimizer") -> KeyScheme:
    """A module and a torch optimizer saved by bcp as `{model: module, optimizer: optim}`."""
    return KeyScheme(weight=f"{model}.{{name}}", state=f"{optimizer}.state.{{name}}.{{state}}",
                     step=f"{optimizer}.state.{{name}}.step", groups=f"{optimizer}.param_groups")


def megatron_scheme() -> KeyScheme:
    """Megatron-core's sharded state dict keys; DistributedOptimizer state in its `fully_reshardable`
    layout (`optimizer.state.<state>.<param key>`, fp32 master copy `param`), the step in common.pt."""
    return KeyScheme(weight="{name}", state="optimizer.state.{state}.{name}", master="param",
                     common_file="common.pt")


@dataclass(frozen=True)
class Mapping:
    """Target parameters made of source regions. `sources` and `targets` declare every parameter's
    global shape (None on an axis: any size holding what is read). `weights_only`: target parameters
    tied to another (one tensor in the model, no optimizer state of their own). `unread`: source
    parameters tied to another, whose copies are kept for the inverse but not read (the inverse's
    `weights_only`). `step`: the step counter to give the target optimizer when the source's cannot
    be read."""

    name: str
    sources: dict[str, Shape]
    targets: dict[str, Shape]
    copies: tuple[Copy, ...]
    source_keys: KeyScheme
    target_keys: KeyScheme
    weights_only: frozenset[str] = frozenset()
    unread: frozenset[str] = frozenset()
    step: int | None = None

    def __post_init__(self):
        for c in self.copies:
            for side, region, shapes in (("source", c.source, self.sources), ("target", c.target, self.targets)):
                shape = shapes.get(region.key)
                if shape is None:
                    raise MappingError(f"mapping {self.name!r}: {side} {region.key!r} of a copy is not declared")
                _inside(region, shape, f"mapping {self.name!r}: {side} {region.key!r}")
        _check_disjoint(self.name, self.read_copies)

    @property
    def read_copies(self) -> tuple[Copy, ...]:
        return tuple(c for c in self.copies if c.source.key not in self.unread)

    def inverse(self) -> Mapping:
        """The mapping back: every copy reversed. A tied target (`weights_only`) becomes an unread
        source: the parameter it is tied to is read instead. `m.inverse().inverse() == m`."""
        return Mapping(self.name.removeprefix("inverse of ") if self.name.startswith("inverse of ") else
                       f"inverse of {self.name}", dict(self.targets), dict(self.sources),
                       tuple(c.inverse() for c in self.copies), self.target_keys, self.source_keys,
                       weights_only=self.unread, unread=self.weights_only, step=self.step)

    def with_step(self, step: int) -> Mapping:
        """This mapping, handing the target optimizer `step` when the source's step cannot be read."""
        return replace(self, step=step)

    def with_keys(self, source_keys: KeyScheme | None = None, target_keys: KeyScheme | None = None) -> Mapping:
        return replace(self, source_keys=source_keys or self.source_keys, target_keys=target_keys or self.target_keys)

    def bind(self, md: CheckpointMetadata, storage=None,
             check_files: Callable[[str, TensorMeta], None] = lambda fqn, tm: None,
             optimizer: bool = True) -> MappedCheckpoint:
        """This mapping applied to the checkpoint `md` (in `storage`): the metadata the load sees
        (target keys, shapes, dtypes) and the source byte ranges behind each target box. Checks every
        source against the declaration first. `optimizer=False`: the weights only (an export)."""
        return MappedCheckpoint(self, md, storage, check_files, optimizer)


def _inside(region: Region, shape: Shape, what: str) -> None:
    if len(shape) != len(region.offsets) or any(
            s is not None and o + n > s for o, n, s in zip(region.offsets, region.lengths, shape)):
        raise MappingError(f"{what}: box at {list(region.offsets)} of lengths {list(region.lengths)} does not lie "
                           f"in its declared shape {_shape_str(shape)}")


def _check_disjoint(name: str, copies: Iterable[Copy]) -> None:
    """No target element has two sources."""
    by_key: dict[str, list[Region]] = {}
    for c in copies:
        by_key.setdefault(c.target.key, []).append(c.target)
    for regions in by_key.values():
        regions.sort(key=lambda r: r.offsets[:1])
        for i, a in enumerate(regions):
            for b in regions[i + 1:]:
                if a.offsets and b.offsets[0] >= a.offsets[0] + a.lengths[0]:
                    break  # sorted on the first axis: no later region reaches back into `a`
                if intersect(a.offsets, a.lengths, b.offsets, b.lengths) is not None:
                    raise MappingError(f"mapping {name!r}: target {a.key!r} gets boxes at {list(a.offsets)} and "
                                       f"{list(b.offsets)} from two sources; they overlap")


def _shape_str(shape: Shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


# ----------------------------------------------------------------------------- primitives

def whole(name: str, shape: tuple[int, ...]) -> Region:
    return Region(name, (0,) * len(shape), tuple(shape))


def rename(source: str, target: str, shape: tuple[int, ...]) -> list[Copy]:
    """target := source, same shape."""
    return [Copy(whole(target, shape), whole(source, shape))]


def stack(sources: list[str], target: str, shape: tuple[int, ...]) -> list[Copy]:
    """target[i] := sources[i]: per-layer tensors of `shape` stacked on a leading layer axis."""
    return [Copy(Region(target, (i,) + (0,) * len(shape), (1, *shape)), whole(s, shape)) for i, s in enumerate(sources)]


def unstack(source: str, targets: list[str], shape: tuple[int, ...]) -> list[Copy]:
    """targets[i] := source[i] (the inverse of `stack`)."""
    return [c.inverse() for c in stack(targets, source, shape)]


def rows(target: str, parts: list[tuple[str, int, int, int]], trailing: tuple[int, ...] = (),
         target_index: tuple[int, ...] = (), source_index: tuple[int, ...] = ()) -> list[Copy]:
    """Row ranges: for each (source, source_row, target_row, n), target rows [target_row, +n) :=
    source rows [source_row, +n); `trailing` are the other axes (whole). `target_index` /
    `source_index` are leading layer indices of stacked tensors. Splitting one tensor into several
    and concatenating several into one are both lists of row ranges."""
    out = []
    for source, s_row, t_row, n in parts:
        t = Region(target, (*target_index, t_row) + (0,) * len(trailing), (1,) * len(target_index) + (n, *trailing))
        s = Region(source, (*source_index, s_row) + (0,) * len(trailing), (1,) * len(source_index) + (n, *trailing))
        out.append(Copy(t, s))
    return out


def qkv_split(qkv: str, q: str, k: str, v: str, heads: int, groups: int, head_dim: int,
              trailing: tuple[int, ...] = (), index: tuple[int, ...] = ()) -> list[Copy]:
    """Grouped-query attention: `qkv` rows are ordered per query group g as [the heads/groups query
    heads of g; key head g; value head g] (Megatron's `linear_qkv`); `q`, `k`, `v` hold the query,
    key and value heads in order (Hugging Face's q_proj, k_proj, v_proj). `index`: qkv's leading
    layer index. One row range per group and projection."""
    if heads % groups:
        raise MappingError(f"{qkv!r}: {heads} attention heads do not split into {groups} query groups")
    per = heads // groups
    step = (per + 2) * head_dim
    parts = []
    for g in range(groups):
        base = g * step
        parts += [(q, base, g * per * head_dim, per * head_dim), (k, base + per * head_dim, g * head_dim, head_dim),
                  (v, base + (per + 1) * head_dim, g * head_dim, head_dim)]
    out = []
    for target, s_row, t_row, n in parts:
        out += rows(target, [(qkv, s_row, t_row, n)], trailing, source_index=index)
    return out


# ----------------------------------------------------------------------------- a mapping applied to a checkpoint

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

    mapping: Mapping
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

    def __post_init__(self):
        m, md = self.mapping, self.source
        src, tgt = m.source_keys, m.target_keys
        self._check_sources()
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
            slots = [(tgt.weight_key(name), src.weight_key)]
            if with_state and name not in m.weights_only:
                slots += [(tgt.state_key(name, s), lambda n, s=s: src.state_key(n, s)) for s in tgt.moments]
                if tgt.master is not None:
                    master = src.master
                    slots.append((tgt.state_key(name, tgt.master),
                                  (lambda n: src.state_key(n, master)) if master else src.weight_key))
            for key, source_key in slots:
                dtype = self._add(key, shape, [(c, source_key(c.source.key)) for c in copies])
                tensors[key] = TensorMeta(dtype, shape, ())
            if with_state and name not in m.weights_only and tgt.step is not None and copies:
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
                                   f"the mapping declares {_shape_str(shape)} (check the model config)")
            out[name] = tuple(tm.shape)
        for c in m.read_copies:
            _inside(c.source, out[c.source.key], f"mapping {m.name!r}: {m.source_keys.weight_key(c.source.key)!r} "
                                                 f"of shape {out[c.source.key]}")
        return out

    def _optimizer_present(self) -> bool:
        """Whether the source holds optimizer state: every parameter's moments, or none at all."""
        m = self.mapping
        keys = [m.source_keys.state_key(n, s) for n in m.sources if n not in m.unread
                for s in m.source_keys.moments]
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
        """The source's single step counter (Megatron: the optimizer's param groups in common.pt)."""
        m = self.mapping
        if m.step is not None:
            return m.step
        name = m.source_keys.common_file
        found: set = set()
        if name is not None and self.storage is not None and self.storage.exists(name):
            try:
                common = torch.load(io.BytesIO(self.storage.read_bytes(name)), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - named in the error below
                raise MappingError(f"mapping {m.name!r}: cannot read the step counter from {name} "
                                   f"({type(e).__name__}: {e}); pass step= to the mapping") from None
            found = _steps(common)
        if len(found) != 1:
            where = f"{name}" if name else "the checkpoint"
            raise MappingError(f"mapping {m.name!r}: {where} holds {'no' if not found else sorted(found)} optimizer "
                               "step counter(s) in param groups; pass step= to the mapping")
        return int(found.pop())

    def source_step(self) -> int | None:
        """The source optimizer's step counter, or None when the checkpoint holds no optimizer state:
        for a target that keeps one step outside its parameters (Megatron's param groups). Read
        from the source's per-parameter counters (which must agree), or as `_step` finds it."""
        m = self.mapping
        if not self._optimizer_present():
            return None
        if m.source_keys.step is None:
            return self._step()
        keys = [m.source_keys.step.format(name=n) for n in m.sources if n not in m.unread]
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


from .llama import hf_to_megatron, megatron_to_hf  # noqa: E402 - the declared families use the layer above

FAMILIES = ("llama", "mistral", "qwen2")  # Hugging Face model_type values the declared mappings serve


def resolve_mapping(mapping: Any, md: CheckpointMetadata, state: dict, adapter: Any) -> Mapping | None:
    """`mapping` itself, or for "auto" the declared mapping from the framework that saved `md` to the
    target's: none when both are Megatron or both are not; Megatron -> a Hugging Face model of the
    Llama family in `state` (its config says how); anything else is refused."""
    if isinstance(mapping, Mapping):
        return mapping
    if mapping != "auto":
        raise MappingError(f"mapping must be a bcp_core.mapping.Mapping or 'auto', got {mapping!r}")
    saved_megatron, into_megatron = md.framework == "megatron", adapter.name == "megatron"
    if saved_megatron == into_megatron:
        return None
    if into_megatron:
        raise MappingError(f"mapping='auto': the checkpoint was saved by {md.framework!r}, the target is Megatron; "
                           "a Megatron state does not say which model family it is: pass "
                           "mapping=bcp.mapping.hf_to_megatron(hf_config)")
    models = [(k, v) for k, v in state.items() if isinstance(v, torch.nn.Module)]
    found = [(k, getattr(_unwrapped(v), "config", None)) for k, v in models]
    found = [(k, cfg) for k, cfg in found if cfg is not None]
    if len(found) != 1:
        raise MappingError(f"mapping='auto': the checkpoint was saved by Megatron; the target needs exactly one "
                           f"Hugging Face model (with a .config) in the state, found {len(found)}")
    key, cfg = found[0]
    family = getattr(cfg, "model_type", None)
    if family not in FAMILIES:
        raise MappingError(f"mapping='auto': no declared mapping from Megatron to a {family!r} model (declared: "
                           f"{', '.join(FAMILIES)})")
    optimizers = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    return megatron_to_hf(cfg, model=key, optimizer=optimizers[0] if len(optimizers) == 1 else "optimizer")


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    from ..adapters import unwrap
    return unwrap(module)

__all__ = ["Mapping", "Copy", "Region", "KeyScheme", "MappedCheckpoint", "torch_scheme", "megatron_scheme",
           "whole", "rename", "stack", "unstack", "rows", "qkv_split", "megatron_to_hf", "hf_to_megatron",
           "resolve_mapping", "FAMILIES"]
