"""DeepSpeed's own ZeRO checkpoints (`engine.save_checkpoint`'s `global_stepN/`) seen as bcp checkpoints.

DeepSpeed writes, per data-parallel rank r, `zero_pp_rank_<r>_mp_rank_00_optim_states.pt` with that
rank's flat fp32 partitions and the inner optimizer's flat state, and a model-states file with the
parameter names and shapes in partition order (`param_shapes`), buffers, the scheduler and the
engine's counters (`mp_rank_00_model_states.pt` for stages 1 and 2, one per rank for stage 3).
Where each parameter's elements sit in the partitions follows from DeepSpeed's layout:

* stages 1/2: a group's parameters lie one after the other in one flat buffer cut into equal
  partitions, one per rank; `param_slice_mappings` gives each parameter's run on each rank (start
  in the rank's partition, length), so its element offset on rank r is the sum of its lengths on
  ranks before r;
* stage 3: each parameter is cut alone into `ceil(numel / W)`-element partitions, rank r holding
  elements [r*p, (r+1)*p), laid one after the other in the rank's flat sub-group buffer in
  `param_shapes` order.

`deepspeed_metadata` turns that into bcp metadata whose pieces are byte ranges of DeepSpeed's files,
keyed like a checkpoint bcp saved from the engine (`model.<name>`, `optimizer.state.<name>.<state>`,
`optimizer.param_groups`, `scheduler.*`, `engine.*`), so `bcp.load` reshards it into any layout.
Building it reads every byte once: through the zip's CRC-checked records, computing bcp's block
checksums, which the load then verifies. No pickle is run (`torch_archive`).
"""

from __future__ import annotations

import math
import re
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import xxhash

from .. import codec
from ..errors import BCPError, MetadataError
from ..metadata import CHECKSUM_BLOCK_BYTES, CheckpointMetadata, ObjectValue, Piece, TensorMeta, element_size
from ..shards import range_boxes
from ..storage import Storage
from .torch_archive import Archive, Opaque, TensorRef, open_archive, record_offset

MODEL_FILE = "mp_rank_00_model_states.pt"
_RANK_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")
# the loss scaler's attributes that change while training (the rest comes from the configuration)
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def step_directory(st: Storage) -> str | None:
    """The directory of `st` (relative; "" for itself) that holds a DeepSpeed checkpoint: `st` itself,
    or the `global_stepN` its `latest` file names. None if neither does.

    `latest` is read as bcp reads its own tracker (the same file name; docs/format.md): the text
    before the first space, line end or NUL of its first 4 KiB. A name that is not one plain
    directory name (control characters, a slash, "." or "..") names no DeepSpeed checkpoint."""
    from ..layout import read_tracker  # layout imports this package

    if _holds_checkpoint(st, ""):
        return ""
    try:
        name = read_tracker(st)
    except (OSError, ValueError, BCPError):
        return None
    if not name or name in (".", "..") or "/" in name or \
            any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        return None
    return name if _holds_checkpoint(st, name) else None


def _holds_checkpoint(st: Storage, rel: str) -> bool:
    """Whether directory `rel` of `st` holds a DeepSpeed model-states file. Anything that cannot be
    listed (missing, not a directory, a name the storage refuses) holds none: detection never raises."""
    try:
        names = st.listdir(rel)
    except (OSError, ValueError, BCPError):
        return False
    return MODEL_FILE in names or any(_RANK_FILE.match(n) and n.endswith("_model_states.pt") for n in names)


# ----------------------------------------------------------------------------- the layout


@dataclass(frozen=True)
class _Run:
    """Elements [start, start + numel) of a parameter, held at element `at` of flat tensor `flat` of rank `rank`."""

    rank: int
    start: int
    numel: int
    at: int


