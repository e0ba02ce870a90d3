"""Untrusted checkpoints: loading never runs code unless the caller opts in.

A pickle payload that would create a file is planted in every place a value can live: a
replicated value, a per-rank value, a sharded object's bytes, nested inside a list. Loading
refuses each one, with a message on how to opt in, and the payload never runs.
"""

from __future__ import annotations

import base64
import json
import os
import pickle

import pytest
import torch

import bcp_core as bcp
from bcp_core.metadata import METADATA_FILE
from bcp_core.shards import ObjectShard


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _tagged(marker):
    return {"__pickle__": base64.b64encode(pickle.dumps(_Payload(marker))).decode()}


@pytest.fixture()
def ck(tmp_path):
    path = str(tmp_path / "ck")
    state = {"w": torch.ones(3), "cfg": {"lr": 0.1, "names": ["a", "b"]},
             "loader": {"buf": ObjectShard({"x": 1}, (0,), (1,))}, "extra_state": {"step": 1}}
    bcp.save(path, state).wait()
    return path


def _plant(ck, where, marker):
    mpath = os.path.join(ck, METADATA_FILE)
    raw = json.load(open(mpath))
    if where == "replicated value":
        raw["objects"]["cfg.lr"] = _tagged(marker)
    elif where == "nested in a list":
        raw["objects"]["cfg.names"] = ["a", _tagged(marker)]
    elif where == "per-rank value":
        raw["per_rank"]["extra_state.step"]["variants"][0] = {"object": _tagged(marker)}
    elif where == "sharded object bytes":
        md = bcp.inspect(ck)
        p = md.sharded_objects["loader.buf"].shards[0]
        blob = json.dumps(_tagged(marker)).encode()
        data_path = os.path.join(ck, md.files[p.file])
        with open(data_path, "ab") as f:
            offset = f.tell()
            f.write(blob)
        from bcp_core.engine import checksum
        shard = raw["sharded_objects"]["loader.buf"]["shards"][0]
        shard.update(byte_offset=offset, nbytes=len(blob), checksums=[checksum(blob)])
    json.dump(raw, open(mpath, "w"))


PLACES = ["replicated value", "nested in a list", "per-rank value", "sharded object bytes"]


@pytest.mark.parametrize("where", PLACES)
def test_pickle_payload_is_refused_everywhere(ck, tmp_path, where):
    marker = str(tmp_path / "pwned")
    _plant(ck, where, marker)
    target = {"w": torch.empty(3), "cfg": {}, "loader": {"buf": ObjectShard(None, (0,), (1,))},
              "extra_state": {}}
    with pytest.raises(bcp.PickleNotAllowedError, match="allow_pickle=True"):
        bcp.load(ck, target)
    assert not os.path.exists(marker)
    bcp.inspect(ck)  # reading metadata alone never decodes values
    assert not os.path.exists(marker)


def test_opting_in_runs_it(ck, tmp_path):
    """The opt-in is real (so the refusal above is what protects)."""
    marker = str(tmp_path / "ran")
    _plant(ck, "replicated value", marker)
    bcp.load(ck, {"cfg": {}}, allow_pickle=True, strict=False)
    assert os.path.exists(marker)


def test_numpy_object_arrays_are_refused(ck):
    mpath = os.path.join(ck, METADATA_FILE)
    raw = json.load(open(mpath))
    raw["objects"]["cfg.lr"] = {"__ndarray__": {"dtype": "|O", "shape": [1], "data": ""}}
    json.dump(raw, open(mpath, "w"))
    with pytest.raises(bcp.UnsupportedValueError, match="object arrays could run code"):
        bcp.load(ck, {"cfg": {}})


# ----------------------------------------------------------------------------- other systems' files
# DeepSpeed's `global_stepN/` and the torch.save files in it are read without running their pickles
# (bcp_core.foreign): whatever they hold, reading them ends in a MetadataError naming the file, or
# in "not a DeepSpeed checkpoint" where only detection looked at them.


@pytest.mark.parametrize("tracker", [b"step_00000001\x00", b"step_00000001\x00garbage", b"\x00" * 64])
def test_tracker_with_a_nul_byte_loads_bcps_checkpoint(tmp_path, tracker):
    """DeepSpeed detection reads the same `latest` file before bcp's own resolution: it takes the name
    as bcp does (up to the first NUL), never passing a NUL to the file system."""
    from bcp_core import layout

    root = str(tmp_path / "root")
    bcp.save(root, {"model": {"w": torch.arange(4.0)}}, step=1).wait()
    with open(os.path.join(root, "latest"), "wb") as f:
        f.write(tracker)
    assert layout.resolve(root).root == os.path.join(root, "step_00000001")
    out = {"model": {"w": torch.zeros(4)}}
    bcp.load(root, out)
    assert torch.equal(out["model"]["w"], torch.arange(4.0))


