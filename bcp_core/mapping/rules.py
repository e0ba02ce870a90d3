"""The rules a declared mapping is made of: `Region` (a box of a parameter), `Copy` (target box :=
source box), `KeyScheme` (how a framework names a parameter and its optimizer state), the checks
of a list of copies, and the primitives that build copies (`rename`, `stack`, `unstack`, `rows`,
`qkv_split`). The lowest module of the package: `mapped_read.py` (a mapping bound to a checkpoint)
and `declaration.py` (`Mapping`) build on it (docs/mapping.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import MappingError
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
    `model`: a regular expression matching (at the start) the checkpoint keys of the model's tensors,
    as against optimizer state and anything else saved beside them; None: not known. A mapping that
    reads a whole model (`Mapping.complete`) finds by it the model tensors it would leave unread.
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
    model: str | None = None

    def weight_key(self, name: str) -> str:
        return self.weight.format(name=name)

    def state_key(self, name: str, state: str) -> str:
        return self.state.format(name=name, state=state)

    def name_of(self, key: str) -> str | None:
        """The parameter name of the checkpoint key `key` of a model tensor (`model`), or None when `key`
        is none (or `model` is not known)."""
        if self.model is None or not re.match(self.model, key):
            return None
        head, _, tail = self.weight.partition("{name}")
        found = re.fullmatch(re.escape(head) + "(.+)" + re.escape(tail), key, re.S)
        return found[1] if found else None


def torch_scheme(model: str = "model", optimizer: str = "optimizer") -> KeyScheme:
    """A module and a torch optimizer saved by bcp as `{model: module, optimizer: optim}`."""
    return KeyScheme(weight=f"{model}.{{name}}", state=f"{optimizer}.state.{{name}}.{{state}}",
                     step=f"{optimizer}.state.{{name}}.step", groups=f"{optimizer}.param_groups",
                     model=re.escape(model) + r"\.")


def megatron_scheme() -> KeyScheme:
    """Megatron-core's sharded state dict keys; DistributedOptimizer state in its `fully_reshardable`
    layout (`optimizer.state.<state>.<param key>`, fp32 master copy `param`; saved by a chain of
    optimizers without `chained_optim_avoid_prefix`, each key has its optimizer's `chained_<n>.`
    prefix), the step in Megatron's common state: the object `common_state` (every bcp save since
    it moved into the commit; common.pt in earlier saves up to megatron-core 0.18). The model's
    tensors: every key but the optimizer's."""
    return KeyScheme(weight="{name}", state="optimizer.state.{state}.{name}", master="param",
                     common_file="common.pt", common_object="common_state/shard_0_1", state_prefix=r"chained_\d+\.",
                     model=r"(?!optimizer\.|chained_\d+\.)")


def inside(region: Region, shape: Shape, what: str) -> None:
    if len(shape) != len(region.offsets) or any(
            s is not None and o + n > s for o, n, s in zip(region.offsets, region.lengths, shape)):
        raise MappingError(f"{what}: box at {list(region.offsets)} of lengths {list(region.lengths)} does not lie "
                           f"in its declared shape {shape_str(shape)}")


def check_disjoint(name: str, copies: Iterable[Copy]) -> None:
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


def shape_str(shape: Shape) -> str:
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
