"""Tiered checkpoints (bcp_core/tiers/): the policy, the placement of replicas, and the whole path on
gloo ranks split into simulated nodes (`BCP_LOCAL_WORLD_SIZE`), each node with a memory directory
of its own: every piece with k + 1 copies, retention, the drain to an ordinary durable checkpoint,
a failed replica failing the save everywhere, recovery after a lost node at other world sizes, a
damaged copy set aside (and a whole one kept), a failed recovery leaving the state untouched,
node-local directories at another path per node, views of ended loads removed, a drain's
retention kept out while a step is confirmed, failure domains, a resumed job leaving a timeline.
The kill-a-node cases under torchrun are in reliability/test_tiers_multinode.py."""

from __future__ import annotations

import os

import pytest
import torch

import bcp_core as bcp
from bcp_core.tiers.placement import PlacementError, nodes_of, place
from dist import bcp_verify, run_ranks
from tiered_state import COLS, ROWS, advance, expected, flip_last_byte, initial


# ----------------------------------------------------------------------------- policy and placement

def test_policy_refuses_what_cannot_work():
    for kwargs, words in [
        ({"memory": "s3://bucket/x"}, "each node's own storage"),
        ({"memory": "memory://x", "durable": "memory://y", "persist_every": 2}, "not memory://"),
        ({"memory": "memory://x", "durable": "/d"}, "go together"),
        ({"memory": "memory://x", "persist_every": 2}, "go together"),
        ({"memory": "memory://x", "replicas": -1}, "replicas=-1"),
        ({"memory": "memory://x", "keep_in_memory": 0}, "keep_in_memory=0"),
        ({"memory": "memory://x", "bandwidth": 0}, "bandwidth=0"),
        ({"memory": "memory://x", "failure_domain": ""}, "failure_domain=''"),
        ({"memory": "memory://x", "keep_durable": 3}, "keep_durable=3. without durable"),
    ]:
        with pytest.raises(ValueError, match=words):
            bcp.Tiers(**kwargs)
    with pytest.raises(ValueError, match="needs a step"):
        bcp.save(bcp.Tiers("memory://x"), {"w": torch.zeros(2)})


def test_placement_spreads_replicas_over_nodes_and_failure_domains():
    ring = place(nodes_of([0, 0, 1, 1, 2, 2]), [None] * 3, 1)
    assert ring.replica_nodes == ((1,), (2,), (0,))
    assert ring.destinations(0) == [2] and ring.destinations(5) == [1] and ring.sources(2) == [0]
    everywhere = place(nodes_of([0, 1, 2, 3]), [None] * 4, 3)
    assert [set(r) for r in everywhere.replica_nodes] == [{1, 2, 3}, {0, 2, 3}, {0, 1, 3}, {0, 1, 2}]
    racks = place(nodes_of(range(8)), ["a"] * 4 + ["b"] * 4, 1)  # never in the same rack, and evenly
    assert racks.replica_nodes == ((4,), (5,), (6,), (7,), (0,), (1,), (2,), (3,))
    uneven = place(nodes_of([0, 0, 0, 1]), [None, None], 1)  # 3 ranks send to node 1's one rank
    assert [uneven.destinations(r) for r in range(4)] == [[3], [3], [3], [0]] and uneven.sources(3) == [0, 1, 2]
    with pytest.raises(PlacementError, match="needs at least 3 nodes"):
        place(nodes_of([0, 1]), [None, None], 2)
    with pytest.raises(PlacementError, match="needs 3 failure domains"):
        place(nodes_of(range(4)), ["a", "a", "b", "b"], 2)
    with pytest.raises(PlacementError, match=r"not on node\(s\) \[1\]"):
        place(nodes_of(range(2)), ["a", None], 1)


# ----------------------------------------------------------------------------- on gloo ranks

def _on_node(rank: int, base: str, names: list[str] | None = None) -> str:
    """This rank's simulated node's memory directory (as each machine has its own RAM)."""
    node = rank // int(os.environ.get("BCP_LOCAL_WORLD_SIZE") or 1)
    name = names[node] if names else str(node)
    os.environ["BCP_MEMORY_DIR"] = os.path.join(base, f"mem{name}")
    os.makedirs(os.environ["BCP_MEMORY_DIR"], exist_ok=True)
    return name


