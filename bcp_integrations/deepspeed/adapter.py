"""DeepSpeed adapter: ZeRO stage 1, 2 and 3 state as boxes of each parameter's global shape.

ZeRO keeps the trained values in flat fp32 partitions, one per parameter group (stage 1/2) or
sub-group (stage 3) and rank, and the inner torch optimizer's state (Adam's `exp_avg`,
`exp_avg_sq`) as flat tensors of the same length. A parameter's share on this rank is a run of its
row-major elements at some offset of such a flat partition, usually not an n-D box. As for FSDP1
(paper §4.4) each run is decomposed into at most 2*ndim - 1 boxes of the parameter's shape, each a
slice of the flat partition: saving reads only this rank's partition and communicates nothing
beyond planning, and the checkpoint is keyed by parameter FQN like every other layout's, so it
loads into ZeRO at any stage and world size, FSDP1/FSDP2/DDP or a plain model, and back.

Where a run lives, read from what DeepSpeed keeps on each parameter:

* stage 1/2 (and the bf16 optimizer): `param._hp_mapping`, a fragment of the parameter's flattened
  elements (`lp_fragment_address`) at an offset of its group's fp32 partition
  (`hp_fragment_address`); None where this rank holds none of it;
* stage 3: `optimizer.grad_position[param id]` = (sub-group, offset in the sub-group's fp32
  partition, partition length): rank r of the parameter's partition group holds its elements
  [r*length, (r+1)*length), the last rank's padded.

Mixed precision: the fp32 master weights are the saved parameter values; after a load the
low-precision copies follow from them (`after_module_load`). Parameters outside the optimizer
(frozen) are saved from what the module holds: the parameter itself (stage 1/2), its partition
`ds_tensor` (stage 3). Buffers are ordinary replicated tensors.

DeepSpeed internals are read here only; nothing in DeepSpeed is patched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bcp_core.adapters import ModuleAdapter, check_distinct_fqns, clean_fqn, register_adapter, unwrap
from bcp_core.errors import BCPError, ShapeMismatchError, UnsupportedValueError
from bcp_core.flatten import LoadTarget, LoadTargets
from bcp_core.metadata import CheckpointMetadata
from bcp_core.shards import Box, ShardedView, range_boxes
from bcp_core.utils import this_rank

from .engine import EngineCounters, is_engine, is_zero, zero_optimizer_of

# DeepSpeed versions whose ZeRO internals this adapter was written against and tested with.
TESTED_DEEPSPEED = ((0, 16), (0, 19))


def module_of(model: nn.Module) -> nn.Module:
    """The user's module under a DeepSpeed engine (and DDP / torch.compile wrappers)."""
    while is_engine(model):
        model = model.module
    return unwrap(model)


# ----------------------------------------------------------------------------- where runs live

@dataclass(frozen=True)
class Run:
    """This rank's share of one parameter: its flattened elements [start, start + numel), held at
    [offset, offset + numel) of flat partition `flat` (numel 0: none of it here)."""

    shape: tuple[int, ...]
    start: int
    numel: int
    flat: int
    offset: int

    def view(self, flat: torch.Tensor, stepped: bool = True) -> ShardedView:
        """The boxes of this run, as views of `flat` (the partition or a state tensor shaped like it;
        a master copy of a whole parameter is viewed flat)."""
        flat = flat.view(-1)
        src = flat.narrow(0, self.offset, self.numel) if self.numel else flat[:0]
        boxes = []
        for offs, lens, first in range_boxes(self.shape, self.start, self.start + self.numel):
            n = math.prod(lens)
            boxes.append(Box(offs, lens, src[first - self.start: first - self.start + n].view(lens)))
        return ShardedView(self.shape, flat.dtype, boxes, stepped=stepped)


