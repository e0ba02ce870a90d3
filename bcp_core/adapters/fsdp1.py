"""FSDP1 (`FullyShardedDataParallel`) adapter: save each rank's flat shard without gathering it.

FSDP1 concatenates the parameters of each wrapped unit into one 1-D `FlatParameter`, pads it and
gives every rank a contiguous slice. A rank's slice of an original parameter is therefore a run
of its row-major elements, usually not an n-D box. Following the paper (§4.4, "irregular
tensors"), each such run is decomposed into at most 2*ndim - 1 boxes of the parameter's original
shape (a partial row, a block of whole rows, a partial row, recursively), each a contiguous slice
of the local flat shard. The boxes go to the core as `ShardedView`s keyed by the original FQNs, so
the checkpoint is the same as a plain model's and interoperates with every other layout; saving
needs no collective beyond planning and reads nothing but the local shard. Padding is in no box.

Optimizer state follows the same decomposition: with `use_orig_params=False` the optimizer holds
the FlatParameters and each state tensor is a flat shard; with `use_orig_params=True` it holds the
original parameters, whose local data (and state) is the 1-D run of their elements in this rank's
shard. Scalar state (Adam's `step`) is saved once per original FQN.

FSDP1 keeps this layout in private attributes (`FlatParameter._shard_param_infos`, `_fqns`,
`_shapes`, `_shared_param_infos`, `_local_shard`, `FullyShardedDataParallel._handle`). They are
read only here, after a version check; nothing in torch is patched.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import BCPError
from ..flatten import LoadTarget, LoadTargets
from ..metadata import CheckpointMetadata
from ..shards import Box, ShardedView, range_boxes
from ..utils import this_rank
from . import register_adapter
from .generic import ModuleAdapter, check_distinct_fqns, clean_fqn, unwrap

# Versions whose FSDP1 internals this adapter was written against and tested with.
TESTED_TORCH = ((2, 4), (2, 13))
_VERSION_OVERRIDE = "BCP_FSDP1_ANY_TORCH"  # set to 1 to try an untested torch at your own risk
_REQUIRED_FLAT_ATTRS = ("_shard_param_infos", "_fqns", "_shapes", "_shared_param_infos", "_param_infos")

_checked = False


def check_torch_version(version: str | None = None) -> None:
    """Refuse a torch whose FSDP1 internals this adapter does not know."""
    global _checked
    if _checked and version is None:
        return
    text = version or torch.__version__
    m = re.match(r"(\d+)\.(\d+)", text)
    found = (int(m.group(1)), int(m.group(2))) if m else None
    lo, hi = TESTED_TORCH
    if (found is None or not lo <= found <= hi) and os.environ.get(_VERSION_OVERRIDE) != "1":
        raise BCPError(f"bcp's FSDP1 adapter reads FSDP1 internals and supports torch "
                       f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}; this is torch {text}. Use FSDP2 (fully_shard), "
                       f"or set {_VERSION_OVERRIDE}=1 to try anyway")
    if version is None:
        _checked = True


def _fsdp_class():
    from torch.distributed.fsdp import FullyShardedDataParallel
    return FullyShardedDataParallel


# ----------------------------------------------------------------------------- decomposition


@dataclass(frozen=True)
class _Orig:
    """An original parameter of a FlatParameter and where this rank holds its elements."""

    fqn: str
    shape: tuple[int, ...]
    offset_in_shard: int   # where its local run starts in the rank's flat shard
    start: int             # its flat index of the first local element
    numel: int             # local elements (0: none on this rank)
    aliases: tuple[str, ...]  # FQNs of tied parameters sharing its storage

    def view(self, src: torch.Tensor, dtype: torch.dtype | None = None) -> ShardedView:
        """The boxes of this parameter held in `src`, a 1-D tensor of its local elements in order."""
        boxes = []
        for offs, lens, first in range_boxes(self.shape, self.start, self.start + self.numel):
            n = math.prod(lens)
            boxes.append(Box(offs, lens, src[first - self.start: first - self.start + n].view(lens)))
        return ShardedView(self.shape, dtype or src.dtype, boxes)


class _Name(str):
    """A parameter's name in the core's id -> FQN map, carrying where its elements live.

    For an original parameter (use_orig_params=True) it is the FQN and `origs` holds its one
    `_Orig`; for a FlatParameter it is the FSDP unit's name and `origs` lists every original
    parameter flattened into it. Being a str, it passes through the core's maps unchanged.
    """

    origs: tuple[_Orig, ...]
    flat: bool

    @classmethod
    def make(cls, text: str, origs, flat: bool) -> _Name:
        s = cls(text)
        s.origs = tuple(origs)
        s.flat = flat
        return s


def _join(*parts: str) -> str:
    return clean_fqn(".".join(p for p in parts if p))


@dataclass
class _Unit:
    prefix: str
    handle: Any
    flat: nn.Parameter
    origs: list[_Orig]


def _units(root: nn.Module) -> list[_Unit]:
    """Every FSDP1 unit under `root`, with its original parameters' local placement."""
    check_torch_version()
    fsdp_cls = _fsdp_class()
    units = []
    for name, m in root.named_modules():
        if not isinstance(m, fsdp_cls):
            continue
        handle = getattr(m, "_handle", None)
        if handle is None:  # a unit with no parameters of its own
            continue
        flat = handle.flat_param
        missing = [a for a in _REQUIRED_FLAT_ATTRS if not hasattr(flat, a)]
        if missing:
            raise BCPError(f"FSDP1 unit {clean_fqn(name) or '<root>'}: FlatParameter lacks {missing}; this torch "
                           f"({torch.__version__}) changed FSDP1 internals that bcp's adapter reads")
        if handle.uses_sharded_strategy and not handle.is_sharded(flat):
            raise BCPError(f"FSDP1 unit {clean_fqn(name) or '<root>'} (rank {this_rank()}) holds unsharded "
                           "parameters (inside summon_full_params, or after a forward with no backward under "
                           "SHARD_GRAD_OP); bcp saves and loads the sharded flat parameter, so leave that "
                           "context or run backward first")
        prefix = clean_fqn(name)
        aliases: dict[str, list[str]] = {}
        for spi in flat._shared_param_infos:
            prim = _join(prefix, spi.prim_module_name, spi.prim_param_name)
            aliases.setdefault(prim, []).append(_join(prefix, spi.module_name, spi.param_name))
        origs = []
        for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
            full = _join(prefix, fqn)
            if info.in_shard:
                o = _Orig(full, tuple(shape), info.offset_in_shard, info.intra_param_start_idx,
                          info.numel_in_shard, tuple(aliases.get(full, ())))
            else:
                o = _Orig(full, tuple(shape), 0, 0, 0, tuple(aliases.get(full, ())))
            origs.append(o)
        units.append(_Unit(prefix, handle, flat, origs))
    return units