def _tiers(base: str, **kw) -> bcp.Tiers:
    kw = {"durable": os.path.join(base, "durable"), "persist_every": 2, "keep_in_memory": 2, **kw}
    return bcp.Tiers("memory://job", **kw)


def _same_rng() -> dict:
    """Per-rank state every rank holds alike (each seeded the same): its metadata names rank 0's
    piece only, though every rank wrote its own into its data file."""
    torch.manual_seed(1234)
    return {"rng": torch.get_rng_state()}


def _save(rank, world, base, steps, part_bytes=None, fail_receive_at=None, names=None, domains=None, rng=False):
    """Train and save every step; `fail_receive_at`: (rank, step) whose receiving of replicas fails;
    `rng`: with `_same_rng` as extra_state."""
    from torch.distributed.device_mesh import init_device_mesh

    from bcp_core.tiers import transport
    _on_node(rank, base, names)
    if domains:
        os.environ["BCP_FAILURE_DOMAIN"] = domains[rank]
    if part_bytes:  # files and ranges travel in several parts
        transport.PART_BYTES = part_bytes
    if fail_receive_at and fail_receive_at[0] == rank:  # its memory fills up with another rank's replicas
        import errno

        from bcp_core.storage.faults import Fault, inject

        def full(call):  # in the middle of a replica: its own files still fit
            if f"-r{rank}_" not in call.path:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
        inject(Fault("write", hook=full, path=f"*/step_{fail_receive_at[1]:08d}/data/*"))
    state = initial(init_device_mesh("cpu", (world,)))
    if rng:
        state["extra_state"] = _same_rng()
    tiers, errors = _tiers(base), {}
    for step in steps:
        advance(state, step)
        try:
            bcp.save(tiers, state, step=step, async_save=True).wait()
        except bcp.SaveError as e:
            errors[step] = str(e)
    return errors


def _load(rank, world, base, names=None, sentinel=False, tiers_kw=None, rng=False):
    """Load the tiers into this world size; the step, tier and whether every row is the expected one
    (with `sentinel`: the load must fail, and the state stay as it was; `rng`: as `_save`'s)."""
    from torch.distributed.device_mesh import init_device_mesh
    _on_node(rank, base, names)
    state = initial(init_device_mesh("cpu", (world,)))
    state["w"].to_local().fill_(-1.0)
    if rng:
        state["extra_state"] = {"rng": torch.zeros_like(_same_rng()["rng"])}
    before = {k: (v.to_local().clone() if hasattr(v, "to_local") else v) for k, v in state.items()}
    try:
        result = bcp.load(_tiers(base, **(tiers_kw or {})), state)
    except bcp.BCPError as e:
        same = all(torch.equal(state[k].to_local(), before[k]) if hasattr(state[k], "to_local") else
                   (torch.equal(state[k], before[k]) if isinstance(state[k], torch.Tensor) else state[k] == before[k])
                   for k in state)
        return type(e).__name__, str(e), same
    want = expected(result.step)
    rows = ROWS // world
    ok = all(torch.equal(state[k].to_local(), want[k][rank * rows:(rank + 1) * rows]) for k in ("w", "exp_avg"))
    ok = ok and (not rng or torch.equal(state["extra_state"]["rng"], _same_rng()["rng"]))
    return result.step, result.tier, ok and torch.equal(state["bias"], want["bias"]) and state["step"] == result.step


def _steps(mem) -> dict[int, set[str]]:
    """A node's memory tier: step -> its committed data files (None: no metadata)."""
    root = mem / "bcp-memory" / "job"
    out = {}
    for d in sorted(root.iterdir()) if root.exists() else []:
        if d.name.startswith("step_"):
            out[int(d.name[5:])] = set(os.listdir(d / "data")) if (d / "bcp_metadata.json").exists() else None
    return out