class ZeroLayout:
    """One ZeRO optimizer's flat fp32 partitions on this rank and where each parameter lives in them.

    `flats[i]` is flat partition i; `group_of[i]` the inner optimizer's param group it belongs to;
    `runs[id(param)]` the run of each trained parameter (keyed by the model parameter's id).
    """

    def __init__(self, opt):
        self.opt = opt
        self.stage3 = hasattr(opt, "fp32_partitioned_groups_flat")
        if getattr(opt, "swap_optimizer", False) or getattr(opt, "params_in_nvme_and_cpu", False):
            raise BCPError("bcp's DeepSpeed adapter does not read ZeRO-Infinity's NVMe-offloaded state; "
                           "offload the optimizer to the CPU (\"offload_optimizer\": {\"device\": \"cpu\"}) or keep "
                           "it on the device")
        self.runs: dict[int, Run] = {}
        self.params: dict[int, nn.Parameter] = {}
        if self.stage3:
            self.flats = list(opt.fp32_partitioned_groups_flat)
            self.group_of = [opt.sub_group_to_group_id[i] for i in range(len(self.flats))]
            for group in opt.fp16_groups:
                for p in group:
                    sub, offset, length = opt.grad_position[opt.get_param_id(p)]
                    start = opt._get_param_partition_rank(p) * length
                    numel = max(0, min(length, p.ds_numel - start))
                    self._add(p, Run(tuple(p.ds_shape), start, numel, sub, offset))
        elif hasattr(opt, "fp32_groups_flat"):  # FP16_Optimizer without ZeRO: one whole flat per group
            self.flats = list(opt.fp32_groups_flat)
            self.group_of = list(range(len(self.flats)))
            for i, group in enumerate(opt.fp16_groups):
                offset = 0
                for p in group:
                    self._add(p, Run(tuple(p.shape), 0, p.numel(), i, offset))
                    offset += p.numel()
        elif hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer without ZeRO: a master copy per parameter
            self.flats, self.group_of = [], []
            for i, (lps, hps) in enumerate(zip(opt.fp16_groups, opt.fp32_groups)):
                for p, hp in zip(lps, hps):
                    self._add(p, Run(tuple(p.shape), 0, p.numel(), len(self.flats), 0))
                    self.flats.append(hp)
                    self.group_of.append(i)
        else:  # stages 1 and 2, and the bf16 optimizer: DeepSpeed's fragment of each parameter
            groups = getattr(opt, "bit16_groups", None)
            self.flats = list(getattr(opt, "single_partition_of_fp32_groups", None) or [])
            if groups is None:  # BF16_Optimizer (stage 0 with bf16)
                groups, self.flats = opt.bf16_groups, list(opt.fp32_groups_flat_partition)
            self.group_of = list(range(len(self.flats)))
            for i, group in enumerate(groups):
                for p in group:
                    m = getattr(p, "_hp_mapping", None)
                    if m is None:
                        self._add(p, Run(tuple(p.shape), 0, 0, i, 0))
                        continue
                    lp, hp = m.lp_fragment_address, m.hp_fragment_address
                    if lp.numel != hp.numel:
                        raise BCPError(f"DeepSpeed fragment of a parameter of shape {tuple(p.shape)} has "
                                       f"{lp.numel} low-precision and {hp.numel} fp32 elements")
                    self._add(p, Run(tuple(p.shape), lp.start, lp.numel, i, hp.start))

    def _add(self, p: nn.Parameter, run: Run) -> None:
        self.runs[id(p)] = run
        self.params[id(p)] = p

    def state(self, flat: int) -> dict:
        """The inner optimizer's state of flat partition `flat` (created on first use, as a step would)."""
        return self.opt.optimizer.state[self.flats[flat]]

    def relink_state(self) -> None:
        """Point DeepSpeed's per-parameter views of the optimizer state (`_hp_mapping.optim_fragment`,
        read by `safe_get_full_optimizer_state`) at the state tensors now held, as its first step does."""
        if hasattr(self.opt, "_hp_optimizer_states_linked"):
            self.opt._hp_optimizer_states_linked = False
            self.opt._lazy_init_hp_params_optimizer_state()

    @property
    def param_groups(self) -> list[dict]:
        return self.opt.optimizer.param_groups

    def refresh_low_precision(self) -> None:
        """Make the model's working copies equal to the fp32 partitions (after a load wrote them):
        what DeepSpeed does after an optimizer step (stage 1/2 all-gather over each group's
        data-parallel group; stage 3 keeps partitions and re-gathers only persistent parameters)."""
        opt = self.opt
        if self.stage3:
            for sub in range(len(self.flats)):
                opt._reassign_or_swap_out_partitioned_parameters(sub)
            persistent = getattr(opt, "persistent_parameters", None) or []
            if persistent:
                persistent[0].partition(persistent)
                persistent[0].all_gather(persistent)
        elif hasattr(opt, "fp32_groups_flat"):  # the parameters are views of the low-precision flats
            for lp, hp in zip(opt.fp16_groups_flat, opt.fp32_groups_flat):
                lp.data.copy_(hp.data)
        elif hasattr(opt, "fp32_groups"):
            for pid, run in self.runs.items():
                self.params[pid].data.copy_(self.flats[run.flat].data)
        else:
            opt.update_lp_params()