def _local_shard(flat: nn.Parameter) -> torch.Tensor:
    """This rank's padded flat shard in full precision.

    FSDP creates `_local_shard` at its lazy initialisation (first forward) as the sharded data, and
    keeps it also when parameters are offloaded to CPU or computed in lower precision. Before that
    the FlatParameter itself holds the sharded data.
    """
    shard = getattr(flat, "_local_shard", None)
    return shard if shard is not None else flat.data


# ----------------------------------------------------------------------------- adapter

class FSDP1Adapter(ModuleAdapter):
    name = "fsdp1"

    def matches(self, module: nn.Module) -> bool:
        fsdp_cls = _fsdp_class()
        return any(isinstance(m, fsdp_cls) for m in module.modules())

    # -- model -----------------------------------------------------------------------------------

    def module_state(self, module: nn.Module) -> dict[str, Any]:
        root = unwrap(module)
        units = _units(root)
        out: dict[str, Any] = {}
        managed: set[int] = set()
        for u in units:
            managed.add(id(u.flat))
            if u.flat._params is not None:  # use_orig_params=True: the originals are registered params
                managed.update(id(p) for p in u.flat._params)
                managed.update(id(p) for p in u.flat._shared_params)
            shard = _local_shard(u.flat)
            for o in u.origs:
                sv = o.view(shard[o.offset_in_shard: o.offset_in_shard + o.numel])
                for fqn in (o.fqn, *o.aliases):
                    out[fqn] = sv
        # Parameters FSDP does not manage (ignored modules/states) and buffers are ordinary,
        # replicated tensors. State-dict hooks are not run: FSDP1's would all-gather.
        for mod_name, m in root.named_modules(remove_duplicate=False):
            if type(m).get_extra_state is not nn.Module.get_extra_state:
                raise BCPError(f"module {clean_fqn(mod_name) or '<root>'} ({type(m).__name__}) defines "
                               "get_extra_state(), which bcp's FSDP1 adapter does not save; save that "
                               "value separately in the state dict")
            for pname, p in m._parameters.items():
                if p is not None and id(p) not in managed:
                    out.setdefault(_join(mod_name, pname), p)
            for bname, b in m._buffers.items():
                if b is not None and bname not in m._non_persistent_buffers_set:
                    out.setdefault(_join(mod_name, bname), b)
        return out

    def param_fqns(self, module: nn.Module) -> dict[int, str]:
        root = unwrap(module)
        out: dict[int, str] = {}
        for u in _units(root):
            out[id(u.flat)] = _Name.make(_join(u.prefix, "_flat_param") or "_flat_param", u.origs, flat=True)
            if u.flat._params is not None:
                for p, o in zip(u.flat._params, u.origs):
                    out[id(p)] = _Name.make(o.fqn, (o,), flat=False)
        for name, p in root.named_parameters():
            out.setdefault(id(p), clean_fqn(name))
        return out

    # -- optimizer: save -------------------------------------------------------------------------

    def optimizer_state(self, opt: torch.optim.Optimizer, key: str, fqn_of: dict[int, str]) -> dict[str, Any]:
        params, names = _opt_params(opt, key, fqn_of)
        osd = opt.state_dict()
        out: dict[str, Any] = {}
        for i, (p, name) in enumerate(zip(params, names)):
            st = osd["state"].get(i)
            if not st:
                continue
            if not isinstance(name, _Name):
                for sname, v in st.items():
                    out[f"state.{name}.{sname}"] = v
            elif name.flat:
                _flat_state_leaves(out, key, name, st, _local_shard(p).shape)
            else:
                _orig_state_leaves(out, key, name.origs[0], st)
        groups = []
        for g in osd["param_groups"]:
            g = dict(g)
            g["params"] = [f for i in g["params"] for f in _expand(names[i])]
            groups.append(g)
        out["param_groups"] = groups
        return out

    # -- optimizer: load -------------------------------------------------------------------------

    def optimizer_targets(self, opt, key: str, fqn_of: dict[int, str], md: CheckpointMetadata,
                          out: LoadTargets) -> None:
        params, names = _opt_params(opt, key, fqn_of)
        osd = opt.state_dict()
        prefix = f"{key}.state."
        saved: dict[str, dict[str, str]] = {}  # param fqn -> state name -> checkpoint key
        for k in sorted(k for k in md.keys() if k.startswith(prefix)):
            fqn, _, sname = k[len(prefix):].rpartition(".")
            saved.setdefault(fqn, {})[sname] = k
        new_state: dict[int, dict[str, Any]] = {}
        for i, (p, name) in enumerate(zip(params, names)):
            existing = osd["state"].get(i, {})
            if isinstance(name, _Name) and name.flat:
                slot = _flat_targets(out, md, key, name, saved, existing, _local_shard(p))
            elif isinstance(name, _Name):
                slot = _orig_targets(out, md, name.origs[0], saved, existing, p)
            else:
                slot = _plain_targets(out, md, saved.get(name, {}), existing, p)
            if slot:
                new_state[i] = slot

        groups_key = f"{key}.param_groups"
        holder: dict[str, Any] = {}

        def optimizer_groups(groups) -> list[dict]:
            """The checkpoint's param groups with the optimizer's parameter indices; raises if they do
            not hold the same parameters (checked before the load changes anything)."""
            cur = opt.param_groups
            if len(groups) != len(cur):
                raise BCPError(f"optimizer {key!r}: checkpoint has {len(groups)} param groups, optimizer has "
                               f"{len(cur)}")
            index_of = {id(p): i for i, p in enumerate(params)}
            result = []
            for gi, (g, c) in enumerate(zip(groups, cur)):
                want = [f for p in c["params"] for f in _expand(names[index_of[id(p)]])]
                if sorted(g["params"]) != sorted(want):
                    raise BCPError(f"optimizer {key!r}: param group {gi} holds parameters {sorted(want)[:5]}..., "
                                   f"the checkpoint's group holds {sorted(g['params'])[:5]}...; groups must "
                                   "hold the same FQNs")
                result.append({**g, "params": [index_of[id(p)] for p in c["params"]]})
            return result

        out.targets[groups_key] = LoadTarget(groups_key, False, check=optimizer_groups,
                                             set_value=lambda groups: holder.update(groups=optimizer_groups(groups)))

        def finish():
            groups = holder.get("groups")
            if groups is None:  # not in the checkpoint (strict=False): keep the current hyperparameters
                index_of = {id(p): i for i, p in enumerate(params)}
                groups = [{**{k: v for k, v in g.items() if k != "params"},
                           "params": [index_of[id(p)] for p in g["params"]]} for g in opt.param_groups]
            opt.load_state_dict({"state": dict(sorted(new_state.items())), "param_groups": groups})

        out.finishers.append(finish)
        out.checkpoint_defined.append(prefix)