def test_replicas_retention_drain_and_recovery_after_a_lost_node(tmp_path, monkeypatch):
    """2 nodes x 2 ranks, k = 1: each node holds every file of its newest 2 steps (steps 3 to 5 write
    into the files of the steps retired before them) and the files of the one retired last; steps 2
    and 4 are drained into ordinary checkpoints. Node 1 lost: 3 ranks on 3 nodes (two of them empty) load step
    5 from node 0's memory, every row bit for bit, in parts of 4 KiB."""
    base = str(tmp_path)
    monkeypatch.setenv("BCP_LOCAL_WORLD_SIZE", "2")
    assert run_ranks(4, _save, base, range(1, 6), 4096) == [{}] * 4
    mem0, mem1 = _steps(tmp_path / "mem0"), _steps(tmp_path / "mem1")
    assert set(mem0) == set(mem1) == {4, 5}, (mem0, mem1)  # step 2 and 4 left once drained and superseded
    for step in (4, 5):
        assert mem0[step] == mem1[step] and len(mem0[step]) == 4  # every rank's file on both nodes
    for node in ("mem0", "mem1"):
        assert not [n for n in os.listdir(tmp_path / node / "bcp-memory" / "job") if n.startswith(".bcp-")]
        # the files of the step retired last (3), which the next step's writes would overwrite: one step's
        assert set(os.listdir(tmp_path / node / "bcp-memory" / "job" / ".spare")) == \
            {f.rsplit("-", 1)[1] for f in mem0[5]}  # named by rank and index only (storage/memory.py)
    durable = str(tmp_path / "durable")
    assert [e.step for e in bcp.layout.list_checkpoints(durable) if e.complete] == [2, 4]
    bcp_verify(durable)
    full = {"w": torch.zeros(ROWS, COLS), "exp_avg": torch.zeros(ROWS, COLS), "bias": torch.zeros(4), "step": 0}
    assert bcp.load(durable, full).path.endswith("step_00000004")
    assert all(torch.equal(full[k], expected(4)[k]) for k in ("w", "exp_avg", "bias"))

    import shutil
    shutil.rmtree(tmp_path / "mem1")
    monkeypatch.setenv("BCP_LOCAL_WORLD_SIZE", "1")
    assert run_ranks(3, _load, base, ["0", "new", "new2"]) == [(5, "memory", True)] * 3
    # the view is gone; what the empty nodes received stays as the spares of their next save
    assert os.listdir(tmp_path / "memnew" / "bcp-memory" / "job") == [".spare"]


def _flip_in_piece(step, key: str, rank: int):
    """A bit flipped in `key`'s piece of rank `rank`'s data file of a step in a node's memory; the file."""
    from bcp_core.metadata import METADATA_FILE, CheckpointMetadata
    md = CheckpointMetadata.loads((step / METADATA_FILE).read_bytes())
    index = next(i for i, f in enumerate(md.files) if f"-r{rank}_" in f)
    at = next(p.byte_offset for p in md.tensors[key].pieces if p.file == index) + 5
    path = step / md.files[index]
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def test_a_failed_replica_fails_the_save_on_every_rank_and_commits_it_nowhere(tmp_path, monkeypatch):
    """Rank 3 cannot store the replicas it receives at step 2: the save fails on every rank naming
    it, no node holds step 2's metadata (each node's leader marked it failed), step 3 saves cleanly,
    and a load finds step 3 (then, step 3's metadata gone from both nodes, step 1, never step 2).
    Every rank saves the same RNG state as extra_state: the metadata names rank 0's piece only."""
    base = str(tmp_path)
    monkeypatch.setenv("BCP_LOCAL_WORLD_SIZE", "2")
    errors = run_ranks(4, _save, base, [1, 2, 3], None, (3, 2), None, None, True)
    for e in errors:
        assert list(e) == [2] and "rank 3" in e[2] and "injected" in e[2] and "not committed" in e[2], e
    for node in ("mem0", "mem1"):
        steps = _steps(tmp_path / node)
        assert steps[1] is not None and steps[3] is not None and steps.get(2) is None, steps
    # node 0's copy of rank 1's step-3 file damaged (a flipped bit in RAM): the load fails its
    # checksum, node 0 sets its copy aside, node 1 keeps its own (whole, though it holds rank 1's
    # RNG piece, which the metadata does not name), and step 3 loads again with that file from node 1
    step3 = [tmp_path / node / "bcp-memory" / "job" / "step_00000003" for node in ("mem0", "mem1")]
    victim = _flip_in_piece(step3[0], "w", 1)
    assert run_ranks(4, _load, base, None, False, None, True) == [(3, "memory", True)] * 4
    assert not victim.exists() and victim.with_name(victim.name + ".damaged").exists()
    assert (step3[1] / victim.relative_to(step3[0])).exists()
    for step in step3:
        os.remove(step / "bcp_metadata.json")
    assert run_ranks(4, _load, base, None, False, {"durable": None, "persist_every": None}, True) == \
        [(1, "memory", True)] * 4


