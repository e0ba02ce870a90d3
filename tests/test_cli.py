"""The `bcp` command line: inspect, verify, export, import, rename, ls/latest/prune.

A tiny Llama is trained on 2 FSDP2 ranks and saved with bcp and with DCP; the
bcp checkpoint is exported to a Hugging Face directory and loaded back with
`from_pretrained`; the DCP one is imported and compared with `dcp.load`.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch

import bcp_core as bcp
from bcp_core.tools import cli
from dist import run_ranks

LLAMA = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _bcp(*argv: str) -> int:
    return cli.main(["-q", *argv])


# ----------------------------------------------------------------------------- a sharded training run

def _train_worker(rank, world_size, out):
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
    bcp.save(os.path.join(out, "bcp"), {"model": model, "optimizer": optim, "extra_state": {"step": 2}},
             step=2).wait()
    sharded = get_model_state_dict(model)  # DTensors: each rank writes its shards
    dcp.save({"model": sharded, "step": 2}, checkpoint_id=os.path.join(out, "dcp"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, os.path.join(out, "reference.pt"))
    return True


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    pytest.importorskip("transformers")
    out = str(tmp_path_factory.mktemp("trained"))
    run_ranks(2, _train_worker, out)
    return out


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def test_export_hf_loads_with_from_pretrained_and_gives_identical_logits(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    reference = _llama()
    reference.load_state_dict(torch.load(os.path.join(trained, "reference.pt"), weights_only=True))
    reference.config.save_pretrained(tmp_path / "config")
    out = tmp_path / "hf"
    assert _bcp("export", os.path.join(trained, "bcp"), str(out), "--to", "hf", "--config", str(tmp_path / "config"),
                "--shard-size", "40KB") == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3  # really sharded
    assert set(index["weight_map"]) == set(reference.state_dict())
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)
    # The shards are plain safetensors: the safetensors package reads them.
    from safetensors.torch import load_file
    name, file = next(iter(index["weight_map"].items()))
    assert torch.equal(load_file(str(out / file))[name], reference.state_dict()[name])

    # bf16 export into a single file
    out16 = tmp_path / "hf16"
    assert _bcp("export", os.path.join(trained, "bcp"), str(out16), "--to", "hf", "--dtype", "bf16") == 0
    w = load_file(str(out16 / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in w.values())
    assert torch.equal(w["lm_head.weight"], reference.lm_head.weight.detach().to(torch.bfloat16))


def test_import_dcp_loads_the_same_tensors_as_dcp(trained, tmp_path):
    import torch.distributed.checkpoint as dcp
    src = os.path.join(trained, "dcp")
    out = str(tmp_path / "imported")
    assert _bcp("import", src, out, "--from", "dcp") == 0

    md = bcp.inspect(out)
    expected = {}
    for k, tm in md.tensors.items():
        expected[k] = torch.empty(tm.shape, dtype=tm.dtype)
    expected["step"] = None
    dcp.load(expected, checkpoint_id=src, no_dist=True)
    got: dict = {"model": {}, "step": None}
    bcp.load(out, got)
    assert expected["step"] == got["step"] == 2
    model_keys = [k for k in expected if k.startswith("model.")]
    assert len(model_keys) == len(_llama().state_dict())
    for k in model_keys:
        node = got
        for part in k.split("."):  # load fills a plain dict as nested dicts
            node = node[part]
        assert torch.equal(node, expected[k]), k
    # ... and training can start from it in another layout: a plain model loads it.
    model = _llama()
    bcp.load(out, {"model": model}, strict=True)
    reference = torch.load(os.path.join(trained, "reference.pt"), weights_only=True)
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())


def test_inspect_shows_layout_and_ranks(trained, capsys):
    path = os.path.join(trained, "bcp")
    assert _bcp("inspect", path, "--json") == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["world_size"] == 2 and rep["path"].endswith("step_00000002")
    t = rep["tensors"]["model.model.embed_tokens.weight"]
    assert t["shape"] == [128, 32] and t["dtype"] == "float32" and t["nbytes"] == 128 * 32 * 4
    assert sorted(p["rank"] for p in t["pieces"]) == [0, 1]  # FSDP2 dim-0 shards, one per rank
    assert [p["lengths"] for p in t["pieces"]] == [[64, 32], [64, 32]]
    assert set(rep["ranks"]) == {"0", "1"}
    assert rep["extra_state"] == ["extra_state.step"]
    assert any(k.startswith("optimizer.state.") for k in rep["tensors"])
    assert _bcp("inspect", path, "--pieces") == 0
    text = capsys.readouterr().out
    assert "model.model.embed_tokens.weight" in text and "[0:64, 0:32] rank 0" in text and "[64:128, 0:32] rank 1" \
        in text


# ----------------------------------------------------------------------------- single-process checkpoints

def _small_state(step: int = 1):
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    return model, optim


class Opaque:
    """A value bcp saves only with allow_pickle."""


def test_inspect_verify_ls_never_unpickle(tmp_path, monkeypatch, capsys):
    model, optim = _small_state()
    root = str(tmp_path / "root")
    bcp.save(root, {"model": model, "extra_state": {"opaque": Opaque()}}, step=1, allow_pickle=True).wait()

    def refuse(*a, **k):
        raise AssertionError("a tool tried to unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    assert _bcp("inspect", root) == 0
    assert "<pickled value" in capsys.readouterr().out
    assert _bcp("verify", root) == 0
    assert _bcp("ls", root) == 0 and _bcp("latest", root) == 0


def _flip(path, offset: int, mask: int) -> None:
    """XOR one byte of a file in place."""
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


def test_verify_reports_each_fault(tmp_path, capsys):
    model, optim = _small_state()
    ckpt = tmp_path / "ckpt"
    bcp.save(str(ckpt), {"model": model, "optimizer": optim}).wait()
    assert _bcp("verify", str(ckpt)) == 0
    assert "OK" in capsys.readouterr().out

    md = bcp.inspect(str(ckpt))
    piece = md.tensors["model.0.weight"].pieces[0]
    data = ckpt / md.files[piece.file]
    _flip(data, piece.byte_offset + 100, 0xFF)
    assert _bcp("verify", str(ckpt), "--json") == 1
    rep = json.loads(capsys.readouterr().out)
    assert not rep["ok"]
    [fault] = rep["faults"]
    assert fault["kind"] == "checksum" and "model.0.weight" in fault["where"] and md.files[piece.file] in fault["where"]

    data.write_bytes(data.read_bytes()[: piece.byte_offset + 10])  # truncated upload
    assert _bcp("verify", str(ckpt)) == 1
    assert "short-file" in capsys.readouterr().out
    data.unlink()
    assert _bcp("verify", str(ckpt)) == 1
    assert "missing-file" in capsys.readouterr().out
    (ckpt / "bcp_metadata.json").unlink()  # never committed
    assert _bcp("verify", str(ckpt)) == 1
    assert "never committed" in capsys.readouterr().out


def test_export_torch_and_import_torch(tmp_path):
    model, optim = _small_state()
    ckpt = str(tmp_path / "ckpt")
    rng = torch.get_rng_state()
    bcp.save(ckpt, {"model": model, "optimizer": optim, "extra_state": {"step": 3, "rng": rng}, "note": "hello"}).wait()
    out = str(tmp_path / "full.pt")
    assert _bcp("export", ckpt, out, "--to", "torch") == 0
    full = torch.load(out, weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(full[f"model.{k}"], v)
    assert torch.equal(full["optimizer.state.0.weight.exp_avg"], optim.state[model[0].weight]["exp_avg"])
    assert full["note"] == "hello" and full["extra_state.step"] == 3
    assert torch.equal(full["extra_state.rng"], rng)
    assert full["optimizer.param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]

    small = str(tmp_path / "model_bf16.pt")
    assert _bcp("export", ckpt, small, "--to", "torch", "--model-only", "--dtype", "bf16",
                "--rename", r"^0\.=first.", "--rename", r"^1\.=second.") == 0
    sd = torch.load(small, weights_only=True)
    assert sorted(sd) == ["first.bias", "first.weight", "second.bias", "second.weight"]
    assert torch.equal(sd["first.weight"], model[0].weight.detach().to(torch.bfloat16))

    # Back in: a torch.save file becomes a bcp checkpoint a fresh model loads.
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    imported = str(tmp_path / "imported")
    assert _bcp("import", str(tmp_path / "plain.pt"), imported, "--from", "torch") == 0
    fresh, _ = _small_state(step=9)
    bcp.load(imported, {"model": fresh})
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_rename_rewrites_metadata_and_optimizer_groups(tmp_path, capsys):
    model, optim = _small_state()
    ckpt = str(tmp_path / "ckpt")
    bcp.save(ckpt, {"model": model, "optimizer": optim}).wait()
    data_before = {f: (tmp_path / "ckpt" / f).read_bytes() for f in bcp.inspect(ckpt).files}
    rules = ["--rule", r"^(model|optimizer\.state)\.0\.=\1.first.",
             "--rule", r"^(model|optimizer\.state)\.1\.=\1.second."]
    assert _bcp("rename", ckpt, *rules, "--dry-run") == 0
    assert "model.0.weight -> model.first.weight" in capsys.readouterr().out
    assert "model.0.weight" in bcp.inspect(ckpt).tensors  # dry run changed nothing
    assert _bcp("rename", ckpt, *rules) == 0
    assert {f: (tmp_path / "ckpt" / f).read_bytes() for f in data_before} == data_before  # data untouched

    renamed = torch.nn.ModuleDict({"first": torch.nn.Linear(64, 256), "second": torch.nn.Linear(256, 8)})
    new_optim = torch.optim.Adam(renamed.parameters())
    bcp.load(ckpt, {"model": renamed, "optimizer": new_optim})
    assert torch.equal(renamed["first"].weight, model[0].weight)
    assert torch.equal(new_optim.state[renamed["second"].bias]["exp_avg"], optim.state[model[1].bias]["exp_avg"])
    assert _bcp("rename", ckpt, "--rule", r"^model\.first\.=model.second.") == 1  # would merge two keys


def test_ls_latest_prune(tmp_path, capsys):
    root = tmp_path / "root"
    model, _ = _small_state()
    for step in range(1, 7):
        bcp.save(str(root), {"model": model}, step=step).wait()
    (root / "step_00000003" / "bcp_metadata.json").unlink()   # an old save that never committed
    hours_ago = time.time() - 2 * 3600
    for f in [*(root / "step_00000003").iterdir(), *(root / "step_00000003" / "data").iterdir()]:
        os.utime(f, (hours_ago, hours_ago))                    # (long ago: not a save in progress)
    (root / "step_00000007" / "data").mkdir(parents=True)     # a save in progress
    assert _bcp("ls", str(root), "--json") == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["complete"], c["latest"]) for c in listing] == [
        (1, True, False), (2, True, False), (3, False, False), (4, True, False), (5, True, False), (6, True, True),
        (7, False, False)]
    assert _bcp("ls", str(root)) == 0
    text = capsys.readouterr().out
    assert "step_00000003    INCOMPLETE" in text and "step_00000006    complete  <- latest" in text
    assert _bcp("latest", str(root)) == 0
    assert capsys.readouterr().out.strip() == str(root / "step_00000006")

    assert _bcp("prune", str(root), "--keep-last", "2", "--keep-every", "4", "--dry-run") == 0
    assert sorted(os.listdir(root)) == ["latest"] + [f"step_0000000{i}" for i in range(1, 8)]
    assert _bcp("prune", str(root), "--keep-last", "2", "--keep-every", "4") == 0
    assert sorted(os.listdir(root)) == ["latest", "step_00000004", "step_00000005", "step_00000006", "step_00000007"]
    assert _bcp("latest", str(tmp_path / "empty")) == 1


def test_prune_names_what_it_could_not_delete_and_exits_1(tmp_path, capsys):
    """A checkpoint prune cannot delete is named on stderr with the file and the reason, the others are
    deleted, and the exit status is 1 (before, errors were ignored and it printed "removed")."""
    root = tmp_path / "root"
    model, _ = _small_state()
    for step in (1, 2, 3):
        bcp.save(str(root), {"model": model}, step=step).wait()
    stuck = next((root / "step_00000001" / "data").iterdir())
    for f in [*(root / "step_00000001").iterdir(), *(root / "step_00000001" / "data").iterdir()]:
        os.utime(f, (time.time() - 2 * 3600,) * 2)  # an old checkpoint, as those pruned are
    if os.geteuid() == 0:  # root ignores permissions: make the file immutable
        if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
            pytest.skip("needs chattr +i (root ignores permissions)")
        undo = ["chattr", "-i", str(stuck)]
    else:
        os.chmod(stuck.parent, 0o500)
        undo = ["chmod", "0700", str(stuck.parent)]
    try:
        assert _bcp("prune", str(root), "--keep-last", "1") == 1
        out = capsys.readouterr()
        assert out.out.strip() == "removed: step_00000002; kept: step_00000003"
        assert out.err.startswith("bcp prune: could not remove step_00000001: ") and str(stuck) in out.err, out.err
        # half removed, it keeps its old files: the next prune tries it again
        assert _bcp("prune", str(root), "--keep-last", "1", "--json") == 1
        [failed] = json.loads(capsys.readouterr().out)["failed"]
        assert failed["name"] == "step_00000001" and str(stuck) in failed["error"]
    finally:
        subprocess.run(undo, check=True)
    assert _bcp("prune", str(root), "--keep-last", "1") == 0
    assert sorted(os.listdir(root)) == ["latest", "step_00000003"]


def test_console_script_help(capsys):
    exe = os.path.join(os.path.dirname(sys.executable), "bcp")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "bcp_core"]
    out = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "examples:" in out.stdout and "export" in out.stdout
    with pytest.raises(SystemExit) as info:
        cli.main(["export", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "usage: bcp export" in out and "--rename" in out
    with pytest.raises(SystemExit) as info:
        cli.main(["export", "ckpt"])  # OUT and --to missing
    assert info.value.code == 2


def test_verify_checks_sharded_values(tmp_path, capsys):
    from bcp_core.shards import ObjectShard
    ckpt = tmp_path / "ckpt"
    state = {"model": {"w": torch.ones(3)},
             "dataloader": {"epoch": 1, "buf": ObjectShard({"tokens": list(range(50))}, (0,), (2,))}}
    bcp.save(str(ckpt), state).wait()
    assert _bcp("inspect", str(ckpt)) == 0
    assert "dataloader.buf: grid (2,), 1 shard(s)" in capsys.readouterr().out
    md = bcp.inspect(str(ckpt))
    shard = md.sharded_objects["dataloader.buf"].shards[0]
    _flip(ckpt / md.files[shard.file], shard.byte_offset + 5, 0x01)
    assert _bcp("verify", str(ckpt)) == 1
    out = capsys.readouterr().out
    assert "FAULT [checksum]" in out and "sharded value 'dataloader.buf' index [0]" in out


def test_streams_progress_on_stderr_and_json_on_stdout(tmp_path, capsys):
    """Results go to stdout (one JSON document with --json), the tqdm progress bar to stderr; TQDM_DISABLE
    and -q silence it; every command a script would parse answers --json (checked in this process:
    the command line's own process is exercised by the first three runs)."""
    root = tmp_path / "root"
    bcp.save(str(root), {"model": {"w": torch.arange(3 << 20, dtype=torch.float32)}}, step=5).wait()

    def run(*argv, env=None):
        return subprocess.run([sys.executable, "-m", "bcp_core", *argv], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **(env or {})})

    out = run("verify", str(root))
    assert out.returncode == 0 and out.stdout.startswith("OK: ") and len(out.stdout.splitlines()) == 1
    assert "verify" in out.stderr and "100%" in out.stderr and "12.0M" in out.stderr  # the bar, in bytes
    for quiet in (run("verify", str(root), env={"TQDM_DISABLE": "1"}), run("-q", "verify", str(root))):
        assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.startswith("OK: ")

    checks = {("verify",): lambda j: j["ok"] and j["checked_bytes"] == 12 << 20,
              ("ls",): lambda j: [c["step"] for c in j] == [5] and j[0]["latest"],
              ("latest",): lambda j: j == {"path": str(root / "step_00000005")},
              ("inspect",): lambda j: j["tensors"]["model.w"]["shape"] == [3 << 20],
              ("prune", "--keep-last", "1", "--dry-run"): lambda j: j == {"removed": [], "kept": ["step_00000005"],
                                                                        "dry_run": True, "failed": []},
              ("rename", "--rule", "^model\\.=net.", "--dry-run"): lambda j: j["renamed"] == {"model.w": "net.w"}}
    capsys.readouterr()
    for args, check in checks.items():
        rc = cli.main([args[0], str(root), *args[1:], "--json"])
        out = capsys.readouterr()
        assert rc == 0 and out.err == "", (args, out.err)
        assert check(json.loads(out.out)), (args, out.out)
