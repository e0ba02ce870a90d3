"""Load a Megatron checkpoint saved in one key layout into a sharded state dict of another.

Megatron-core names the same tensor differently depending on how a run asked for its state dict:

* stacked (the default): `decoder.layers.<name>` with a leading layer axis, and the experts of an
  MoE layer on the next axis, `decoder.layers.mlp.experts.experts.linear_fc1.weight` [L, E, 2F, H];
* per layer and per expert (`metadata={"singleton_local_shards": True}`, and any model whose layers
  differ): `decoder.layers.<i>.<name>`, `...experts.experts.<e>.linear_fc1.weight_w` / `_v` (the gate
  and up halves of a SwiGLU fc1 as two tensors, [F, H] each);
* optimizer state of a chain of optimizers saved without `chained_optim_avoid_prefix`: each key
  behind its optimizer's `chained_<n>.` prefix (which optimizer holds a parameter changes with EP:
  at EP=1 the experts are the dense optimizer's, at EP>1 the second one's).

`to_saved_layout` rewrites the boxes of every requested tensor (and the shard of every requested
sharded object) that the checkpoint holds only under another of these names, into that name's
coordinates: a per-layer, per-expert gate half becomes a box of the stacked tensor at [layer,
expert, rows of the gate]; a stacked box splits into the per-layer, per-expert halves it covers.
The boxes keep viewing the requested tensors' data, so the load still writes in place; nothing is
renamed in the caller's state dict. Requests of a shape the saved tensor cannot hold fail naming
both keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from bcp_core.errors import ShapeMismatchError
from bcp_core.metadata import CheckpointMetadata, TensorMeta
from bcp_core.shards import Box, ObjectShard, ShardedView

_CHAIN = re.compile(r"chained_\d+\.")
_LAYERS = "decoder.layers."
_EXPERTS = ".experts.experts."
_HALVES = ("_w", "_v")  # the gate and up halves of a SwiGLU linear_fc1 (weight_w, bias_v...)


@dataclass(frozen=True)
class _Name:
    """A Megatron key taken apart: `canon` is the key without its chain prefix, layer and expert indices
    and half suffix; `layer` / `expert` None where the tensor has that axis (or no such part)."""

    key: str
    canon: str
    layers: bool           # the key names a decoder layer's tensor
    layer: int | None
    experts: bool          # ... of an expert
    expert: int | None
    half: int | None       # 0: gate half (_w), 1: up half (_v), None: whole

    @property
    def axes(self) -> int:
        """Leading axes before the parameter's own: the layer's and the expert's, where stacked."""
        return (self.layers and self.layer is None) + (self.experts and self.expert is None)


def _index_after(text: str, marker: str) -> tuple[str, bool, int | None]:
    """`text` with the number after `marker` removed; whether `marker` is there; that number."""
    at = text.find(marker)
    if at < 0:
        return text, False, None
    head, rest = text[:at + len(marker)], text[at + len(marker):]
    number, dot, tail = rest.partition(".")
    if number.isdigit() and dot:
        return head + tail, True, int(number)
    return text, True, None


def parse(key: str) -> _Name:
    chain = _CHAIN.match(key)
    rest = key[chain.end():] if chain else key
    half = None
    for h, suffix in enumerate(_HALVES):
        if rest.endswith(("weight" + suffix, "bias" + suffix)):
            half, rest = h, rest[:-len(suffix)]
    rest, layers, layer = _index_after(rest, _LAYERS)
    rest, experts, expert = _index_after(rest, _EXPERTS)
    return _Name(key, rest, layers, layer, experts, expert, half)


def saved_tensors(keys, md: CheckpointMetadata) -> dict[str, TensorMeta]:
    """The checkpoint's tensors by name, each requested key in `keys` that the checkpoint holds only behind
    another optimizer's `chained_<n>.` prefix (or without one) included under the requested name: what a
    requested tensor's saved shape and dtype are (padded vocabularies load with allow_shape_mismatch)."""
    out = dict(md.tensors)
    bare: dict[str, str] = {}
    for key in md.tensors:
        found = _CHAIN.match(key)
        bare[key[found.end():] if found else key] = key
    for key in keys:
        if key not in out:
            found = _CHAIN.match(key)
            saved = bare.get(key[found.end():] if found else key)
            if saved is not None:
                out[key] = md.tensors[saved]
    return out