def test_a_damaged_copy_is_set_aside_and_a_failed_recovery_leaves_the_state_untouched(tmp_path, monkeypatch):
    """Node 1 lost and node 0's copy of a step-3 file damaged, no other copy: the load of step 3
    fails its checksum, node 0 sets the copy aside, and the load takes the newest whole step, 2,
    every row of it. With node 0's own files of steps 2 and 3 gone too, no step is whole (k = 0
    here) and no durable step exists: a one-line error naming what is missing, the state untouched."""
    base = str(tmp_path)
    monkeypatch.setenv("BCP_LOCAL_WORLD_SIZE", "1")
    assert run_ranks(2, _save, base, [1, 2, 3]) == [{}] * 2
    step3 = tmp_path / "mem0" / "bcp-memory" / "job" / "step_00000003" / "data"
    victim = flip_last_byte(sorted(step3.iterdir())[-1])
    import shutil
    shutil.rmtree(tmp_path / "mem1")
    shutil.rmtree(tmp_path / "durable")
    assert run_ranks(2, _load, base, ["0", "new"]) == [(2, "memory", True)] * 2
    assert victim.with_name(victim.name + ".damaged").exists()
    for d in ("step_00000002", "step_00000003"):  # node 0's own file of each step gone too
        own = sorted((tmp_path / "mem0" / "bcp-memory" / "job" / d / "data").iterdir())
        for f in own:
            if "-r0_" in f.name and f.suffix == ".safetensors":
                f.unlink()
    for kind, message, same in run_ranks(2, _load, base, ["0", "new"]):
        assert kind == "IncompleteCheckpointError" and same, message
        assert "no whole step" in message and "survive on no node" in message and "r0_" in message, message


def _fails_after_the_agreement(rank, world, base):
    """Rank 1's optimizer refuses its state once the load's ranks agreed that every byte is read and
    verified (rank 0 loads): rank 1 raises its own error within the damaged-copy agreement's bound."""
    from datetime import timedelta

    from bcp_core.tiers import recovery
    _on_node(rank, base)
    recovery.AGREE_TIMEOUT = timedelta(seconds=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)

    class Refusing(torch.optim.SGD):
        def load_state_dict(self, state_dict):
            if rank == 1:
                raise RuntimeError("injected: this optimizer refuses its state")
            super().load_state_dict(state_dict)
    opt = Refusing(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    tiers = _tiers(base, durable=None, persist_every=None)
    bcp.save(tiers, {"model": model, "optimizer": opt}, step=1, async_save=True).wait()
    try:
        bcp.load(tiers, {"model": model, "optimizer": opt})
        return "loaded"
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"


def test_an_error_on_one_rank_after_the_loads_agreement_is_raised_there_within_a_bound(tmp_path, monkeypatch):
    """A load of the tiers that fails on one rank only, after every rank verified its bytes, does not
    wait out the load's timeout (10 min) looking for damaged copies: that rank raises its own error
    once the agreement's bound (2 s here) passed, well within the job's 120 s, and the other has
    loaded."""
    monkeypatch.setenv("BCP_LOCAL_WORLD_SIZE", "1")
    loaded, error = run_ranks(2, _fails_after_the_agreement, str(tmp_path), timeout=120)
    assert loaded == "loaded" and error.startswith("RuntimeError: injected"), error


def _node_local_directories(rank, world, base, dead, live):
    """Each node's memory tier a directory of its own (`local<node>`), as a local SSD at another path
    on each machine would be. Views of a step that a load made (`fetch.view_name`) lie in them
    before the save and the load: those of process `dead` are removed, those of `live` (a load
    going on) stay. Node 0 then loses its copy of rank 1's file: rank 1 reads its own node's. The
    views left after the save and after the load; the step loaded, and whether every row is step
    1's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from bcp_core.storage.base import this_host
    local = os.path.join(base, f"local{rank}")
    os.makedirs(local, exist_ok=True)

    def views(*names):
        for name in names:
            os.makedirs(os.path.join(local, name, "data"), exist_ok=True)
        return sorted(n for n in os.listdir(local) if n.startswith(".bcp-recover-"))
    stale, running = (f".bcp-recover-1-{hex}.{this_host()}.{pid}" for hex, pid in (("0a", dead), ("0b", live)))
    views(stale, running)
    tiers = bcp.Tiers(local, replicas=1)
    state = initial(init_device_mesh("cpu", (world,)))
    advance(state, 1)
    bcp.save(tiers, state, step=1, async_save=True).wait()
    after_save = views()
    dist.barrier()
    if rank == 0:
        import glob
        for f in glob.glob(os.path.join(local, "step_00000001", "data", "*-r1_*")):
            os.remove(f)
    views(stale)
    dist.barrier()
    state["w"].to_local().fill_(-1.0)
    result = bcp.load(tiers, state)
    rows = ROWS // world
    ok = torch.equal(state["w"].to_local(), expected(1)["w"][rank * rows:(rank + 1) * rows])
    return after_save, views(), result.step, result.tier, ok


def test_node_local_directories_each_node_loads_its_own_and_views_of_ended_loads_go(tmp_path, monkeypatch):
    """Tiers(memory=<a directory that differs per node>): each rank loads its own node's view, never
    rank 0's (node 0 lost rank 1's file, which node 1 holds: read from node 0's view, it fails its
    checksum). A view whose load ended without removing it goes at the next save and the next load;
    a live process's stays."""
    import subprocess
    ended = subprocess.Popen(["true"])
    ended.wait()
    monkeypatch.setenv("BCP_LOCAL_WORLD_SIZE", "1")
    from bcp_core.storage.base import this_host
    running = [f".bcp-recover-1-0b.{this_host()}.{os.getpid()}"]
    assert run_ranks(2, _node_local_directories, str(tmp_path), ended.pid, os.getpid()) == \
        [(running, running, 1, "memory", True)] * 2