@pytest.mark.parametrize("tracker, found", [(b"global_step2\x00\x00", "global_step2"),
                                            (b"global_step2\n", "global_step2"), (b"global\x01step2", None),
                                            (b"..", None), (b"a/b", None)])
def test_deepspeed_latest_is_read_like_bcps_tracker(tmp_path, tracker, found):
    from bcp_core.foreign.deepspeed import MODEL_FILE, step_directory
    from bcp_core.storage import storage_for

    for name in ("global_step2", "global\x01step2"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / MODEL_FILE).write_bytes(b"")  # detection looks at names only
    (tmp_path / "latest").write_bytes(tracker)
    assert step_directory(storage_for(str(tmp_path))) == found


def test_deepspeed_detection_never_raises(tmp_path, monkeypatch):
    """Anything that cannot be listed is no DeepSpeed checkpoint, whatever the storage raises."""
    from bcp_core.errors import StorageError
    from bcp_core.foreign.deepspeed import step_directory
    from bcp_core.storage import storage_for

    (tmp_path / "latest").write_bytes(b"global_step2")
    st = storage_for(str(tmp_path))
    for error in (ValueError("embedded null byte"), StorageError("refused"), NotADirectoryError("x")):
        def listdir(relpath="", error=error):
            raise error
        monkeypatch.setattr(st, "listdir", listdir)
        assert step_directory(st) is None


class _Record:
    def __init__(self, key):
        self.key = key


class _ArchivePickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", torch.FloatStorage, obj.key, "cpu", 4) if isinstance(obj, _Record) else None


class _Tensor:  # pickles as torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, {})
    def __init__(self, key, offset, size, stride):
        self.args = (_Record(key), offset, size, stride, False, {})

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


class _Call:  # pickles as func(*args)
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


_FLOATS_A = torch.arange(4, dtype=torch.float32).numpy().tobytes()
_FLOATS_B = (torch.arange(4, dtype=torch.float32) + 100).numpy().tobytes()


def _archive(path, obj, records=None, protocol=4):
    import io
    import zipfile

    if isinstance(obj, bytes):
        data = obj
    else:
        buf = io.BytesIO()
        _ArchivePickler(buf, protocol=protocol).dump(obj)
        data = buf.getvalue()
    records = {"0": _FLOATS_A, "1": _FLOATS_B} if records is None else records
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data)
        for k, v in records.items():
            z.writestr(f"archive/data/{k}", v)


def _open(tmp_path, obj, **kw):
    from bcp_core.foreign.torch_archive import open_archive
    from bcp_core.storage import storage_for

    _archive(str(tmp_path / "a.pt"), obj, **kw)
    return open_archive(storage_for(str(tmp_path)), "a.pt")


def test_archive_reads_tensors_and_bytearrays(tmp_path):
    """The control for the refusals below: well-formed values are read."""
    from bcp_core.foreign.torch_archive import TensorRef

    a = _open(tmp_path, {"a": _Tensor("0", 0, (4,), (1,)), "b": _Tensor("1", 1, (3,), (1,)),
                         "buf": bytearray(b"\x00\xffab"), "text": _Call(bytearray, "\xffab", "latin-1")})
    raw = (tmp_path / "a.pt").read_bytes()
    b = a.obj["b"]
    assert isinstance(b, TensorRef) and raw[b.byte_offset: b.byte_offset + b.nbytes] == _FLOATS_B[4:]
    assert a.obj["buf"] == bytearray(b"\x00\xffab") and a.obj["text"] == bytearray(b"\xffab")


@pytest.mark.parametrize("obj", [_Call(bytearray, 1 << 28), _Call(bytearray, [1] * 8),
                                 _Call(torch._tensor._rebuild_from_type_v2, bytearray, torch.Tensor, (1 << 28,), {}),
                                 _Call(torch._tensor._rebuild_from_type_v2, set, torch.Tensor, ([1],), {})],
                         ids=["bytearray(n)", "bytearray(list)", "rebuild_from_type bytearray",
                              "rebuild_from_type set"])
def test_archive_never_allocates_what_its_pickle_asks(tmp_path, obj):
    """`bytearray(n)` of a few-byte pickle would allocate n zeroed bytes; only bytes or text (no
    larger than the pickle) make one, and `_rebuild_from_type_v2` calls only tensor rebuilders."""
    with pytest.raises(bcp.MetadataError, match="a.pt"):
        _open(tmp_path, {"optimizer_state_dict": obj})


