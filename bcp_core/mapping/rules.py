"""The rules of a declared mapping: `Region` (a box of a parameter), `Copy` (target box := source box),
`KeyScheme` (how a framework names a parameter and its optimizer state), `Mapping` (every target
parameter made of source regions, with its exact inverse), and the primitives that build copies
(`rename`, `stack`, `unstack`, `rows`, `qkv_split`). Applying a mapping to a checkpoint is
`mapped_read.py`; the declared families are `llama.py` (docs/mapping.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from ..errors import MappingError
from ..metadata import CheckpointMetadata, TensorMeta
from ..shards import intersect

Shape = tuple  # of int, or None for "any size that holds what is read" (a padded vocabulary)


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
    the checkpoint directory, or `common_object`, a sharded object holding such a file's bytes;
    read with `weights_only=True`). `groups`: the optimizer's param groups,
    which a mapping between frameworks does not carry (the target keeps its own hyperparameters).
    `state_prefix`: a regular expression for a prefix the framework may put before a state key
    (Megatron's chained optimizers, `chained_<n>.`); a source state key is found with or without it.
    """

    weight: str
    state: str
    moments: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    master: str | None = None
    step: str | None = None
    common_file: str | None = None
    common_object: str | None = None
    groups: str | None = None
    state_prefix: str | None = None

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
    layout (`optimizer.state.<state>.<param key>`, fp32 master copy `param`; saved by a chain of
    optimizers without `chained_optim_avoid_prefix`, each key has its optimizer's `chained_<n>.`
    prefix), the step in Megatron's common state: common.pt up to megatron-core 0.18, the object
    `common_state` from 0.19 on."""
    return KeyScheme(weight="{name}", state="optimizer.state.{state}.{name}", master="param",
                     common_file="common.pt", common_object="common_state/shard_0_1", state_prefix=r"chained_\d+\.")


@dataclass(frozen=True)
class Mapping:
    """Target parameters made of source regions. `sources` and `targets` declare every parameter's
    global shape (None on an axis: any size holding what is read). `weights_only`: target parameters
    tied to another (one tensor in the model, no optimizer state of their own). `unread`: source
    parameters tied to another, whose copies are kept for the inverse but not read (the inverse's
    `weights_only`). `step`: the step counter to give the target optimizer when the source's cannot
    be read. `alternatives`: parameters some layouts of a framework name otherwise (name -> the
    other name): a source is read under the other name when the checkpoint has only that one, and a
    target is offered under both."""

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
                       weights_only=self.unread, unread=self.weights_only, step=self.step,
                       alternatives=dict(self.alternatives))

    def read_as(self, names: dict[str, str]) -> Mapping:
        """This mapping reading each source parameter `a` of `names` under the name `names[a]`."""
        def named(r: Region) -> Region:
            return replace(r, key=names.get(r.key, r.key))
        return replace(self, sources={names.get(k, k): v for k, v in self.sources.items()},
                       copies=tuple(Copy(c.target, named(c.source)) for c in self.copies),
                       unread=frozenset(names.get(k, k) for k in self.unread))

    def with_step(self, step: int) -> Mapping:
        """This mapping, handing the target optimizer `step` when the source's step cannot be read."""
        return replace(self, step=step)

    def with_keys(self, source_keys: KeyScheme | None = None, target_keys: KeyScheme | None = None) -> Mapping:
        return replace(self, source_keys=source_keys or self.source_keys, target_keys=target_keys or self.target_keys)

    def bind(self, md: CheckpointMetadata, storage=None,
             check_files: Callable[[str, TensorMeta], None] = lambda fqn, tm: None,
             optimizer: bool = True):
        """This mapping applied to the checkpoint `md` (in `storage`), a `MappedCheckpoint`: the metadata
        the load sees (target keys, shapes, dtypes) and the source byte ranges behind each target box.
        Checks every source against the declaration first. `optimizer=False`: the weights only (an export)."""
        from .mapped_read import MappedCheckpoint  # the layer that reads; it imports this one
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


# ----------------------------------------------------------------------------- primitives: lists of copies

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