def _opt_params(opt, key: str, fqn_of: dict[int, str]) -> tuple[list, list]:
    params = [p for g in opt.param_groups for p in g["params"]]
    names = []
    for i, p in enumerate(params):
        if id(p) not in fqn_of:
            raise BCPError(f"optimizer {key!r}: parameter #{i} (shape {tuple(p.shape)}) belongs to no "
                           "nn.Module in the state; put the model in the same state dict")
        names.append(fqn_of[id(p)])
    named = []  # the checkpoint's FQNs of the optimizer's parameters (a flat parameter's originals)
    for p, name in zip(params, names):
        if isinstance(name, _Name):
            named += [(o.fqn, o.shape) for o in name.origs]
        else:
            named.append((name, tuple(p.shape)))
    check_distinct_fqns(key, named)
    return params, names


def _expand(name: str) -> list[str]:
    """The checkpoint FQNs an optimizer parameter stands for."""
    if isinstance(name, _Name) and name.flat:
        return [o.fqn for o in name.origs]
    return [str(name)]


def _flat_state_leaves(out: dict, key: str, name: _Name, st: dict, shard_shape) -> None:
    for sname, v in st.items():
        if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(shard_shape):
            for o in name.origs:
                out[f"state.{o.fqn}.{sname}"] = o.view(v[o.offset_in_shard: o.offset_in_shard + o.numel])
        elif isinstance(v, torch.Tensor) and v.dim() == 0 or not isinstance(v, torch.Tensor):
            for o in name.origs:  # one value for the whole unit: every original parameter has it
                out[f"state.{o.fqn}.{sname}"] = v
        else:
            raise BCPError(f"optimizer {key!r}: state {sname!r} of FSDP1 unit {str(name)!r} (rank {this_rank()}) has "
                           f"shape {tuple(v.shape)}, neither the flat shard's {tuple(shard_shape)} nor a "
                           "scalar, so it cannot be mapped onto the original parameters")