@pytest.mark.slow
def test_failure_domains_keep_each_copy_out_of_its_nodes_domain(tmp_path, monkeypatch):
    """4 nodes in 2 racks: each node's files are copied to a node of the other rack."""
    base = str(tmp_path)
    monkeypatch.setenv("BCP_LOCAL_WORLD_SIZE", "1")
    assert run_ranks(4, _save, base, [1], None, None, None, ["a", "a", "b", "b"]) == [{}] * 4
    holders = {}
    for node in range(4):
        for f in _steps(tmp_path / f"mem{node}")[1]:
            holders.setdefault(f.split("-r")[1][0], set()).add(node)
    assert holders == {"0": {0, 2}, "1": {1, 3}, "2": {2, 0}, "3": {3, 1}}, holders


def _resume_earlier(rank, world, base):
    """A job that resumed from step 2 (of another timeline: its bias differs) saves step 2 again; the
    steps in memory then, and what a load finds."""
    from torch.distributed.device_mesh import init_device_mesh
    _on_node(rank, base)
    state = initial(init_device_mesh("cpu", (world,)))
    for step in (1, 2):
        advance(state, step)
    state["bias"].add_(100.0)
    tiers = _tiers(base)
    bcp.save(tiers, state, step=2, async_save=True).wait()
    steps = sorted(_steps(__import__("pathlib").Path(base) / f"mem{rank}"))
    state["bias"].zero_()
    result = bcp.load(tiers, state)
    return steps, result.step, torch.equal(state["bias"], expected(2)["bias"] + 100.0)


@pytest.mark.slow
def test_a_resumed_job_leaves_the_old_timeline(tmp_path, monkeypatch):
    """Steps 1-4 saved (3 and 4 kept in memory); a job resumed from step 2 saves step 2 again: the old
    steps 3 and 4 are cleared on every node before the new step 2 commits, so no load finds them."""
    base = str(tmp_path)
    monkeypatch.setenv("BCP_LOCAL_WORLD_SIZE", "1")
    assert run_ranks(2, _save, base, [1, 2, 3, 4]) == [{}] * 2
    assert run_ranks(2, _resume_earlier, base) == [([2], 2, True)] * 2