def layout_of(opt) -> ZeroLayout:
    """Where each parameter of `opt` lives, read afresh (a DeepSpeed load relinks the fragments)."""
    return ZeroLayout(opt)


# ----------------------------------------------------------------------------- the adapter

class DeepSpeedAdapter(ModuleAdapter):
    """`framework="deepspeed"`: a DeepSpeed engine (or the module a ZeRO-3 engine trains) and its ZeRO
    optimizer (or its bf16 / fp16 optimizer without ZeRO: master copies, laid out as whole runs)."""

    name = "deepspeed"
    loads_together = True  # the low-precision copies are re-gathered over the data-parallel group

    def matches(self, module: nn.Module) -> bool:
        return is_engine(module) or zero_optimizer_of(module) is not None or _trained_by_zero(module)

    def is_optimizer(self, obj: Any) -> bool:
        return isinstance(obj, torch.optim.Optimizer) or is_zero(obj)

    # -- model -----------------------------------------------------------------------------------

    def module_state(self, module: nn.Module) -> dict[str, Any]:
        root = module_of(module)
        opt = zero_optimizer_of(module)
        if opt is None:
            if any(hasattr(p, "ds_id") for p in root.parameters()):
                raise BCPError("a ZeRO-3 partitioned model without its optimizer: pass the DeepSpeed engine "
                               "(state={'model': engine, ...}) so that bcp finds the partitions")
            if _trained_by_zero(root):
                # ZeRO-1/2 (without offload) and the bf16 optimizer leave no way from the model to
                # them: its parameters alone are the working copies, not the fp32 values trained
                raise BCPError("a model trained by DeepSpeed's ZeRO-1/2 or bf16 optimizer, without its engine: "
                               "pass the DeepSpeed engine (state={'model': engine, ...}) so that bcp saves the "
                               "fp32 master weights the optimizer holds and, after a load, makes the model's "
                               "working copies follow them")
            return super().module_state(root)
        layout = layout_of(opt)
        out: dict[str, Any] = {}
        for name, p in root.named_parameters(remove_duplicate=False):
            fqn = clean_fqn(name)
            run = layout.runs.get(id(p))
            if run is not None:
                out[fqn] = run.view(layout.flats[run.flat])
            elif hasattr(p, "ds_tensor"):  # stage 3, not trained: its own partition
                out[fqn] = _partition_run(p, layout.opt).view(p.ds_tensor.view(-1), stepped=False)
            else:
                out[fqn] = p
        for name, b in _persistent_buffers(root):
            out[name] = b
        return out

    def root(self, module: nn.Module) -> nn.Module:
        return module_of(module)

    def param_fqns(self, module: nn.Module) -> dict[int, str]:
        out: dict[int, str] = {}
        for name, p in module_of(module).named_parameters():
            out.setdefault(id(p), clean_fqn(name))
        return out

    def load_module_values(self, module: nn.Module, values: dict[str, Any]) -> None:
        module_of(module).load_state_dict(values, strict=False)

    def after_module_load(self, module: nn.Module) -> None:
        opt = zero_optimizer_of(module)
        if opt is not None:
            layout_of(opt).refresh_low_precision()

    def companions(self, module: nn.Module) -> dict[str, Any]:
        if not is_engine(module):
            return {}
        return {"engine": EngineCounters(module)}

    # -- optimizer: save -------------------------------------------------------------------------

    def optimizer_state(self, opt, key: str, fqn_of: dict[int, str]) -> dict[str, Any]:
        zero = zero_optimizer_of(opt)
        if zero is None:
            return super().optimizer_state(_torch_optimizer(opt, key), key, fqn_of)
        layout = layout_of(zero)
        names = _names(layout, key, fqn_of)
        out: dict[str, Any] = {}
        for pid, run in layout.runs.items():
            if not run.numel:
                continue  # the ranks holding its elements save its state
            for sname, v in layout.state(run.flat).items():
                k = f"state.{names[pid]}.{sname}"
                if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == layout.flats[run.flat].shape:
                    out[k] = run.view(v)
                elif not isinstance(v, torch.Tensor) or v.dim() == 0:
                    out[k] = v  # one value per flat partition (Adam's step): every parameter in it has it
                else:
                    raise BCPError(f"optimizer {key!r}: state {sname!r} of ZeRO partition {run.flat} (rank "
                                   f"{this_rank()}) has shape {tuple(v.shape)}, neither the partition's "
                                   f"{tuple(layout.flats[run.flat].shape)} nor a scalar")
        out["param_groups"] = [{**{k: v for k, v in g.items() if k != "params"}, "params": fqns}
                               for g, fqns in zip(layout.param_groups, _group_fqns(layout, names))]
        return out

    # -- optimizer: load -------------------------------------------------------------------------

    def optimizer_targets(self, opt, key: str, fqn_of: dict[int, str], md: CheckpointMetadata,
                          out: LoadTargets) -> None:
        zero = zero_optimizer_of(opt)
        if zero is None:
            return super().optimizer_targets(_torch_optimizer(opt, key), key, fqn_of, md, out)
        layout = layout_of(zero)
        names = _names(layout, key, fqn_of)
        prefix = f"{key}.state."
        saved: dict[str, dict[str, str]] = {}  # param fqn -> state name -> checkpoint key
        for k in sorted(k for k in md.keys() if k.startswith(prefix)):
            fqn, _, sname = k[len(prefix):].rpartition(".")
            saved.setdefault(fqn, {})[sname] = k
        by_flat: dict[int, list[int]] = {}
        for pid, run in layout.runs.items():
            by_flat.setdefault(run.flat, []).append(pid)
        new_state: dict[int, dict[str, Any]] = {}
        for flat, pids in sorted(by_flat.items()):
            new_state[flat] = _flat_targets(out, md, key, layout, flat, pids, names, saved)

        groups_key = f"{key}.param_groups"
        holder: dict[str, Any] = {}
        want = _group_fqns(layout, names)

        def check_groups(groups) -> None:
            if len(groups) != len(want):
                raise BCPError(f"optimizer {key!r}: checkpoint has {len(groups)} param groups, the ZeRO optimizer "
                               f"has {len(want)}")
            for gi, (g, fqns) in enumerate(zip(groups, want)):
                if sorted(g["params"]) != sorted(fqns):
                    raise BCPError(f"optimizer {key!r}: param group {gi} holds {len(fqns)} parameters "
                                   f"{sorted(fqns)[:4]}..., the checkpoint's group holds {len(g['params'])} "
                                   f"{sorted(g['params'])[:4]}...; groups must hold the same FQNs")

        out.targets[groups_key] = LoadTarget(groups_key, False, check=check_groups,
                                             set_value=lambda groups: holder.update(groups=groups))

        def finish():
            for flat, slot in new_state.items():
                state = layout.state(flat)
                for sname, v in slot.items():
                    state[sname] = v
            for g, saved_group in zip(layout.param_groups, holder.get("groups", ())):
                g.update({k: v for k, v in saved_group.items() if k != "params"})
            layout.relink_state()

        out.finishers.append(finish)
        out.checkpoint_defined.append(prefix)