class _Builder:
    def __init__(self, st: Storage, where: str):
        self.st, self.where = st, where
        self.files: list[str] = []
        self.tensors: dict[str, TensorMeta] = {}
        self.objects: dict[str, Any] = {}
        self._file_index: dict[str, int] = {}

    def file(self, relpath: str) -> int:
        if relpath not in self._file_index:
            self._file_index[relpath] = len(self.files)
            self.files.append(relpath)
        return self._file_index[relpath]

    def value(self, key: str, value: Any) -> None:
        self.objects[key] = ObjectValue(codec.encode(_plain(value), key))

    def values(self, prefix: str, d: dict, relpath: str) -> None:
        """A state dict's entries (of file `relpath`) as bcp saves a stateful object's: nested dicts
        flattened by key."""
        for k, v in d.items():
            if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
                self.values(f"{prefix}.{k}", v, relpath)
            elif isinstance(v, TensorRef):
                self.whole(f"{prefix}.{k}", v, relpath, 0)
            else:
                self.value(f"{prefix}.{k}", v)

    def whole(self, key: str, ref: TensorRef, relpath: str, rank: int) -> None:
        """Tensor `key` in one piece: `ref` of file `relpath`."""
        self.tensors[key] = TensorMeta(ref.dtype, ref.shape, (self._piece((0,) * len(ref.shape), ref.shape, relpath,
                                                                          ref.byte_offset, ref.nbytes, rank),))

    def runs(self, key: str, shape: tuple[int, ...], flats: dict[int, tuple[str, TensorRef]], runs: list[_Run]) -> None:
        """Tensor `key` of `shape` from runs of flat tensors (`flats[rank]` = (file, its flat tensor))."""
        if sum(r.numel for r in runs) != math.prod(shape):
            raise MetadataError(f"{self.where}: {key!r} of shape {shape} has {sum(r.numel for r in runs)} elements in "
                                "the partitions")
        dtype = next(iter(flats.values()))[1].dtype
        size = element_size(dtype)
        pieces = []
        for run in runs:
            relpath, flat = flats[run.rank]
            if flat.dtype != dtype or run.at + run.numel > flat.numel:
                raise MetadataError(f"{self.where}: {key!r}: rank {run.rank}'s partition in {relpath} holds "
                                    f"{flat.numel} {flat.dtype} elements, not {run.at + run.numel} {dtype}")
            for offs, lens, first in range_boxes(shape, run.start, run.start + run.numel):
                n = math.prod(lens)
                pieces.append(self._piece(offs, lens, relpath, flat.byte_offset + (run.at + first - run.start) * size,
                                          n * size, run.rank))
        self.tensors[key] = TensorMeta(dtype, tuple(shape), tuple(pieces))

    def _piece(self, offsets, lengths, relpath: str, byte_offset: int, nbytes: int, rank: int) -> Piece:
        return Piece(tuple(offsets), tuple(lengths), self.file(relpath), byte_offset, nbytes, (), rank)


def deepspeed_metadata(st: Storage, block: int = CHECKSUM_BLOCK_BYTES) -> CheckpointMetadata:
    """bcp metadata for the DeepSpeed checkpoint directory `st` (see the module doc)."""
    where = st.root
    names = set(st.listdir(""))
    rank_files = {(int(m.group(1)), int(m.group(2)), m.group(3)): n for n in names if (m := _RANK_FILE.match(n))}
    if any(mp != 0 for _, mp, _ in rank_files) or any(n.startswith("layer_") for n in names):
        raise MetadataError(f"{where}: a DeepSpeed checkpoint with tensor or pipeline parallelism (mp_rank_01, "
                            "layer_*); bcp reads data-parallel ZeRO checkpoints (convert this one with DeepSpeed's "
                            "ds_to_universal.py first)")
    stage3 = (0, 0, "model") in rank_files
    model_file = rank_files[(0, 0, "model")] if stage3 else MODEL_FILE
    if model_file not in names:
        raise MetadataError(f"{where}: no {MODEL_FILE} (nor zero_pp_rank_0_mp_rank_00_model_states.pt)")
    model = open_archive(st, model_file)
    ms = model.obj
    if not isinstance(ms, dict) or "param_shapes" not in ms:
        raise MetadataError(f"{where}/{model_file}: not a DeepSpeed ZeRO model-states file (no param_shapes)")
    with _untrusted(where, [model_file]):
        world = int(ms.get("dp_world_size", 0))
        mp = int(ms.get("mp_world_size", 1))
    if world < 1 or mp != 1:
        raise MetadataError(f"{where}/{model_file}: dp_world_size {ms.get('dp_world_size')!r}, mp_world_size "
                            f"{ms.get('mp_world_size')!r}: bcp reads data-parallel checkpoints")
    optim = {}
    for r in range(world):
        name = rank_files.get((r, 0, "optim"))
        if name is None:
            raise MetadataError(f"{where}: rank {r}'s zero_pp_rank_{r}_mp_rank_00_optim_states.pt is missing "
                                f"(dp_world_size {world}); the checkpoint is incomplete")
        optim[r] = open_archive(st, name)
        osd = optim[r].obj.get("optimizer_state_dict") if isinstance(optim[r].obj, dict) else None
        if not isinstance(osd, dict):
            raise MetadataError(f"{where}/{name}: not a DeepSpeed ZeRO optimizer-states file (no "
                                "optimizer_state_dict)")
    b = _Builder(st, where)
    with _untrusted(where, [model_file, *(a.relpath for a in optim.values())]):
        shapes = [{k: tuple(v) for k, v in group.items()} for group in ms["param_shapes"]]
        if stage3:
            _stage3(b, shapes, optim, world)
        else:
            _stage12(b, shapes, optim)
        _module_rest(b, st, model, ms, stage3, world, rank_files)
        _engine(b, ms, optim[0].obj["optimizer_state_dict"])
        stage = 3 if stage3 else _stage_of(optim[0])
    md = CheckpointMetadata(world_size=world, framework="deepspeed", files=tuple(b.files), tensors=b.tensors,
                            objects=b.objects, per_rank={}, checksum_block_bytes=block,
                            user={"converted_from": "deepspeed", "ds_version": str(ms.get("ds_version", "")),
                                  "zero_stage": stage})
    archives = {a.relpath: a for a in (model, *optim.values())}
    for rel in b.files:
        if rel not in archives:
            archives[rel] = open_archive(st, rel)
    return _with_checksums(md, archives, block, where)