@pytest.mark.parametrize("offset, size, stride", [
    (-20, (4,), (1,)),                     # before its record: the zip header and record 0
    (-1, (1,), (1,)),
    (0, (-1,), (1,)),
    (0, ("x",), (1,)),                     # a shape of strings
    (0, (4,), ("x",)),
    (0, (4,), (1, 1)),                     # a stride per dimension
    (0, (1 << 40, 1 << 40), (1 << 40, 1)),  # more elements than any tensor holds
    (0, (1,) * 65, (1,) * 65),             # more dimensions than bcp records
    (1.5, (1,), (1,)),
    (3, (2,), (1,)),                       # past its record's end
])
def test_archive_tensor_lies_within_its_record(tmp_path, offset, size, stride):
    with pytest.raises(bcp.MetadataError, match="a.pt"):
        _open(tmp_path, {"a": _Tensor("0", 0, (4,), (1,)), "b": _Tensor("1", offset, size, stride)})


def test_archive_tensor_dtype_is_a_dtype(tmp_path):
    v3 = _Call(torch._utils._rebuild_tensor_v3, _Record("0"), 0, (4,), (1,), False, {}, "float32")
    with pytest.raises(bcp.MetadataError, match="dtype"):
        _open(tmp_path, {"a": v3})


def test_archive_nested_deep_is_a_metadata_error(tmp_path):
    n = 100_000  # lists nested n deep: the pickle builds them without recursion, placing them must not recurse
    with pytest.raises(bcp.MetadataError, match="nested"):
        _open(tmp_path, b"\x80\x04" + b"]" * n + b"a" * (n - 1) + b".")


def test_archive_shared_objects_are_visited_once(tmp_path):
    """A pickle shares objects through its memo: 60 levels of [x, x] is a small file and 2**60 leaves."""
    x = [_Tensor("0", 0, (4,), (1,))]
    for _ in range(60):
        x = [x, x]
    a = _open(tmp_path, {"x": x})
    leaf = a.obj["x"]
    while isinstance(leaf, list) and len(leaf) == 2:
        leaf = leaf[1]
    assert leaf[0].byte_offset > 0


def test_archive_cycle_is_a_metadata_error(tmp_path):
    x = []
    x.append(x)
    with pytest.raises(bcp.MetadataError, match="nested"):
        _open(tmp_path, {"x": x})


def _zero2_step(path, model=None, optim=None):
    """A global_stepN directory of one rank, its files as given (torch.save's own format)."""
    os.makedirs(path, exist_ok=True)
    torch.save({"param_shapes": [{"w": torch.Size([4])}], "dp_world_size": 1, "module": {}} if model is None
               else model, os.path.join(path, "mp_rank_00_model_states.pt"))
    torch.save({"optimizer_state_dict": {}} if optim is None else optim,
               os.path.join(path, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    return path


@pytest.mark.parametrize("model, optim, cause", [
    (None, {"x": 1}, None),                                                     # no optimizer_state_dict
    (None, {"optimizer_state_dict": [1]}, None),
    (None, {"optimizer_state_dict": {"param_slice_mappings": 5, "base_optimizer_state": {}}}, TypeError),
    (None, {"optimizer_state_dict": {"param_slice_mappings": [], "base_optimizer_state": {}}}, IndexError),
    ({"param_shapes": [{"w": torch.Size([4])}], "dp_world_size": "x"}, None, ValueError),
    ({"param_shapes": 7, "dp_world_size": 1}, None, TypeError),
], ids=["no osd", "osd a list", "mappings an int", "mappings empty", "world a string", "shapes an int"])
def test_deepspeed_checkpoint_of_another_shape_is_a_metadata_error(tmp_path, model, optim, cause):
    """Whatever DeepSpeed's files hold, bcp says which files it cannot read (never a raw KeyError or
    TypeError, which the CLI would show as a traceback), the original error kept as the cause."""
    from bcp_core.foreign.deepspeed import deepspeed_metadata
    from bcp_core.storage import storage_for
    from bcp_core.tools.cli import main

    step = _zero2_step(str(tmp_path / "global_step1"), model, optim)
    with pytest.raises(bcp.MetadataError, match="global_step1") as info:
        deepspeed_metadata(storage_for(step))
    assert "_states.pt" in str(info.value)
    if cause is not None:
        assert isinstance(info.value.__cause__, cause)
    assert main(["-q", "inspect", step]) != 0