def test_one_process_memory_and_durable_without_replicas(tmp_path, monkeypatch):
    """No torch.distributed, replicas=0: a memory tier drained to disk, loaded back."""
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path))
    tiers = bcp.Tiers("memory://solo", durable=str(tmp_path / "durable"), replicas=0, persist_every=1)
    state = {"w": torch.arange(6.0), "step": 3}
    bcp.save(tiers, state, step=3, async_save=True).wait()
    bcp.save(tiers, {"w": torch.arange(6.0) * 2, "step": 4}, step=4).wait()
    bcp.checkpointer.get_checkpointer()._tiers.drains.queue.wait_all(60)
    target = {"w": torch.zeros(6), "step": 0}
    result = bcp.load(tiers, target)
    assert (result.step, result.tier, target["step"]) == (4, "memory", 4)
    assert torch.equal(target["w"], torch.arange(6.0) * 2)
    assert bcp.resolve(str(tmp_path / "durable")).root.endswith("step_00000004")
    with pytest.raises(bcp.SaveError, match="replicas=1 needs at least 2 nodes"):
        bcp.save(bcp.Tiers("memory://solo"), state, step=5)


def test_a_drain_ending_while_a_step_is_recorded_keeps_the_older_step(tmp_path, monkeypatch):
    """A drain that ends while a save has recorded its step on this node but not every node has
    confirmed it yet (here: another node could not record it) must not count that step as
    committed: its retention (`keep_newest`, keep_in_memory=1) would retire step 1, and step 2 is
    then taken back, leaving no committed step. The drain's retention waits for the confirmation;
    step 1 stays and loads."""
    import threading

    from bcp_core.comm import Comm
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path))
    tiers = bcp.Tiers("memory://race", replicas=0, keep_in_memory=1)
    bcp.save(tiers, {"w": torch.arange(6.0), "step": 1}, step=1).wait()
    runtime = bcp.checkpointer.get_checkpointer()._tiers
    all_gather, drains = Comm.all_gather, []

    def confirm(self, obj, op, timeout=None):  # step 2's confirmation: a drain ends meanwhile
        out = all_gather(self, obj, op, timeout)
        if not op.endswith("/recorded"):
            return out
        drain = threading.Thread(target=runtime.keep_newest, args=(tiers.memory_root(), 1))
        drain.start()
        drain.join(1.0)  # the drain's retention, as drain.py runs it when a drain ends
        drains.append(drain)
        return ["rank 1: injected: this node could not record the metadata"]
    with monkeypatch.context() as m, pytest.raises(bcp.SaveError, match="could not be recorded on every node"):
        m.setattr(Comm, "all_gather", confirm)
        bcp.save(tiers, {"w": torch.arange(6.0) * 2, "step": 2}, step=2).wait()
    drains[0].join(30)
    assert not drains[0].is_alive()
    target = {"w": torch.zeros(6), "step": 0}
    assert bcp.load(tiers, target).step == 1 and torch.equal(target["w"], torch.arange(6.0))


def test_a_damaged_copy_is_never_drained_and_a_load_takes_the_newest_whole_step(tmp_path, monkeypatch):
    """A bit flips in memory after step 4 was written and before its drain reads it: the drain
    fails naming the file (the durable root's latest stays step 2), and a load finds step 4's copy
    damaged, sets it aside and loads step 2 instead."""
    from bcp_core.storage.faults import Fault, inject
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path))
    tiers = bcp.Tiers("memory://solo", durable=str(tmp_path / "durable"), replicas=0, persist_every=2)
    bcp.save(tiers, {"w": torch.arange(6.0), "step": 2}, step=2).wait()
    drains = bcp.checkpointer.get_checkpointer()._tiers.drains.queue
    drains.wait_all(60)
    flipped = []

    def flip(call):  # the drain maps the file to copy it
        flipped.append(flip_last_byte(tmp_path / "bcp-memory" / call.path[len("memory://"):]))
    with inject(Fault("map", hook=flip, path="*/step_00000004/data/*")):
        bcp.save(tiers, {"w": torch.arange(6.0) * 2, "step": 4}, step=4).wait()
        drains.wait_all(60)
    assert len(flipped) == 1
    with pytest.raises(bcp.SaveError, match=r"fails the checksum of bytes .*damaged, and is not persisted"):
        drains.pending[-1].handle.wait(0)
    assert bcp.resolve(str(tmp_path / "durable")).root.endswith("step_00000002")
    target = {"w": torch.full((6,), -1.0), "step": 0}
    result = bcp.load(tiers, target)
    assert (result.step, target["step"]) == (2, 2) and torch.equal(target["w"], torch.arange(6.0))
    assert flipped[0].with_name(flipped[0].name + ".damaged").exists()