# what reading another system's pickled structures raises where they are not as expected (a key
# missing, a list where a dict was, a string where a number was)
_SHAPE_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError, ArithmeticError, RecursionError,
                 StopIteration)


@contextmanager
def _untrusted(where: str, files: list[str]):
    """Turn an error of reading `files`' contents (`_SHAPE_ERRORS`) into a MetadataError naming them,
    the original as its cause."""
    try:
        yield
    except MetadataError:
        raise
    except _SHAPE_ERRORS as e:
        raise MetadataError(f"{where}: {', '.join(files)}: not laid out as a DeepSpeed ZeRO checkpoint bcp reads "
                            f"({type(e).__name__}: {str(e)[:200]})") from e


def _stage_of(archive: Archive) -> int:
    stage = archive.obj["optimizer_state_dict"].get("zero_stage")
    value = stage.args[0] if isinstance(stage, Opaque) and stage.args else stage
    return int(value) if isinstance(value, int) else 2


def _stage12(b: _Builder, shapes: list[dict], optim: dict[int, Archive]) -> None:
    """Stages 1 and 2: runs from `param_slice_mappings` (module doc)."""
    osds = {r: a.obj["optimizer_state_dict"] for r, a in optim.items()}
    for r, osd in osds.items():
        if "param_slice_mappings" not in osd:
            raise MetadataError(f"{b.where}/{optim[r].relpath}: no param_slice_mappings (DeepSpeed older than 0.10); "
                                "load it with DeepSpeed and save it again")
        if not isinstance(osd.get("base_optimizer_state"), dict):
            raise MetadataError(f"{b.where}/{optim[r].relpath}: an elastic ZeRO checkpoint; bcp reads the default "
                                "(rigid) layout")
    names_of_group = []
    for g, group in enumerate(shapes):
        runs: dict[str, list[_Run]] = {name: [] for name in group}
        for r in sorted(osds):
            for name, address in osds[r]["param_slice_mappings"][g].items():
                f = address.fields() if isinstance(address, Opaque) else {}
                if name not in runs or "start" not in f or "numel" not in f:
                    raise MetadataError(f"{b.where}/{optim[r].relpath}: param_slice_mappings names {name!r}, not a "
                                        f"parameter of group {g} with a fragment address")
                done = sum(x.numel for x in runs[name])
                runs[name].append(_Run(r, done, int(f["numel"]), int(f["start"])))
        flats = {r: (optim[r].relpath, osds[r]["single_partition_of_fp32_groups"][g]) for r in osds}
        states = {r: osds[r]["base_optimizer_state"]["state"].get(g, {}) for r in osds}
        _params_and_state(b, group, runs, flats, states, optim)
        names_of_group.append(list(group))
    _param_groups(b, [osds[0]["base_optimizer_state"]["param_groups"][g] for g in range(len(shapes))],
                  names_of_group)


