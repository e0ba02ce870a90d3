"""Files of a checkpoint root: durable before the commit, never written or removed through a link,
memory:// private to its user, prune bounded to the root and honest about failures, and the
leftovers of failed saves removed by the next successful save.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch

import bcp_core as bcp
from bcp_core import layout
from bcp_core.errors import StorageError
from bcp_core.storage import base, storage_for


def _save(path, step: int | None = None) -> None:
    value = float(step or 0)
    bcp.save(str(path), {"w": torch.full((16,), value), "b": torch.arange(4.0) + value}, step=step,
             async_save=False).wait()


def _loaded(path) -> float:
    target = {"w": torch.zeros(16), "b": torch.zeros(4)}
    bcp.load(str(path), target)
    return float(target["w"][0])


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@contextlib.contextmanager
def _undeletable(path):
    """`path` cannot be removed while inside: immutable for root (who ignores permissions), else its
    directory made read-only."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode != 0:
            pytest.skip("needs chattr +i (root ignores permissions)")
        undo = ["chattr", "-i", str(path)]
    else:
        os.chmod(os.path.dirname(path), 0o500)
        undo = ["chmod", "0700", os.path.dirname(path)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


# ----------------------------------------------------------------------------- durable before commit

def test_data_step_dir_and_root_are_durable_before_the_commit_record(tmp_path, monkeypatch):
    """Every data file, then `data/`, the step directory and the root are fsync'd before the metadata
    (the commit record) is written: after a power loss the committed checkpoint's files are there."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "root"
    _save(root, 1)
    monkeypatch.undo()

    ckpt = root / "step_00000001"
    commit = next(i for i, p in enumerate(synced) if os.path.basename(p).startswith("bcp_metadata.json"))
    data_dir = synced.index(str(ckpt / "data"))
    files = [i for i, p in enumerate(synced) if os.path.dirname(p) == str(ckpt / "data")]
    assert len(files) == len(os.listdir(ckpt / "data")) >= 1, synced
    assert max(files) < data_dir < commit, synced
    assert str(ckpt) in synced[:commit] and str(root) in synced[:commit], synced


# ----------------------------------------------------------------------------- no write through a link

def test_writes_never_follow_planted_links(tmp_path, monkeypatch):
    """A link planted where a data file, `data/` or a temporary file will be never redirects a write:
    files are made under a fresh name (O_CREAT|O_EXCL|O_NOFOLLOW) and renamed into place."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    ckpt = tmp_path / "ckpt"
    st = storage_for(str(ckpt))
    st.makedirs("data")

    os.symlink(victim, ckpt / "data" / "f.safetensors")  # in place of a data file: replaced, never written through
    w = st.open_writer("data/f.safetensors")
    w.write(memoryview(b"new bytes"))
    w.close()
    assert not os.path.islink(ckpt / "data" / "f.safetensors")
    assert (ckpt / "data" / "f.safetensors").read_bytes() == b"new bytes"

    os.symlink(victim, ckpt / f"bcp_metadata.json.tmp.{os.getpid()}")  # the temp name bcp used to write through
    st.write_atomic("bcp_metadata.json", b"{}")
    assert (ckpt / "bcp_metadata.json").read_bytes() == b"{}"
    assert victim.read_bytes() == b"precious"

    # A link in place of `data/` is refused, naming it; nothing lands where it points.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other = storage_for(str(tmp_path / "other"))
    other.makedirs()
    os.symlink(elsewhere, tmp_path / "other" / "data")
    with pytest.raises(StorageError, match=r"other/data is a symbolic link"):
        other.open_writer("data/f.safetensors")
    with pytest.raises(StorageError, match=r"other/data is a symbolic link"):
        other.write_atomic("data/x", b"1")
    assert os.listdir(elsewhere) == []

    # Temporary names: unique per call, in the documented pattern naming this host and process.
    renamed = []
    real_replace = os.replace

    def replace(src, dst, **kw):
        renamed.append(src)
        return real_replace(src, dst, **kw)
    monkeypatch.setattr(os, "replace", replace)
    st.write_atomic("latest", b"a")
    st.write_atomic("latest", b"b")
    monkeypatch.setattr(os, "replace", real_replace)
    temps = [base.parse_temp_name(n) for n in renamed]
    assert renamed[0] != renamed[1] and temps[0] == temps[1] == base.TempFile("latest", base.this_host(), os.getpid())

    # A link planted at the very temporary name is not opened (O_EXCL): the write fails, nothing changes.
    monkeypatch.setattr(base.secrets, "token_hex", lambda n: "deadbeef")
    os.symlink(victim, ckpt / base.temp_name("latest"))
    with pytest.raises(FileExistsError):
        st.write_atomic("latest", b"c")
    assert victim.read_bytes() == b"precious" and (ckpt / "latest").read_bytes() == b"b"


# ----------------------------------------------------------------------------- memory://

def test_memory_storage_is_private_to_its_user(tmp_path, monkeypatch):
    """memory:// directories are made 0700 (files 0600); an older 0755 base of ours is tightened; a base
    (or a directory below it) owned by another user, or a link, is refused naming it and its owner."""
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path))
    mem = tmp_path / "bcp-memory"
    mem.mkdir()
    os.chmod(mem, 0o755)  # as an earlier bcp left it
    st = storage_for("memory://job/ckpt")
    assert _mode(mem) == 0o700
    st.makedirs("data")
    w = st.open_writer("data/f")
    w.write(memoryview(b"x"))
    w.close()
    st.write_atomic("bcp_metadata.json", b"{}")
    for d in (mem / "job", mem / "job" / "ckpt", mem / "job" / "ckpt" / "data"):
        assert _mode(d) == 0o700, d
    assert _mode(mem / "job" / "ckpt" / "data" / "f") == _mode(mem / "job" / "ckpt" / "bcp_metadata.json") == 0o600
    os.chmod(mem / "job", 0o755)
    st.makedirs()
    assert _mode(mem / "job") == 0o700

    if os.geteuid() == 0:  # only root can give a directory away
        os.chown(mem / "job", 65534, 65534)
        with pytest.raises(StorageError, match=r"memory://job belongs to .*uid 65534.*not to this user"):
            st.makedirs("data")
        os.chown(mem / "job", 0, 0)
        os.chown(mem, 65534, 65534)
        with pytest.raises(StorageError, match=rf"{mem} belongs to .*uid 65534.*BCP_MEMORY_DIR"):
            storage_for("memory://job")
        os.chown(mem, 0, 0)

    os.rename(mem, tmp_path / "real")
    os.symlink(tmp_path / "real", mem)
    with pytest.raises(StorageError, match=rf"{mem} is a symbolic link"):
        storage_for("memory://job")