def test_a_step_saved_again_waits_for_its_drain(tmp_path, monkeypatch):
    """A framework's second, fuller save of a step (Lightning: a weights-only save, then the full
    one) clears the step from memory first: a drain still copying it would have lost its files. The
    save waits for the drain; both drains commit, and durable and memory hold the second save."""
    import threading

    from bcp_core.storage.faults import Fault, inject
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path))
    tiers = bcp.Tiers("memory://again", durable=str(tmp_path / "durable"), replicas=0, persist_every=2)
    copying, go = threading.Event(), threading.Event()

    def held(call):  # the drain maps step 2's file to copy it: held there until the next save is asked for
        copying.set()
        go.wait(30)
    with inject(Fault("map", hook=held, path="*/step_00000002/data/*")):
        bcp.save(tiers, {"w": torch.arange(6.0)}, step=2).wait()
        assert copying.wait(30)
        threading.Timer(0.5, go.set).start()
        bcp.save(tiers, {"w": torch.arange(6.0) * 3, "opt": torch.ones(2)}, step=2).wait()
    drains = bcp.checkpointer.get_checkpointer()._tiers.drains.queue
    drains.wait_all(60)
    assert all(q.handle.done() and q.handle._future.exception() is None for q in drains.pending)
    for where in (tiers, str(tmp_path / "durable")):
        target = {"w": torch.zeros(6), "opt": torch.zeros(2)}
        bcp.load(where, target)
        assert torch.equal(target["w"], torch.arange(6.0) * 3) and torch.equal(target["opt"], torch.ones(2)), where


def test_a_replica_is_checked_against_the_writes_checksums(tmp_path):
    """A copy is whole and right only if its header, every block of every piece (the checksums the
    write computed) and the padding between them are the original's: a flipped bit anywhere names
    where."""
    import xxhash

    from bcp_core.engine import write_items
    from bcp_core.plan_records import RankValueKey, WriteItem
    from bcp_core.storage import LocalStorage
    from bcp_core.tiers.copy_check import CopyCheck
    st = LocalStorage(str(tmp_path))
    items = [WriteItem(f"t{i}", torch.arange(1000 * (i + 1), dtype=torch.float32), RankValueKey(f"t{i}"))
             for i in range(3)]
    written = write_items(st, 0, items, 1, 1024)  # 1 KiB blocks: several per piece
    rel = written[0].file
    data = bytearray((tmp_path / rel).read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    entry = [rel, len(data), header, xxhash.xxh3_64_hexdigest(bytes(data[:header])),
             [[w.byte_offset, w.nbytes, list(w.checksums)] for w in written]]

    def check(copy: bytes, part: int = 700) -> str | None:  # fed as it arrives: parts across blocks
        c = CopyCheck(entry, 1024)
        for at in range(0, len(copy), part):
            c.feed(memoryview(copy)[at:at + part], at)
        return c.wrong()

    assert check(bytes(data)) is None and check(bytes(data), len(data)) is None
    last = max(written, key=lambda w: w.byte_offset)
    cases = [(5, "another header"), (last.byte_offset + 2000, "fails the checksum of bytes [")]
    for at, words in cases:
        bad = bytearray(data)
        bad[at] ^= 1
        assert words in check(bytes(bad)), (at, words, check(bytes(bad)))
    assert "ended at byte" in check(bytes(data[:-10]))
    assert "ended at byte" in check(bytes(data) + b"\0")  # longer than the original
    entry[1] += 16  # a file padded after its last piece: the padding must be zeros
    assert check(bytes(data) + bytes(16)) is None
    assert "has bytes in [" in check(bytes(data) + bytes(15) + b"\1")

    def check_pieces(copy: bytes) -> str | None:  # a load's check: the metadata's pieces, nothing else
        c = CopyCheck.for_file(memoryview(copy), [(w.byte_offset, w.nbytes, w.checksums) for w in written[1:]],
                               1024, only_pieces=True)
        c.feed(memoryview(copy), 0)
        return c.wrong()
    other = bytearray(data)
    other[written[0].byte_offset] ^= 1  # a piece the metadata does not list (another rank's, saved alike)
    assert check_pieces(bytes(other)) is None
    other[last.byte_offset + 2000] ^= 1
    assert "fails the checksum of bytes [" in check_pieces(bytes(other))