def _torch_optimizer(opt, key: str) -> torch.optim.Optimizer:
    """DeepSpeed in fp32 without ZeRO hands the torch optimizer over (possibly wrapped): the generic path."""
    inner = opt
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise UnsupportedValueError(f"optimizer {key!r}: {type(opt).__name__} is neither one of DeepSpeed's "
                                    "optimizers bcp knows (ZeRO 1/2/3, bf16, fp16) nor a torch optimizer")
    return inner


def _names(layout: ZeroLayout, key: str, fqn_of: dict[int, str]) -> dict[int, str]:
    """Each trained parameter's FQN: from the model in the same state, else the names DeepSpeed keeps."""
    own = getattr(layout.opt, "param_names", None) or {}
    names = {}
    for pid, p in layout.params.items():
        name = fqn_of.get(pid) or own.get(p)
        if name is None:
            raise BCPError(f"optimizer {key!r}: a parameter of shape {layout.runs[pid].shape} belongs to no module "
                           "in the state; put the model (the DeepSpeed engine) in the same state dict")
        names[pid] = clean_fqn(name)
    check_distinct_fqns(key, [(names[pid], run.shape) for pid, run in layout.runs.items()])
    return names


def _group_fqns(layout: ZeroLayout, names: dict[int, str]) -> list[list[str]]:
    """The FQNs of each inner param group, in the order DeepSpeed holds them."""
    groups: list[list[str]] = [[] for _ in layout.param_groups]
    for pid, run in layout.runs.items():
        groups[layout.group_of[run.flat]].append(names[pid])
    return groups