# ----------------------------------------------------------------------------- prune

def test_remove_superseded_keeps_the_tracker_and_newer_steps(tmp_path):
    """A root saved to again (Lightning's last.ckpt): once step 3 is committed, every older step
    directory goes, complete or not, and so do the files of a checkpoint bcp wrote into the root itself
    before step directories (its metadata first); the tracker and a newer step being written stay, and
    the root loads step 3."""
    root = tmp_path / "last.ckpt"
    _save(root)  # the earlier layout: the checkpoint's files in the root itself
    for step in (1, 3):
        _save(root, step)
    (root / "step_00000002").mkdir()  # a failed save
    (root / "step_00000004").mkdir()  # the next save, begun on other ranks
    assert _loaded(root) == 0.0  # the files in the root itself hide the steps until they go
    result = layout.remove_superseded(str(root), "step_00000003")
    assert result.removed[0] == "bcp_metadata.json" and not result.failed
    assert {"data", "step_00000001", "step_00000002"} <= set(result.removed)
    assert sorted(os.listdir(root)) == ["latest", "step_00000003", "step_00000004"]
    assert _loaded(root) == 3.0
    with pytest.raises(ValueError, match="not a step directory name"):
        layout.remove_superseded(str(root), "last")


def test_remove_checkpoint_removes_what_is_there_whole_and_follows_no_link(tmp_path):
    outside = tmp_path / "outside"
    _save(outside)
    root = tmp_path / "step=4.ckpt"
    _save(root, 1)
    os.symlink(outside, root / "step_00000002")
    layout.remove_checkpoint(str(root))
    assert not root.exists() and _loaded(outside) == 0.0
    layout.remove_checkpoint(str(root))  # missing: no error
    plain = tmp_path / "plain.ckpt"  # a file of Lightning's own format
    plain.write_bytes(b"torch")
    layout.remove_checkpoint(str(plain))
    assert not plain.exists()