def saved_dtypes(keys, md: CheckpointMetadata) -> dict[str, torch.dtype]:
    """The saved dtype of each requested key in `keys`: its own tensor's (`saved_tensors`), or, for a key
    the checkpoint holds only under the names of another layout (`to_saved_layout`), theirs where they
    agree. A load reads in the saved dtype and casts into place (adapter.load_state)."""
    by_name: dict[str, set] = {}
    for key, tm in md.tensors.items():
        by_name.setdefault(parse(key).canon, set()).add(tm.dtype)
    out = {}
    for key in keys:
        dtypes = by_name.get(parse(key).canon, set())
        if len(dtypes) == 1:
            out[key] = next(iter(dtypes))
    out.update((key, tm.dtype) for key, tm in saved_tensors(keys, md).items() if key in keys)
    return out


def to_saved_layout(state: dict[str, Any], md: CheckpointMetadata) -> dict[str, Any]:
    """`state` (flat bcp state of a Megatron load: ShardedViews, ObjectShards, values) with every key the
    checkpoint `md` lacks but holds in another layout moved there (module doc)."""
    missing = [k for k, v in state.items() if k not in md.tensors and k not in md.sharded_objects and
               isinstance(v, (ShardedView, ObjectShard))]
    if not missing:
        return state
    tensors: dict[str, list[_Name]] = {}
    for key in md.tensors:
        tensors.setdefault(parse(key).canon, []).append(parse(key))
    objects: dict[str, list[_Name]] = {}
    for key in md.sharded_objects:  # Megatron's unique keys: <key>/shard_<index>_<grid>
        name = parse(key.partition("/shard_")[0])
        objects.setdefault(name.canon, []).append(replace(name, key=key))
    out = dict(state)
    moved: dict[str, list[Box]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for key in missing:
        v = state[key]
        if isinstance(v, ShardedView):
            name = parse(key)
            boxes = _tensor_boxes(name, v, tensors.get(name.canon, []), md)
            if boxes is not None:
                del out[key]
                for saved_key, box in boxes:
                    moved.setdefault(saved_key, []).append(box)
                    dtypes[saved_key] = v.dtype
        else:
            name = parse(key.partition("/shard_")[0])
            found = _object_shard(name, v, objects.get(name.canon, []), md)
            if found is not None:
                del out[key]
                out[found] = v
    for saved_key, boxes in moved.items():
        if saved_key in state:  # requested under both names: the boxes of both
            boxes = list(state[saved_key].boxes) + boxes
        out[saved_key] = ShardedView(tuple(md.tensors[saved_key].shape), dtypes[saved_key], boxes)
    return out


def _pick(saved: list[_Name], layer: int | None, expert: int | None, half: int | None) -> _Name | None:
    for s in saved:
        if (s.layer is None or s.layer == layer) and (s.expert is None or s.expert == expert) and s.half == half:
            return s
    return None


def _tensor_boxes(name: _Name, view: ShardedView, saved: list[_Name], md: CheckpointMetadata):
    """[(saved key, box)] holding `view`'s boxes in the saved layout, or None if the checkpoint lacks
    some of them under every name (the load then reports the requested key missing)."""
    if not saved:
        return None
    out = []
    base_shape = view.shape[name.axes:]
    for box in view.boxes:
        for layer, expert, off, ln, data in _elements(name, box):
            for half, h_off, h_ln, h_data in _halves(name, base_shape, off, ln, data, saved, md):
                s = _pick(saved, layer, expert, half)
                if s is None:
                    return None
                shape = tuple(md.tensors[s.key].shape)
                lead = ([layer] if s.layers and s.layer is None else []) + \
                    ([expert] if s.experts and s.expert is None else [])
                want = _base_shape(name, base_shape, s)
                if shape[s.axes:] != want or any(i >= n for i, n in zip(lead, shape)):
                    raise ShapeMismatchError(
                        f"{name.key!r} of shape {view.shape} (layer {layer}, expert {expert}) is saved as {s.key!r} "
                        f"of shape {shape}, which does not hold it")
                for _ in lead:
                    h_data = h_data.unsqueeze(0)
                out.append((s.key, Box(tuple(lead) + h_off, (1,) * len(lead) + h_ln, h_data)))
    return out


def _elements(name: _Name, box: Box):
    """(layer, expert, offsets, lengths, data) of each layer and expert a requested box covers, on the
    parameter's own axes."""
    layers = range(box.offsets[0], box.offsets[0] + box.lengths[0]) if name.layers and name.layer is None \
        else [name.layer]
    a = 1 if name.layers and name.layer is None else 0
    for i, layer in enumerate(layers):
        data = box.view.select(0, i) if a else box.view
        experts = range(box.offsets[a], box.offsets[a] + box.lengths[a]) if name.experts and name.expert is None \
            else [name.expert]
        b = a + (1 if name.experts and name.expert is None else 0)
        for j, expert in enumerate(experts):
            yield layer, expert, tuple(box.offsets[b:]), tuple(box.lengths[b:]), data.select(0, j) if b > a else data


def _halves(name: _Name, base_shape, off, ln, data, saved: list[_Name], md: CheckpointMetadata):
    """The requested rows as the saved tensor holds them: (half, offsets, lengths, data) — a requested
    half inside a whole [gate; up] tensor, or a requested whole split into its saved halves."""
    saved_halves = any(s.half is not None for s in saved)
    if name.half is not None and not saved_halves:
        rows = base_shape[0]
        return [(None, (off[0] + name.half * rows, *off[1:]), ln, data)]
    if name.half is None and saved_halves:
        half_rows = _half_rows(saved, md)
        out = []
        for h in (0, 1):
            lo, hi = max(off[0], h * half_rows), min(off[0] + ln[0], (h + 1) * half_rows)
            if lo < hi:
                out.append((h, (lo - h * half_rows, *off[1:]), (hi - lo, *ln[1:]),
                            data.narrow(0, lo - off[0], hi - lo)))
        return out
    return [(name.half, off, ln, data)]


def _half_rows(saved: list[_Name], md: CheckpointMetadata) -> int:
    s = next(s for s in saved if s.half is not None)
    return md.tensors[s.key].shape[s.axes]


def _base_shape(name: _Name, base_shape, s: _Name) -> tuple:
    """The shape the saved tensor's own axes must have to hold the requested tensor."""
    if name.half is not None and s.half is None:
        return (2 * base_shape[0], *base_shape[1:])
    if name.half is None and s.half is not None:
        return (base_shape[0] // 2, *base_shape[1:])
    return tuple(base_shape)


def _object_shard(name: _Name, shard: ObjectShard, saved: list[_Name], md: CheckpointMetadata) -> str | None:
    """The unique key of the saved shard holding the requested one (its index and grid are set to that
    shard's), or None."""
    if not saved or shard.index is None:
        return None
    # Megatron places an object on the grid of its stacked axes; with none, it is shard (0,) of a grid (1,)
    index = list(shard.index) if name.axes else []
    layer = index.pop(0) if name.layers and name.layer is None else name.layer
    expert = index.pop(0) if name.experts and name.expert is None else name.expert
    for s in saved:
        if (s.layer is None or s.layer == layer) and (s.expert is None or s.expert == expert):
            want = tuple(([layer] if s.layers and s.layer is None else []) +
                         ([expert] if s.experts and s.expert is None else []) + index) or (0,)
            meta = md.sharded_objects[s.key]
            if any(tuple(p.index) == want for p in meta.shards):
                shard.index, shard.grid = want, tuple(meta.grid)
                return s.key
    return None