def _orig_state_leaves(out: dict, key: str, o: _Orig, st: dict) -> None:
    if o.numel == 0:
        # None of its elements live here; FSDP gives it no gradient, so any state is not this
        # rank's to save (the ranks holding its elements save it).
        return
    for sname, v in st.items():
        k = f"state.{o.fqn}.{sname}"
        if _is_local_state(v, o):
            out[k] = o.view(v.view(-1))
        elif isinstance(v, torch.Tensor) and v.dim() == 0 or not isinstance(v, torch.Tensor):
            out[k] = v
        else:
            raise BCPError(f"optimizer {key!r}: state {sname!r} of {o.fqn!r} (rank {this_rank()}) has shape "
                           f"{tuple(v.shape)}, neither per element of its {o.numel} local elements nor a scalar")


def _is_local_state(v, o: _Orig) -> bool:
    """Whether optimizer state `v` is per element of the parameter's local data.

    Sharded, that data is the 1-D run of its elements; unsharded (NO_SHARD, or HYBRID_SHARD with
    one rank per shard) FSDP gives the parameter its original shape.
    """
    return (isinstance(v, torch.Tensor) and v.numel() == o.numel
            and (v.dim() == 1 or tuple(v.shape) == o.shape) and v.is_contiguous())


def _keep(slot: dict, sname: str):
    def setter(v):
        slot[sname] = v
    return setter


def _ignore(_value) -> None:
    return None