def _stage3(b: _Builder, shapes: list[dict], optim: dict[int, Archive], world: int) -> None:
    """Stage 3: each parameter partitioned alone (module doc)."""
    osds = {r: a.obj["optimizer_state_dict"] for r, a in optim.items()}
    inner = {r: osd["optimizer_state_dict"] for r, osd in osds.items()}
    for s, group in enumerate(shapes):
        runs: dict[str, list[_Run]] = {}
        at = 0
        for name, shape in group.items():
            numel = math.prod(shape)
            part = -(-numel // world)
            runs[name] = [_Run(r, r * part, max(0, min(part, numel - r * part)), at) for r in range(world)]
            runs[name] = [x for x in runs[name] if x.numel]
            at += part
        flats = {r: (optim[r].relpath, osds[r]["fp32_flat_groups"][s]) for r in osds}
        for rel, flat in flats.values():
            if flat.numel != at:
                raise MetadataError(f"{b.where}/{rel}: sub-group {s} holds {flat.numel} elements; its parameters' "
                                    f"partitions over {world} ranks take {at}")
        states = {r: inner[r]["state"].get(s, {}) for r in osds}
        _params_and_state(b, group, runs, flats, states, optim)
    groups = inner[0]["param_groups"]
    _param_groups(b, groups, [[n for s in g["params"] for n in shapes[s]] for g in groups])


def _params_and_state(b: _Builder, group: dict, runs: dict[str, list[_Run]], flats: dict, states: dict,
                      optim: dict[int, Archive]) -> None:
    for name, shape in group.items():
        b.runs(f"model.{name}", shape, flats, runs[name])
    snames = sorted({k for st in states.values() for k in st})
    for sname in snames:
        per_rank = {r: st.get(sname) for r, st in states.items()}
        sample = next(v for v in per_rank.values() if v is not None)
        if isinstance(sample, TensorRef) and sample.shape == ():
            for name in group:  # one per partition: every parameter has it, from its first holder's file
                r = runs[name][0].rank if runs[name] else 0
                b.whole(f"optimizer.state.{name}.{sname}", per_rank[r], optim[r].relpath, r)
        elif isinstance(sample, TensorRef):
            state_flats = {r: (optim[r].relpath, v) for r, v in per_rank.items()}
            for name, shape in group.items():
                b.runs(f"optimizer.state.{name}.{sname}", shape, state_flats, runs[name])
        else:
            for name in group:
                b.value(f"optimizer.state.{name}.{sname}", sample)


def _param_groups(b: _Builder, groups: list[dict], names: list[list[str]]) -> None:
    b.value("optimizer.param_groups", [{**{k: v for k, v in g.items() if k != "params"}, "params": n}
                                       for g, n in zip(groups, names)])


def _module_rest(b: _Builder, st: Storage, model: Archive, ms: dict, stage3: bool, world: int,
                 rank_files: dict) -> None:
    """Buffers, parameters the optimizer does not train, tied names, the scheduler."""
    module = ms.get("module") or {}
    for name in ms.get("buffer_names") or ():
        ref = module.get(name)
        if isinstance(ref, TensorRef):
            b.whole(f"model.{name}", ref, model.relpath, 0)
    frozen = ms.get("frozen_param_shapes") or {}
    if frozen and not stage3:
        for name, ref in (ms.get("frozen_param_fragments") or {}).items():
            b.whole(f"model.{name}", ref, model.relpath, 0)
    elif frozen:
        flats, runs = {}, {}
        for r in range(world):
            rel = rank_files[(r, 0, "model")]
            frags = (open_archive(st, rel).obj.get("frozen_param_fragments") or {}) if r else \
                (ms.get("frozen_param_fragments") or {})
            for name, ref in frags.items():
                flats.setdefault(name, {})[r] = (rel, ref)
        for name, shape in frozen.items():
            numel = math.prod(tuple(shape))
            part = -(-numel // world)
            runs = [_Run(r, r * part, max(0, min(part, numel - r * part)), 0) for r in range(world)]
            b.runs(f"model.{name}", tuple(shape), flats.get(name, {}), [x for x in runs if x.numel])
    for alias, name in (ms.get("shared_params") or {}).items():
        if f"model.{name}" in b.tensors:
            b.tensors[f"model.{alias}"] = b.tensors[f"model.{name}"]
    scheduler = ms.get("lr_scheduler")
    if isinstance(scheduler, dict):
        b.values("scheduler", scheduler, model.relpath)


def _engine(b: _Builder, ms: dict, osd0: dict) -> None:
    for k in ("global_steps", "global_samples", "skipped_steps"):
        if k in ms:
            b.value(f"engine.{k}", int(ms[k]))
    scaler = osd0.get("loss_scaler")
    fields = scaler.fields() if isinstance(scaler, Opaque) else scaler if isinstance(scaler, dict) else {}
    for f in _SCALER_FIELDS:
        if f in fields:
            b.value(f"engine.loss_scaler.{f}", fields[f])


def _plain(v: Any) -> Any:
    """Values of DeepSpeed's pickles as bcp's codec takes them (enums by value)."""
    if isinstance(v, Opaque):
        if v.args and len(v.args) == 1 and not v.fields():
            return _plain(v.args[0])
        raise MetadataError(f"a value of class {v.origin} has no form bcp can represent")
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    return v


# ----------------------------------------------------------------------------- checksums


class _Span:
    """One piece's bytes [start, end) of a file, hashed block by block as they stream past."""

    def __init__(self, start: int, end: int, block: int):
        self.start, self.end, self.block = start, end, block
        self.sums: list[int] = []
        self._h, self._in = xxhash.xxh3_64(), 0

    def feed(self, data: memoryview, at: int) -> None:
        lo, hi = max(self.start, at), min(self.end, at + len(data))
        i = lo
        while i < hi:
            take = min(self.block - self._in, hi - i)
            self._h.update(data[i - at: i - at + take])
            self._in, i = self._in + take, i + take
            if self._in == self.block:
                self._flush()

    def _flush(self) -> None:
        self.sums.append(self._h.intdigest())
        self._h, self._in = xxhash.xxh3_64(), 0

    def done(self) -> tuple[int, ...]:
        if self._in or not self.sums:
            self._flush()
        return tuple(self.sums)


def _with_checksums(md: CheckpointMetadata, archives: dict[str, Archive], block: int,
                    where: str) -> CheckpointMetadata:
    """`md` with every piece's block checksums, from one pass over each file's records, each checked
    against its zip CRC (a damaged file fails here, naming it)."""
    spans: dict[tuple[int, int, int], _Span] = {}
    for tm in md.tensors.values():
        for p in tm.pieces:
            spans.setdefault((p.file, p.byte_offset, p.nbytes), _Span(p.byte_offset, p.byte_offset + p.nbytes, block))
    for i, rel in enumerate(md.files):
        mine = sorted((s for (f, _, _), s in spans.items() if f == i), key=lambda s: s.start)
        if mine:
            _stream(archives[rel], mine, where)
    tensors = {k: TensorMeta(tm.dtype, tm.shape, tuple(
        Piece(p.offsets, p.lengths, p.file, p.byte_offset, p.nbytes, spans[(p.file, p.byte_offset, p.nbytes)].done(),
              p.rank) for p in tm.pieces)) for k, tm in md.tensors.items()}
    return CheckpointMetadata(md.world_size, md.framework, md.files, tensors, md.objects, md.per_rank,
                              md.sharded_objects, md.checksum_block_bytes, md.user, md.version)


def _stream(archive: Archive, spans: list[_Span], where: str, chunk: int = 8 << 20) -> None:
    zf = archive.zip
    records = []
    for info in zf.infolist():
        if info.filename.startswith(archive.prefix + "data/"):
            start = record_offset(archive, info.filename)
            records.append((start, start + info.file_size, info))
    for start, end, info in sorted(records, key=lambda r: r[0]):
        inside = [s for s in spans if s.start < end and s.end > start]
        if not inside:
            continue
        at = start
        try:
            with zf.open(info) as f:  # zipfile checks the record's CRC-32 when it reaches its end
                while True:
                    data = f.read(chunk)
                    if not data:
                        break
                    view = memoryview(data)
                    for s in inside:
                        s.feed(view, at)
                    at += len(data)
        except zipfile.BadZipFile as e:
            raise MetadataError(f"{where}/{archive.relpath}: record {info.filename} is damaged ({e})") from None


__all__ = ["deepspeed_metadata", "step_directory", "MODEL_FILE"]
