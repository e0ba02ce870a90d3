"""Every documented error: raised, and naming what is wrong."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch import nn

import bcp_core as bcp
from bcp_core.metadata import METADATA_FILE


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


@pytest.fixture()
def ckpt(tmp_path):
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    path = str(tmp_path / "ck")
    bcp.save(path, {"model": model, "optimizer": optim, "extra_state": {"step": 7}}).wait()
    return path, model, optim


def _edit_metadata(path, fn):
    mpath = os.path.join(path, METADATA_FILE)
    with open(mpath) as f:
        raw = json.load(f)
    fn(raw)
    with open(mpath, "w") as f:
        json.dump(raw, f)


def test_missing_and_unexpected_keys_strict(ckpt):
    path, _, _ = ckpt
    bigger = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.Linear(3, 3))
    with pytest.raises(bcp.KeyMismatchError, match=r"missing from the checkpoint: model\.3\.bias, model\.3\.weight"):
        bcp.load(path, {"model": bigger})
    smaller = nn.Sequential(nn.Linear(4, 6))
    with pytest.raises(bcp.KeyMismatchError, match=r"no place in the target: model\.2\.bias, model\.2\.weight"):
        bcp.load(path, {"model": smaller})


def test_non_strict_loads_the_rest_and_reports(ckpt):
    path, model, _ = ckpt
    bigger = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.Linear(3, 3))
    extra_before = bigger[3].weight.detach().clone()
    result = bcp.load(path, {"model": bigger}, strict=False)
    assert result.missing == ["model.3.bias", "model.3.weight"] and result.unexpected == []
    assert torch.equal(bigger[0].weight, model[0].weight) and torch.equal(bigger[2].bias, model[2].bias)
    assert torch.equal(bigger[3].weight, extra_before)  # untouched


def test_shape_and_dtype_mismatch(ckpt):
    path, _, _ = ckpt
    wide = nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3))
    with pytest.raises(bcp.ShapeMismatchError, match=r"'model\.0\.weight'.*\(6, 4\).*\(7, 4\)"):
        bcp.load(path, {"model": wide})
    half = _model().to(torch.bfloat16)
    with pytest.raises(bcp.ShapeMismatchError, match=r"model\.0\.(bias|weight).*torch\.float32.*torch\.bfloat16"):
        bcp.load(path, {"model": half})


def test_a_value_where_a_module_has_a_tensor_is_refused_naming_the_key(tmp_path):
    """A module's tensors are loaded into in place: a plain value saved under one of its keys is an
    error naming the key, in a strict load and a lenient one, not a value silently dropped."""
    path = str(tmp_path / "values")
    bcp.save(path, {"model": {"0": {"weight": [[1.0] * 4] * 6, "bias": 0.5}}}).wait()
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(bcp.BCPError, match=r"cannot set 'model\.0\.(weight|bias)': the checkpoint holds a value"):
            bcp.load(path, {"model": model}, strict=strict)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(bcp.NotACheckpointError, match="is not a bcp checkpoint"):
        bcp.load(str(tmp_path), {"model": _model()})
    (tmp_path / METADATA_FILE).write_text('{"hello": 1}')
    with pytest.raises(bcp.NotACheckpointError, match="not bcp metadata"):
        bcp.inspect(str(tmp_path))


def test_incomplete_checkpoint_is_never_loaded(ckpt, tmp_path):
    path, _, _ = ckpt
    os.remove(os.path.join(path, METADATA_FILE))  # a save that died before its commit
    with pytest.raises(bcp.IncompleteCheckpointError, match="never committed"):
        bcp.load(path, {"model": _model()})
    root = tmp_path / "root"
    bcp.save(str(root), {"model": _model()}, step=1).wait()
    bcp.save(str(root), {"model": _model()}, step=2).wait()
    os.remove(root / "step_00000002" / METADATA_FILE)
    (root / "latest").write_text("step_00000002")  # even a tracker pointing at it is not trusted
    assert bcp.load(str(root), {"model": _model()}).path.endswith("step_00000001")
    os.remove(root / "step_00000001" / METADATA_FILE)
    with pytest.raises(bcp.IncompleteCheckpointError, match="step_00000002, step_00000001"):
        bcp.load(str(root), {"model": _model()})


def test_checksum_mismatch_names_file_range_and_tensor(ckpt):
    path, _, _ = ckpt
    md = bcp.inspect(path)
    piece = md.tensors["model.0.weight"].pieces[0]
    data_file = os.path.join(path, md.files[piece.file])
    with open(data_file, "r+b") as f:
        f.seek(piece.byte_offset + 5)
        b = f.read(1)
        f.seek(piece.byte_offset + 5)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(bcp.ChecksumError, match=rf"{md.files[piece.file]} bytes \[{piece.byte_offset}, "
                                                 rf"{piece.byte_offset + piece.nbytes}\) of tensor 'model\.0\.weight'"):
        bcp.load(path, {"model": _model()})
    bcp.load(path, {"model": _model()}, verify_checksums=False)  # opt-out reads it anyway


def test_truncated_data_file(ckpt):
    path, _, _ = ckpt
    md = bcp.inspect(path)
    data_file = os.path.join(path, md.files[0])
    os.truncate(data_file, os.path.getsize(data_file) - 10)
    model = _model()
    with pytest.raises(bcp.StorageError, match="truncated"):
        bcp.load(path, {"model": model, "optimizer": torch.optim.AdamW(model.parameters())})


def test_optimizer_state_of_a_claimed_shape_is_checked_against_the_files_before_allocation(tmp_path):
    """Optimizer state the optimizer has not made yet is allocated in the saved shape: that shape is
    a claim of the metadata, checked against the data file's size first (a damaged or crafted
    metadata claiming 4 TiB gets an error naming the tensor, not an allocation)."""
    path = str(tmp_path / "claimed")
    model = nn.Linear(2, 2, bias=False)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    bcp.save(path, {"model": model, "optim": optim}).wait()
    n = 1 << 40

    def claim(raw):
        raw["checksum"]["block_bytes"] = 1 << 30
        for tm in raw["tensors"].values():
            for piece in tm["pieces"]:
                piece["checksums"] = piece["checksums"][:1]
        tm = raw["tensors"]["optim.state.weight.exp_avg"]
        tm["shape"] = [n]
        tm["pieces"][0].update(offsets=[0], lengths=[n], nbytes=n * 4, checksums=[0] * (n * 4 >> 30))
    _edit_metadata(path, claim)
    fresh = nn.Linear(2, 2, bias=False)
    fresh_optim = torch.optim.Adam(fresh.parameters())
    with pytest.raises(bcp.StorageError, match=r"tensor 'optim\.state\.weight\.exp_avg'.* ends at byte"):
        bcp.load(path, {"model": fresh, "optim": fresh_optim}, strict=False)
    assert not fresh_optim.state


def test_newer_format_version(ckpt):
    path, _, _ = ckpt
    _edit_metadata(path, lambda raw: raw.update(version=bcp.FORMAT_VERSION + 1))
    with pytest.raises(bcp.FormatVersionError, match=f"version {bcp.FORMAT_VERSION + 1}, newer"):
        bcp.load(path, {"model": _model()})


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "data/../../x", "data//x", "c:/x",
                                 "data/a\x00b", "data/a\nb"])
def test_path_escaping_the_checkpoint_is_refused(ckpt, bad):
    path, _, _ = ckpt
    _edit_metadata(path, lambda raw: raw["files"].__setitem__(0, bad))
    with pytest.raises(bcp.UnsafePathError, match="escapes the checkpoint directory|holds a control character"):
        bcp.load(path, {"model": _model()})


def test_inconsistent_metadata_rejected_before_allocation(ckpt):
    path, _, _ = ckpt

    def grow(raw):
        raw["tensors"]["model.0.weight"]["shape"] = [1 << 40, 4]
    _edit_metadata(path, grow)
    with pytest.raises(bcp.MetadataError, match=r"'model\.0\.weight' pieces cover 24 elements"):
        bcp.inspect(path)


def test_unknown_framework_and_wrong_framework():
    with pytest.raises(bcp.BCPError, match="unknown framework 'jax'"):
        bcp.save("/tmp/never", {"model": _model()}, framework="jax")


def test_unsupported_value_names_key(tmp_path):
    class Opaque:
        pass
    with pytest.raises(bcp.SaveError, match=r"extra_state\.thing: cannot save a value of type .*Opaque"):
        bcp.save(str(tmp_path / "ck"), {"extra_state": {"thing": Opaque()}})
    assert not os.path.exists(tmp_path / "ck" / METADATA_FILE)


class Gadget:
    def __init__(self, n):
        self.n = n

    def __eq__(self, other):
        return isinstance(other, Gadget) and other.n == self.n


def test_pickle_needs_opt_in_on_save_and_on_load(tmp_path):
    path = str(tmp_path / "ck")
    bcp.save(path, {"extra_state": {"g": Gadget(3)}}, allow_pickle=True).wait()
    with pytest.raises(bcp.PickleNotAllowedError, match="allow_pickle=True"):
        bcp.load(path, {"extra_state": {}})
    out: dict = {"extra_state": {}}
    bcp.load(path, out, allow_pickle=True)
    assert out["extra_state"]["g"] == Gadget(3)


def test_load_works_with_pickle_disabled(ckpt, monkeypatch):
    """Model, optimizer and extra state load with every unpickling entry point made to fail."""
    path, model, optim = ckpt

    def refuse(*a, **k):
        raise AssertionError("unpickling attempted")

    class NoUnpickler:
        def __init__(self, *a, **k):
            refuse()

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", refuse)
    model2 = _model()
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    out = {"model": model2, "optimizer": optim2, "extra_state": {}}
    bcp.load(path, out)
    bcp.inspect(path)
    monkeypatch.undo()
    assert out["extra_state"]["step"] == 7
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = optim.state_dict(), optim2.state_dict()
    assert s2["param_groups"][0]["lr"] == 0.1
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k]), (i, k)
