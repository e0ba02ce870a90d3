"""`bcp export` writes its output whole or not at all, checks its inputs before writing, and cleans up
after a failure; `bcp import --from hf` refuses a safetensors header that does not describe the file."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file

import bcp_core as bcp
from bcp_core.tools import cli, convert


def _bcp(*argv: str) -> int:
    return cli.main(["-q", *argv])


@pytest.fixture
def ckpt(tmp_path):
    """A small checkpoint: 4 model tensors of 1 KiB each (fp32)."""
    torch.manual_seed(0)
    model = {f"layer{i}": torch.randn(16, 16) for i in range(4)}
    path = str(tmp_path / "ckpt")
    bcp.save(path, {"model": model}).wait()
    return path, model


def _listing(d) -> dict[str, bytes]:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def _leftovers(tmp_path) -> list[str]:
    return [n for n in os.listdir(tmp_path) if ".bcp-tmp." in n]


def _fail_on_second_tensor(monkeypatch):
    calls = []
    real = convert.read_blocks

    def failing(st, md, fqn, tm, num_threads):
        calls.append(fqn)
        if len(calls) == 2:
            raise OSError("disk went away")
        return real(st, md, fqn, tm, num_threads)

    monkeypatch.setattr(convert, "read_blocks", failing)


def test_export_hf_refuses_a_non_empty_out_and_overwrite_replaces_it_whole(ckpt, tmp_path, capsys):
    path, model = ckpt
    out = str(tmp_path / "hf")
    assert _bcp("export", path, out, "--to", "hf") == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    before = _listing(out)
    # A sharded export into it would leave the old model.safetensors (which from_pretrained reads
    # before the index) beside the new shards: refused, OUT untouched.
    assert _bcp("export", path, out, "--to", "hf", "--shard-size", "1KB") == 1
    assert out in capsys.readouterr().err and _listing(out) == before
    # --overwrite: the new export only, with nothing of the old one left.
    assert _bcp("export", path, out, "--to", "hf", "--shard-size", "1KB", "--overwrite") == 0
    files = sorted(os.listdir(out))
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)] + \
        ["model.safetensors.index.json"]
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(os.path.join(out, file))[name], model[name])
    assert _leftovers(tmp_path) == []
    # An empty directory is an acceptable OUT without --overwrite.
    os.mkdir(tmp_path / "empty")
    assert _bcp("export", path, str(tmp_path / "empty"), "--to", "hf") == 0
    assert sorted(os.listdir(tmp_path / "empty")) == ["model.safetensors"]
    # --overwrite never replaces the checkpoint being exported.
    assert _bcp("export", path, path, "--to", "hf", "--overwrite") == 1
    assert os.path.exists(os.path.join(path, "bcp_metadata.json"))


def test_export_hf_that_fails_partway_leaves_no_output_and_keeps_the_old_one(ckpt, tmp_path, monkeypatch):
    path, _ = ckpt
    out = str(tmp_path / "hf")
    old = str(tmp_path / "old")
    assert _bcp("export", path, old, "--to", "hf", "--shard-size", "1KB") == 0
    before = _listing(old)
    _fail_on_second_tensor(monkeypatch)
    # Into a new directory: nothing appears (the old code left shard 1 of 4).
    assert _bcp("export", path, out, "--to", "hf", "--shard-size", "1KB") == 1
    assert not os.path.exists(out)
    # Replacing a directory: the old export stays as it was, not a mix of old and new shards.
    _fail_on_second_tensor(monkeypatch)
    assert _bcp("export", path, old, "--to", "hf", "--shard-size", "1KB", "--dtype", "bf16", "--overwrite") == 1
    assert _listing(old) == before
    assert _leftovers(tmp_path) == []


def test_export_hf_removes_what_a_killed_export_left_beside_out(ckpt, tmp_path):
    """An export killed before its end leaves its staging directory beside OUT: the next export to
    OUT removes it (its process has ended), never one of a process that runs."""
    import subprocess
    import sys

    from bcp_core.storage.base import temp_name
    path, _ = ckpt
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    left = tmp_path / temp_name("hf").replace(f".{os.getpid()}.", f".{gone}.")
    running = tmp_path / temp_name("hf")  # this process's: a running export's
    for d in (left, running):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    assert _bcp("export", path, str(tmp_path / "hf"), "--to", "hf") == 0
    assert not left.exists() and running.exists()
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]


@pytest.mark.parametrize("config", ["missing.json", "not_json.json"])
def test_export_hf_checks_config_before_writing(ckpt, tmp_path, capsys, config):
    path, _ = ckpt
    (tmp_path / "not_json.json").write_text("{'model_type': llama")
    out = str(tmp_path / "hf")
    assert _bcp("export", path, out, "--to", "hf", "--config", str(tmp_path / config)) == 1
    assert config in capsys.readouterr().err
    assert not os.path.exists(out) and _leftovers(tmp_path) == []


def test_export_torch_failure_removes_its_temporary_file(ckpt, tmp_path, monkeypatch):
    path, _ = ckpt
    _fail_on_second_tensor(monkeypatch)
    assert _bcp("export", path, str(tmp_path / "model.pt"), "--to", "torch") == 1
    assert not os.path.exists(tmp_path / "model.pt") and _leftovers(tmp_path) == []


def _safetensors(path, header: dict, data: bytes, pad: bool = True) -> str:
    raw = json.dumps(header).encode()
    if pad:  # as safetensors writes it: the data section 8-byte aligned
        raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


F32x4 = {"dtype": "F32", "shape": [4]}


@pytest.mark.parametrize("entry", [
    dict(F32x4, data_offsets=[-8, 8]),                    # would read 8 header bytes as tensor data
    dict(F32x4, data_offsets=[-16, 0]),                   # would wrap to the end of the file
    {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]},
    {"dtype": "XX", "shape": [4], "data_offsets": [0, 16]},
    dict(F32x4, data_offsets=[0, 8]),                     # fewer bytes than the shape needs
    dict(F32x4, data_offsets=[8, 24]),                    # past the end of the file
    dict(F32x4, data_offsets=[0]),
    [1, 2],
    "F32",
])
def test_import_hf_refuses_a_bad_safetensors_header(tmp_path, capsys, entry):
    src = _safetensors(tmp_path / "model.safetensors", {"w": entry}, bytes(16))
    assert _bcp("import", src, str(tmp_path / "imported"), "--from", "hf") == 1
    err = capsys.readouterr().err
    assert src in err and "'w'" in err
    assert not os.path.exists(tmp_path / "imported")


def test_import_hf_refuses_overlapping_tensors_and_reads_a_good_file(tmp_path, capsys):
    overlap = _safetensors(tmp_path / "overlap.safetensors",
                           {"a": dict(F32x4, data_offsets=[0, 16]), "b": dict(F32x4, data_offsets=[0, 16])},
                           bytes(16))
    assert _bcp("import", overlap, str(tmp_path / "x"), "--from", "hf") == 1
    assert overlap in capsys.readouterr().err
    values = torch.arange(8, dtype=torch.float32)
    header = {"__metadata__": {"format": "pt"}, "a": dict(F32x4, data_offsets=[0, 16]),
              "b": dict(F32x4, data_offsets=[16, 32])}
    for pad in (True, False):  # an unpadded header leaves the tensors unaligned: they are copied
        good = _safetensors(tmp_path / f"good{pad}.safetensors", header, values.numpy().tobytes(), pad)
        assert _bcp("import", good, str(tmp_path / f"y{pad}"), "--from", "hf") == 0
        state = {"model": {"a": torch.zeros(4), "b": torch.zeros(4)}}
        bcp.load(str(tmp_path / f"y{pad}"), state)
        assert torch.equal(state["model"]["a"], values[:4]) and torch.equal(state["model"]["b"], values[4:])
