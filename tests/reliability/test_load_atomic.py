"""A load is all or nothing for the caller, and its waits are bounded.

A load that fails (a corrupted block, a missing data file, a missing key, a rank that never comes)
leaves the caller's tensors, containers, optimizer state, values and per-rank values exactly as
they were, on every rank of a collective load; a collective load ends in an error naming the rank
that failed, within its timeout. Loads read from memory maps (local files), from memory within the
staging budget (S3) and in two passes beyond it (S3, budget 0).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import threading
import uuid
from datetime import timedelta

import pytest
import torch
from torch import nn

import bcp_core as bcp
from bcp_core import staging
from bcp_core.dataloader import OpaqueLoader, PackedTokenLoader
from bcp_core.load_config import LOAD_CONFIG
from bcp_core.errors import ChecksumError, KeyMismatchError
from bcp_core.storage import storage_for
from dist import mark, run_ranks, wait_for_file
from test_storage import BUCKET, s3  # noqa: F401 - the moto S3 server fixture

# ----------------------------------------------------------------------------- helpers


def _bits(t: torch.Tensor) -> bytes:
    """A tensor's exact bytes (a DTensor's local shard)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _frozen(x):
    """A deep copy of a state in comparable form: tensors as (dtype, shape, bytes), modules and
    optimizers as their state dicts, containers with their keys."""
    if isinstance(x, nn.Module):
        return {"module": _frozen(dict(x.state_dict()))}
    if isinstance(x, torch.optim.Optimizer):
        return {"optimizer": _frozen(x.state_dict())}
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape), _bits(x))
    if isinstance(x, dict):
        return {k: _frozen(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_frozen(v) for v in x)
    return copy.deepcopy(x)


def _flip(path: str, file: str, pos: int) -> None:
    """Flip one bit of byte `pos` of the checkpoint's data file (local or S3)."""
    st = storage_for(path)
    if st.remote:
        data = bytearray(st.read_bytes(file))
        data[pos] ^= 0x10
        st.write_atomic(file, bytes(data))
        return
    with open(os.path.join(path, file), "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ 0x10]))


def _last_piece(path: str) -> tuple[str, int]:
    """(file, last byte) of the last piece of the last data file: the other tensors are sound."""
    md = bcp.inspect(path)
    file, off, n = max((md.files[p.file], p.byte_offset, p.nbytes) for t in md.tensors.values() for p in t.pieces)
    return file, off + n - 1


# ----------------------------------------------------------------------------- one process

def _training(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optim


def _step(model, optim, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 32, generator=g)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _single_state(model, optim, step: int) -> dict:
    return {"model": model, "optimizer": optim,
            "run": {"step": step, "lr": 0.1 * step, "note": f"step {step}", "sched": {"milestones": [step]}},
            "buffers": {"ema": torch.full((300,), float(step)), "count": torch.tensor(step)},
            "extra_state": {"step": step}}


@pytest.fixture(params=["local", "s3", "s3-two-pass"])
def where(request, tmp_path, monkeypatch):
    """A checkpoint path: a local directory (memory maps), S3 within the buffer budget, or S3 with a
    budget of 0 (each tensor verified in a first pass, read into place in a second)."""
    if request.param == "local":
        return str(tmp_path / "ck")
    request.getfixturevalue("s3")
    if request.param == "s3-two-pass":
        monkeypatch.setattr(LOAD_CONFIG, "buffer_bytes", 0)
    return f"s3://{BUCKET}/atomic-{uuid.uuid4().hex[:8]}"


def test_a_corrupted_block_fails_the_load_and_changes_nothing(where):
    model, optim = _training(0)
    _step(model, optim, 0)
    bcp.save(where, _single_state(model, optim, 1)).wait()

    # the checkpoint loads, into a fresh state
    fresh_model, fresh_optim = _training(5)
    fresh = _single_state(fresh_model, fresh_optim, 0)
    bcp.load(where, fresh)
    assert _frozen(fresh) == _frozen(_single_state(model, optim, 1))

    # training went on: the live state differs from the checkpoint everywhere
    _step(model, optim, 1)
    live = _single_state(model, optim, 2)
    del live["run"]["note"], live["run"]["sched"]  # keys the load would add to this dict
    unstepped_model, unstepped_optim = _training(7)  # an optimizer without state yet
    unstepped = _single_state(unstepped_model, unstepped_optim, 3)
    before, before_unstepped = _frozen(live), _frozen(unstepped)

    file, pos = _last_piece(where)
    _flip(where, file, pos)
    for target in (live, unstepped):
        with pytest.raises(ChecksumError, match=rf"checksum mismatch in {file}"):
            bcp.load(where, target)
    assert _frozen(live) == before
    assert _frozen(unstepped) == before_unstepped
    assert not unstepped_optim.state  # no optimizer state was created


def test_a_file_changed_between_the_two_passes_is_detected(s3, monkeypatch):  # noqa: F811
    """Beyond the buffer budget a tensor is read twice: a change in between fails the second read."""
    monkeypatch.setattr(LOAD_CONFIG, "buffer_bytes", 0)
    path = f"s3://{BUCKET}/changed-{uuid.uuid4().hex[:8]}"
    bcp.save(path, {"w": torch.arange(1000.0)}).wait()
    file, pos = _last_piece(path)
    from bcp_core import loader
    first_pass_done = loader.finish_lazy_copies  # called once every read is verified, before the writes

    def change_then_write():
        _flip(path, file, pos)
        first_pass_done()
    monkeypatch.setattr(loader, "finish_lazy_copies", change_then_write)
    target = {"w": torch.zeros(1000)}
    with pytest.raises(ChecksumError, match="changed after this load had verified it"):
        bcp.load(path, target)


def test_a_strict_load_with_a_missing_key_leaves_dicts_untouched(tmp_path):
    path = str(tmp_path / "ck")
    bcp.save(path, {"a": torch.ones(3), "d": {"x": 1, "sub": {"y": 2}, "other": {"z": 3}}}).wait()
    target = {"a": torch.zeros(3), "d": {"x": 5, "other": 7}, "missing": torch.zeros(2)}
    before = _frozen(target)
    with pytest.raises(KeyMismatchError, match="missing"):
        bcp.load(path, target)
    assert _frozen(target) == before  # no "sub" dict made, "other" not replaced by one, x still 5


def test_a_load_into_a_module_waits_for_the_lazy_snapshot_of_a_save_in_flight(tmp_path, monkeypatch):
    """The save's writer is held before it takes any piece; the load must not write the parameters
    until the save has its copy of them."""
    model, optim = _training(0)
    other, _ = _training(1)
    bcp.save(str(tmp_path / "other"), {"model": other}).wait()
    bcp.save(str(tmp_path / "ref"), {"model": model}).wait()

    go = threading.Event()
    hold = staging.LazyCopy.hold

    @contextlib.contextmanager
    def held_hold(lazy, buf):
        assert go.wait(60), "the writer was never let go"
        with hold(lazy, buf) as t:
            yield t
    monkeypatch.setattr(staging.LazyCopy, "hold", held_hold)
    handle = bcp.save(str(tmp_path / "async"), {"model": model}, async_save=True)
    bcp.load(str(tmp_path / "other"), {"model": model})
    go.set()
    handle.wait()
    assert _frozen(model) == _frozen(other)  # the load happened
    saved, ref = _training(2)[0], _training(3)[0]
    bcp.load(str(tmp_path / "async"), {"model": saved})
    bcp.load(str(tmp_path / "ref"), {"model": ref})
    assert _frozen(saved) == _frozen(ref)  # the save holds the values of its call


class _Position:
    """A stateful loader of the simplest kind (wrapped as an OpaqueLoader)."""

    def __init__(self, pos: int):
        self.pos = pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


@pytest.mark.parametrize("kind", ["packed", "opaque"])
def test_a_damaged_dataloader_shard_fails_the_load_before_anything_changes(tmp_path, kind):
    """A dataloader's sharded state (its units, or an opaque loader's state per DP rank) is read and
    verified with everything else, before anything changes: a damaged shard fails the load with the
    model, the optimizer and the loader as they were."""
    def loader(pos: int):
        if kind == "opaque":
            return OpaqueLoader(_Position(pos), 0, 1)
        packed = PackedTokenLoader({"web": [list(range(d * 100, d * 100 + 7)) for d in range(20)]}, 4, 2, seed=3)
        for _ in itertools.islice(packed, pos):
            pass
        return packed

    path = str(tmp_path / "ck")
    model, optim = _training(0)
    _step(model, optim, 0)
    bcp.save(path, {"model": model, "optimizer": optim, "dataloader": loader(3)}).wait()
    shard = bcp.inspect(path).sharded_objects["dataloader.units.0" if kind == "packed" else "dataloader.rank"].shards[0]
    _flip(path, bcp.inspect(path).files[shard.file], shard.byte_offset + shard.nbytes - 1)

    live_model, live_optim = _training(1)
    _step(live_model, live_optim, 1)
    live = {"model": live_model, "optimizer": live_optim, "dataloader": loader(5)}
    before, position = _frozen([live_model, live_optim]), repr(live["dataloader"].state_dict())
    with pytest.raises(ChecksumError, match="of 'dataloader"):
        bcp.load(path, live)
    assert _frozen([live_model, live_optim]) == before and repr(live["dataloader"].state_dict()) == position


# ----------------------------------------------------------------------------- two ranks

# The loads' timeout where it is not what a case tests: only a bound on a regression that would
# leave a rank waiting (the cases check that ranks are told, not timed out), never reached by a
# rank that is merely slow.
TIMEOUT = timedelta(seconds=120)


def _fsdp2_state(step: int, optimizer: bool = True) -> dict:
    from layouts import build, train
    model, optim = build("fsdp2", seed=0)
    train(model, optim, range(step))
    return {"model": model, "optimizer": optim, "run": {"step": step}} if optimizer else {"model": model}


def _replicated_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": {f"t{i}": torch.randn(256, 64, generator=g) for i in range(4)}, "step": step}


def _last_model_piece(path: str, rank: int) -> tuple[str, int]:
    """(file, last byte) of the last piece of the model that `rank` wrote: a Shard(0) piece only
    that rank reads when loading into the same layout."""
    md = bcp.inspect(path)
    file, off, n = max((md.files[p.file], p.byte_offset, p.nbytes) for fqn, t in md.tensors.items()
                       if fqn.startswith("model.") for p in t.pieces if p.rank == rank)
    return file, off + n - 1


def _attempt(fn) -> str | None:
    """The failed load's error as "Class: message", or None if it did not fail."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reports it
        return f"{type(e).__name__}: {e}"
    return None


def _two_ranks(rank, world_size, root, s3_root):
    import torch.distributed as dist

    from bcp_core.metadata import METADATA_FILE
    from bcp_core.storage.faults import Fault, inject

    out: dict = {}
    path = f"{root}/fsdp2"
    bcp.save(path, _fsdp2_state(1)).wait()
    bcp.save(f"{root}/fsdp2_good", _fsdp2_state(1)).wait()
    live = _fsdp2_state(2)
    before = _frozen(live)

    # A good collective load: the metadata file is read by rank 0 only.
    reads: list[str] = []
    with inject(Fault("read_bytes", hook=lambda call: reads.append(call.path))):
        good = _fsdp2_state(0)
        bcp.load(path, good, share_reads=True, timeout=TIMEOUT)
    out["metadata_reads"] = reads.count(f"{path}/{METADATA_FILE}")
    out["loaded"] = _frozen(good) == _frozen(_fsdp2_state(1))

    # A corrupted block that only rank 1 reads and verifies: both ranks fail, neither changes. (Rank 1
    # may still be copying the good load's verified bytes from its memory map: flip after it is done.)
    dist.barrier()
    if rank == 0:
        out["corrupt_file"] = _last_model_piece(path, 1)[0]
        _flip(path, *_last_model_piece(path, 1))
    dist.barrier()
    out["corrupt"] = _attempt(lambda: bcp.load(path, live, share_reads=True, timeout=TIMEOUT))
    out["corrupt_unchanged"] = _frozen(live) == before

    # S3 (bytes read once and sent): rank 1's data file is gone, rank 1 fails, rank 0 hears of it.
    s3_path = f"{s3_root}/fsdp2"
    bcp.save(s3_path, _fsdp2_state(1, optimizer=False)).wait()
    model_only = _fsdp2_state(2, optimizer=False)
    model_before = _frozen(model_only)
    if rank == 0:
        out["missing_file"] = _last_model_piece(s3_path, 1)[0]
        storage_for(s3_path).remove(out["missing_file"])
    dist.barrier()
    out["missing"] = _attempt(lambda: bcp.load(s3_path, model_only, share_reads=True, timeout=TIMEOUT))
    out["missing_unchanged"] = _frozen(model_only) == model_before

    # Replicated tensors: each range is read by one rank and sent to the other. With a file gone its
    # owners cannot read it: their receivers must not wait for it.
    rep_path = f"{s3_root}/replicated"
    bcp.save(rep_path, _replicated_state(1)).wait()
    rep = _replicated_state(2)
    rep_before = _frozen(rep)
    out["replicated"] = _attempt(lambda: bcp.load(rep_path, rep, share_reads=True, timeout=TIMEOUT))
    out["replicated_loaded"] = _frozen(rep) == _frozen(_replicated_state(1))
    rep = _replicated_state(2)
    dist.barrier()  # both ranks are done with the load above before its file goes
    if rank == 0:
        out["owner_file"] = bcp.inspect(rep_path).files[0]
        storage_for(rep_path).remove(out["owner_file"])
    dist.barrier()
    out["owner_failed"] = _attempt(lambda: bcp.load(rep_path, rep, share_reads=True, timeout=TIMEOUT))
    out["owner_failed_unchanged"] = _frozen(rep) == rep_before

    # An owner stalls (rank 1's reads wait until rank 0 has given up on them): rank 0 stops waiting
    # for it after the 3 s it tests. Rank 1 is in the load before rank 0 starts (an event), so rank 0
    # waits only for the stalled reads; rank 1's own timeout is longer, never reached first.
    stall_path = f"{s3_root}/stalled"
    bcp.save(stall_path, _replicated_state(1)).wait()
    in_load, given_up = os.path.join(root, "stalled_load_entered"), os.path.join(root, "stalled_load_given_up")
    if rank == 1:
        with inject(Fault("read_into", hook=lambda call: wait_for_file(given_up), path=f"{stall_path}/*")):
            mark(in_load)
            out["stalled"] = _attempt(lambda: bcp.load(stall_path, rep, share_reads=True,
                                                       timeout=timedelta(seconds=10)))
    else:
        wait_for_file(in_load)
        out["stalled"] = _attempt(lambda: bcp.load(stall_path, rep, share_reads=True, timeout=timedelta(seconds=3)))
        mark(given_up)
    out["stalled_unchanged"] = _frozen(rep) == rep_before
    dist.barrier()

    # Last, as the ranks' collective loads are out of step afterwards: rank 1 never comes to the load.
    if rank == 0:
        out["absent"] = _attempt(lambda: bcp.load(f"{root}/fsdp2_good", live, share_reads=True,
                                                  timeout=timedelta(seconds=2)))
        out["absent_unchanged"] = _frozen(live) == before
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, s3):  # noqa: F811
    root = tmp_path_factory.mktemp("atomic")
    s3_root = f"s3://{BUCKET}/atomic2-{uuid.uuid4().hex[:8]}"
    return run_ranks(2, _two_ranks, str(root), s3_root, timeout=300)


def test_a_collective_load_reads_the_metadata_once(two_ranks):
    assert [r["metadata_reads"] for r in two_ranks] == [1, 0]
    assert all(r["loaded"] for r in two_ranks)


def test_a_block_corrupted_on_another_ranks_share_fails_every_rank_and_changes_nothing(two_ranks):
    file = two_ranks[0]["corrupt_file"]
    assert two_ranks[1]["corrupt"].startswith(f"ChecksumError: checksum mismatch in {file}"), two_ranks[1]
    assert two_ranks[0]["corrupt"].startswith("ChecksumError: rank 1 found a corrupted block"), two_ranks[0]
    assert file in two_ranks[0]["corrupt"]
    assert all(r["corrupt_unchanged"] for r in two_ranks)


def test_a_missing_data_file_on_one_rank_fails_every_rank_naming_it(two_ranks):
    file = two_ranks[0]["missing_file"]
    assert two_ranks[1]["missing"].startswith("StorageError: ") and file in two_ranks[1]["missing"], two_ranks[1]
    assert two_ranks[0]["missing"].startswith("StorageError: rank 1 failed its part of this load"), two_ranks[0]
    assert file in two_ranks[0]["missing"]
    assert all(r["missing_unchanged"] for r in two_ranks)


def test_an_owner_that_cannot_read_a_range_fails_its_receivers_instead_of_leaving_them_waiting(two_ranks):
    assert [r["replicated"] for r in two_ranks] == [None, None]
    assert all(r["replicated_loaded"] for r in two_ranks)
    file = two_ranks[0]["owner_file"]
    for r in two_ranks:
        assert r["owner_failed"].startswith("StorageError: ") and file in r["owner_failed"], r
        assert r["owner_failed_unchanged"]


def test_a_stalled_owner_ends_in_a_timeout_naming_it(two_ranks):
    stalled = two_ranks[0]["stalled"]
    assert stalled.startswith("CommTimeoutError: ") and "transfer" in stalled and "rank 1" in stalled, stalled
    assert two_ranks[1]["stalled"] is not None
    assert all(r["stalled_unchanged"] for r in two_ranks)


def test_a_collective_load_without_one_rank_times_out_naming_it(two_ranks):
    absent = two_ranks[0]["absent"]
    assert absent.startswith("CommTimeoutError: ") and "rank(s) [1]" in absent, absent
    assert two_ranks[0]["absent_unchanged"]