def test_prune_never_leaves_the_root(tmp_path):
    """A symlinked step directory is removed as a link: the checkpoint it points at keeps its metadata
    (before, prune deleted it). Links inside a removed checkpoint are removed, not followed."""
    outside = tmp_path / "outside"
    _save(outside)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "step_00000001")
    for step in (2, 3, 4):
        _save(root, step)
    kept_outside = tmp_path / "kept"
    kept_outside.mkdir()
    (kept_outside / "f").write_bytes(b"1")
    os.symlink(kept_outside, root / "step_00000002" / "data" / "link")

    result = layout.prune(str(root), keep_last=2)
    assert result == layout.Removal(("step_00000001", "step_00000002"), ("step_00000003", "step_00000004"), ())
    assert sorted(os.listdir(root)) == ["latest", "step_00000003", "step_00000004"]
    assert (outside / "bcp_metadata.json").exists() and _loaded(outside) == 0.0
    assert (kept_outside / "f").read_bytes() == b"1"
    assert _loaded(root) == 4.0


def test_prune_reports_what_it_could_not_delete_and_keeps_the_tracker(tmp_path):
    """A checkpoint that cannot be removed is reported with the file and the reason (before, rmtree
    ignored errors and prune said "removed"); the others are still removed. The one the tracker
    names, even incomplete, and the newest complete one are never removed."""
    root = tmp_path / "root"
    for step in (1, 2, 3, 4, 5):
        _save(root, step)
    (root / "step_00000004" / "bcp_metadata.json").unlink()
    (root / "latest").write_text("step_00000004")  # the tracker names an incomplete checkpoint
    stuck = next((root / "step_00000002" / "data").iterdir())
    with _undeletable(stuck):
        result = layout.prune(str(root), keep_last=1)
        assert result.removed == ("step_00000001", "step_00000003")
        assert result.kept == ("step_00000004", "step_00000005")
        [(name, why)] = result.failed
        assert name == "step_00000002" and str(stuck) in why, why
    assert sorted(os.listdir(root)) == ["latest", "step_00000002", "step_00000004", "step_00000005"]
    assert not (root / "step_00000002" / "bcp_metadata.json").exists()  # metadata first: never half a checkpoint
    assert _loaded(root) == 5.0
    # without its metadata, a fresh checkpoint could be a save in progress; a pruned one is old
    assert layout.prune(str(root), keep_last=1).removed == ()
    hours_ago = time.time() - 2 * 3600
    for f in (root / "step_00000002" / "data").iterdir():
        os.utime(f, (hours_ago, hours_ago))
    assert layout.prune(str(root), keep_last=1).removed == ("step_00000002",)


def test_prune_on_memory_storage_with_hf_naming(tmp_path, monkeypatch):
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path))
    root = "memory://hf-run"
    for step in (10, 20, 30):
        _save(f"{root}/checkpoint-{step}")
    storage_for(root).makedirs("checkpoint-40/data")  # a save in progress
    result = layout.prune(root, keep_last=2, naming=layout.HF_STEPS)
    assert result == layout.Removal(("checkpoint-10",), ("checkpoint-20", "checkpoint-30", "checkpoint-40"), ())
    assert sorted(os.listdir(tmp_path / "bcp-memory" / "hf-run")) == ["checkpoint-20", "checkpoint-30", "checkpoint-40"]
    # older than the next commit, but written just now: perhaps another job's save in progress
    assert layout.remove_leftovers(root, "checkpoint-50", naming=layout.HF_STEPS).removed == ()
    hours_ago = time.time() - 2 * 3600
    for d in ("checkpoint-40", "checkpoint-40/data"):
        os.utime(tmp_path / "bcp-memory" / "hf-run" / d, (hours_ago, hours_ago))
    assert layout.remove_leftovers(root, "checkpoint-50", naming=layout.HF_STEPS).removed == ("checkpoint-40",)


# ----------------------------------------------------------------------------- leftovers of failed saves

_DIE = """
import os, signal, sys
import torch
import bcp_core as bcp
from bcp_core.storage.faults import Fault, inject

root, point, step = sys.argv[1], sys.argv[2], int(sys.argv[3])

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if point == "tracker":  # after the commit, between writing the tracker's temporary file and renaming it
    real_replace = os.replace
    def replace(src, dst, **kwargs):
        if os.path.basename(dst) == "latest":
            die()
        return real_replace(src, dst, **kwargs)
    os.replace = replace
else:  # while writing a data file
    inject(Fault("write", hook=die))
bcp.save(root, {"w": torch.full((16,), float(step)), "b": torch.arange(4.0) + step}, step=step, async_save=False)
"""