def _flat_targets(out: LoadTargets, md, key: str, layout: ZeroLayout, flat: int, pids: list[int],
                  names: dict[int, str], saved: dict) -> dict[str, Any]:
    """Targets for the optimizer state of one flat partition: views of its state tensors, filled per
    parameter; one scalar per partition (checked equal across its parameters)."""
    slot: dict[str, Any] = {}
    existing = layout.state(flat) if layout.flats[flat] in layout.opt.optimizer.state else {}
    part = layout.flats[flat]
    snames = sorted({s for pid in pids for s in saved.get(names[pid], {})})
    for sname in snames:
        keys = [(pid, saved[names[pid]][sname]) for pid in pids if sname in saved.get(names[pid], {})]
        metas = [md.tensors.get(k) for _, k in keys]
        for (pid, k), tm in zip(keys, metas):
            if tm is not None and tuple(tm.shape) not in ((), layout.runs[pid].shape):
                raise ShapeMismatchError(f"tensor {k!r}: checkpoint has shape {tuple(tm.shape)}, target has "
                                         f"{layout.runs[pid].shape} (or a scalar: one value per ZeRO partition)")
        if metas and all(tm is not None and tuple(tm.shape) == layout.runs[pid].shape
                         for (pid, _), tm in zip(keys, metas)):
            dtype = metas[0].dtype
            cur = existing.get(sname)
            fresh = not (isinstance(cur, torch.Tensor) and cur.shape == part.shape and cur.dtype == dtype)
            target = torch.zeros_like(part, dtype=dtype) if fresh else cur
            slot[sname] = target
            for pid, k in keys:
                out.targets[k] = LoadTarget(k, False, tensor=layout.runs[pid].view(target), fresh=fresh)
        elif all(tm is not None and tuple(tm.shape) == () for tm in metas):
            scalars = [(k, torch.zeros((), dtype=tm.dtype)) for (_, k), tm in zip(keys, metas)]
            for k, t in scalars:
                out.targets[k] = LoadTarget(k, False, tensor=t, fresh=True)
            slot[sname] = _scalar_like(existing.get(sname), scalars[0][1])
            out.checks.append(lambda sname=sname, scalars=scalars, slot=slot: _same_scalars(
                key, flat, sname, scalars, slot))
        elif all(tm is None for tm in metas):
            first = keys[0][1]
            for _, k in keys:
                out.targets[k] = LoadTarget(k, False, set_value=_keep(slot, sname) if k == first else _ignore)
        else:
            kinds = sorted({"value" if tm is None else "scalar" if tm.shape == () else "per element" for tm in metas})
            raise BCPError(f"optimizer {key!r}: state {sname!r} is {' and '.join(kinds)} across the parameters of "
                           f"ZeRO partition {flat} ({keys[0][1]!r}, ...); one partition keeps one kind")
    return slot