def _flat_targets(out: LoadTargets, md, key: str, name: _Name, saved: dict, existing: dict,
                  shard: torch.Tensor) -> dict:
    """Targets for a FlatParameter's state: flat tensors shaped like the shard, filled per original."""
    slot: dict[str, Any] = {}
    snames = sorted({s for o in name.origs for s in saved.get(o.fqn, {})})
    for sname in snames:
        keys = [(o, saved[o.fqn][sname]) for o in name.origs if sname in saved.get(o.fqn, {})]
        metas = [md.tensors.get(k) for _, k in keys]
        if all(tm is None for tm in metas):  # plain values: one per unit, take the first
            first = keys[0][1]
            for _, k in keys:
                out.targets[k] = LoadTarget(k, False, set_value=_keep(slot, sname) if k == first else _ignore)
            continue
        if any(tm is None for tm in metas):
            raise BCPError(f"optimizer {key!r}: state {sname!r} is a tensor for some parameters of FSDP1 unit "
                           f"{str(name)!r} and a plain value for others")
        if all(tuple(tm.shape) == o.shape for (o, _), tm in zip(keys, metas)):
            dtypes = {tm.dtype for tm in metas}
            if len(dtypes) != 1:
                raise BCPError(f"optimizer {key!r}: state {sname!r} has dtypes {sorted(map(str, dtypes))} across "
                               f"the parameters of FSDP1 unit {str(name)!r}; one flat tensor holds one dtype")
            dtype = dtypes.pop()
            flat = existing.get(sname)
            fresh = not (isinstance(flat, torch.Tensor) and flat.shape == shard.shape and flat.dtype == dtype)
            if fresh:  # padding and parameters without saved state stay zero
                flat = torch.zeros(shard.shape, dtype=dtype, device=shard.device)
            slot[sname] = flat
            for o, k in keys:
                out.targets[k] = LoadTarget(k, False, tensor=o.view(flat[o.offset_in_shard:
                                                                        o.offset_in_shard + o.numel]), fresh=fresh)
        elif all(tuple(tm.shape) == () for tm in metas):
            scalars = [(k, torch.zeros((), dtype=tm.dtype)) for (_, k), tm in zip(keys, metas)]
            for k, t in scalars:
                out.targets[k] = LoadTarget(k, False, tensor=t, fresh=True)
            slot[sname] = scalars[0][1]
            # the scalars are fresh: read before the load changes anything, checked then
            out.checks.append(lambda sname=sname, scalars=scalars: _same_scalars(key, name, sname, scalars))
        else:
            shapes = {k: tuple(tm.shape) for (_, k), tm in zip(keys, metas)}
            raise BCPError(f"optimizer {key!r}: state {sname!r} of FSDP1 unit {str(name)!r} has shapes {shapes}; "
                           "a flat parameter's state must be per element (the parameter's shape) or one scalar")
    return slot


def _same_scalars(key: str, name: _Name, sname: str, scalars: list) -> None:
    first_key, first = scalars[0]
    for k, t in scalars[1:]:
        if not torch.equal(t, first):
            raise BCPError(f"optimizer {key!r}: FSDP1 unit {str(name)!r} keeps one {sname!r} for all its "
                           f"parameters, but the checkpoint has {first.item()} at {first_key!r} and "
                           f"{t.item()} at {k!r}")


def _orig_targets(out: LoadTargets, md, o: _Orig, saved: dict, existing: dict, param) -> dict:
    """Targets for an original parameter (use_orig_params=True): 1-D state over its local elements."""
    slot: dict[str, Any] = {}
    for sname, k in saved.get(o.fqn, {}).items():
        tm = md.tensors.get(k)
        if o.numel == 0:
            # Nothing of it lives here: read nothing and create no state, as FSDP training would not.
            view = ShardedView(tm.shape, tm.dtype, ()) if tm is not None else None
            out.targets[k] = LoadTarget(k, False, tensor=view, set_value=_ignore)
        elif tm is None:
            out.targets[k] = LoadTarget(k, False, set_value=_keep(slot, sname))
        elif tuple(tm.shape) == o.shape:
            t = existing.get(sname)
            fresh = not (_is_local_state(t, o) and t.dtype == tm.dtype)
            if fresh:
                t = torch.zeros(param.shape, dtype=tm.dtype, device=param.device)  # shaped like its local data
            slot[sname] = t
            out.targets[k] = LoadTarget(k, False, tensor=o.view(t.view(-1)), fresh=fresh)
        elif tuple(tm.shape) == ():
            t = torch.zeros((), dtype=tm.dtype)  # scalars such as Adam's step live on the CPU
            slot[sname] = t
            out.targets[k] = LoadTarget(k, False, tensor=t, fresh=True)
        else:
            raise BCPError(f"optimizer state {k!r} has shape {tuple(tm.shape)}, neither the parameter's "
                           f"{o.shape} nor a scalar")
    return slot


def _plain_targets(out: LoadTargets, md, keys: dict, existing: dict, param) -> dict:
    """Targets for a parameter FSDP does not manage: whole tensors, as for a plain model."""
    slot: dict[str, Any] = {}
    for sname, k in keys.items():
        tm = md.tensors.get(k)
        t = existing.get(sname)
        if tm is None:
            out.targets[k] = LoadTarget(k, False, set_value=_keep(slot, sname))
            continue
        fresh = not (isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(tm.shape) and t.dtype == tm.dtype)
        if fresh:
            device = param.device if tuple(tm.shape) == tuple(param.shape) else "cpu"
            if tuple(tm.shape) != tuple(param.shape):
                out.check_files(k, tm)  # the shape is the metadata's claim until the files back it
            t = torch.zeros(tm.shape, dtype=tm.dtype, device=device)
        slot[sname] = t
        out.targets[k] = LoadTarget(k, False, tensor=t, fresh=fresh)
    return slot


register_adapter(FSDP1Adapter())