def _die_saving(root, point: str, step: int) -> int:
    """Run a process that dies (SIGKILL) at `point` of saving `step`; its pid."""
    with subprocess.Popen([sys.executable, "-c", _DIE, str(root), point, str(step)], stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == -9, err
    return proc.pid


def test_next_save_removes_leftovers_of_failed_saves(tmp_path):
    """Processes killed mid-save leave a step directory without metadata and temporary files; the next
    successful save on the root removes them. What may belong to a save in progress stays: a newer step
    directory, a temporary file of a process still running here, a fresh one from another host."""
    root = tmp_path / "root"
    _save(root, 1)
    dead = _die_saving(root, "tracker", 2)  # step 2 committed; the tracker's temporary file is left
    _die_saving(root, "data", 3)            # step 3 half written, its data file still a temporary file
    assert [n for n in os.listdir(root) if n.startswith("latest.")]  # the tracker's temporary file
    assert os.listdir(root / "step_00000003" / "data")

    host = base.this_host()
    (root / "step_00000004" / "data").mkdir(parents=True)  # an earlier crashed save to the step saved next
    (root / "step_00000004" / "data" / f"x.safetensors.bcp-tmp.{host}.{dead}.0123abcd").write_bytes(b"0")
    (root / f"latest.bcp-tmp.{host}.{os.getpid()}.0123abcd").write_bytes(b"live")  # a writer still running
    (root / "latest.bcp-tmp.otherhost.42.0123abcd").write_bytes(b"fresh")          # another host's, recent
    old = root / "latest.bcp-tmp.otherhost.43.0123abcd"
    old.write_bytes(b"old")
    hours_ago = os.stat(old).st_mtime - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    (root / "step_00000009" / "data").mkdir(parents=True)  # a newer save, perhaps in progress
    outside = tmp_path / "outside"
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "f").write_bytes(b"1")
    os.symlink(outside, root / "step_00000000")  # a linked step without metadata: the link goes, not its files

    _save(root, 4)

    assert sorted(os.listdir(root)) == sorted([
        "latest", f"latest.bcp-tmp.{host}.{os.getpid()}.0123abcd", "latest.bcp-tmp.otherhost.42.0123abcd",
        "step_00000001", "step_00000002", "step_00000004", "step_00000009"])
    assert not [n for n in os.listdir(root / "step_00000004" / "data") if ".bcp-tmp." in n]
    assert (outside / "data" / "f").read_bytes() == b"1"
    assert (root / "latest").read_text() == "step_00000004" and _loaded(root) == 4.0
    assert _loaded(root / "step_00000002") == 2.0


def test_own_failed_save_goes_at_the_next_commit_another_jobs_save_in_progress_stays(tmp_path):
    """A failed save leaves its directory marked failed (bcp_failed.json, naming the save and the
    error): the next commit removes it. A directory of an older step that another job is writing right
    now (fresh, no temporary file of a dead writer, no mark) stays: removing it would fail that job's
    save."""
    from bcp_core.storage.faults import Fault, inject
    root = tmp_path / "root"
    _save(root, 1)
    with inject(Fault("open_writer", error=OSError(28, "No space left on device"))):
        with pytest.raises(bcp.SaveError, match="No space left"):
            _save(root, 3)
    assert not (root / "step_00000003" / "bcp_metadata.json").exists()
    mark = json.loads((root / "step_00000003" / "bcp_failed.json").read_text())
    assert "step 3" in mark["save"] and "No space left" in mark["error"], mark
    with pytest.raises(bcp.IncompleteCheckpointError, match="its save failed.*No space left"):
        bcp.load(str(root / "step_00000003"), {"w": torch.zeros(16), "b": torch.zeros(4)})
    (root / "step_00000002" / "data").mkdir(parents=True)  # another job's save of step 2, under way
    (root / "step_00000002" / "data" / "f00dbabe-1-r0_0.safetensors").write_bytes(b"written just now")
    _save(root, 4)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == [
        "step_00000001", "step_00000002", "step_00000004"]
    assert _loaded(root) == 4.0