def _scalar_like(current: Any, loaded: torch.Tensor) -> Any:
    """A partition's step as the optimizer keeps it: a tensor (torch Adam) or a number (DeepSpeed's)."""
    return loaded if isinstance(current, torch.Tensor) or current is None else _Number(loaded, type(current))


class _Number:
    """A number to be read from a fresh scalar tensor once the load has filled it."""

    def __init__(self, t: torch.Tensor, kind: type):
        self.t, self.kind = t, kind


def _same_scalars(key: str, flat: int, sname: str, scalars: list, slot: dict) -> None:
    first_key, first = scalars[0]
    for k, t in scalars[1:]:
        if not torch.equal(t, first):
            raise BCPError(f"optimizer {key!r}: ZeRO keeps one {sname!r} per partition, but the parameters of "
                           f"partition {flat} have {first.item()} at {first_key!r} and {t.item()} at {k!r}")
    if isinstance(slot.get(sname), _Number):
        n = slot[sname]
        slot[sname] = n.kind(n.t.item())


def _keep(slot: dict, sname: str):
    def setter(v):
        slot[sname] = v
    return setter


def _ignore(_value) -> None:
    return None


def _trained_by_zero(module: nn.Module) -> bool:
    """Whether DeepSpeed's ZeRO or bf16 optimizer trains `module`'s parameters: it marks each of them on
    every rank (stage 3: `ds_id`; stage 1/2 and bf16: `_hp_mapping`, None where the rank holds none of it)."""
    return any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in module.parameters())


def _partition_run(p: nn.Parameter, opt) -> Run:
    """A stage-3 parameter's own partition (`ds_tensor`), for parameters the optimizer does not train."""
    length = p.ds_tensor.numel()
    start = opt._get_param_partition_rank(p) * length
    return Run(tuple(p.ds_shape), start, max(0, min(length, p.ds_numel - start)), 0, 0)


def _persistent_buffers(root: nn.Module):
    for mod_name, m in root.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                yield clean_fqn(f"{mod_name}.{bname}" if mod_name else bname), b


def check_deepspeed_version(version: str | None = None) -> None:
    """Refuse a DeepSpeed whose ZeRO internals this adapter does not know (set BCP_DEEPSPEED_ANY=1
    to try anyway)."""
    import os
    import re
    if version is None:
        import deepspeed
        version = deepspeed.__version__
    m = re.match(r"(\d+)\.(\d+)", version)
    found = (int(m.group(1)), int(m.group(2))) if m else None
    lo, hi = TESTED_DEEPSPEED
    if (found is None or not lo <= found <= hi) and os.environ.get("BCP_DEEPSPEED_ANY") != "1":
        raise BCPError(f"bcp's DeepSpeed adapter reads ZeRO internals and supports DeepSpeed {lo[0]}.{lo[1]} to "
                       f"{hi[0]}.{hi[1]}; this is DeepSpeed {version}. Set BCP_DEEPSPEED_ANY=1 to try anyway")


check_deepspeed_version()
register_adapter(DeepSpeedAdapter())
