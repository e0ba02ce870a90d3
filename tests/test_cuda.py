"""bcp's CUDA paths: pinned staging buffers, copies on a side stream, the lazy snapshot and the
optimizer step guard with CUDA tensors, host-to-device loads, bf16 state, resharding into CUDA
tensors, real Megatron-core on CUDA and the mapped load into a Hugging Face model on CUDA.

Tests marked `cuda` run where torch sees a CUDA device and are skipped elsewhere. Most have a
`cpu` twin that runs the same code on CPU tensors in the default suite, so the logic of every
test is exercised on any machine; only what needs the device (pinned memory, streams, NCCL)
differs. `bench/gpu_check.sh` runs this file on a lent GPU machine (docs/gpu.md), with
BCP_REQUIRE_CUDA=1 so that a machine whose GPU torch cannot see fails instead of skipping.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import bcp_core as bcp
from bcp_core.checkpointer import get_checkpointer
from dist import RECIPES, run_ranks

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False here (bench/gpu_check.sh runs these on a GPU)"
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)])]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.cuda
def test_cuda_is_present_where_required():
    """On the lent GPU machine (BCP_REQUIRE_CUDA=1) a missing device is a failure, not skips."""
    if os.environ.get("BCP_REQUIRE_CUDA") != "1":
        pytest.skip("BCP_REQUIRE_CUDA is not set: the cuda tests may skip here")
    assert HAS_CUDA, f"BCP_REQUIRE_CUDA=1 but torch {torch.__version__} sees no CUDA device"


# ----------------------------------------------------------------------------- helpers

def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's and optimizer's tensors under their checkpoint keys, copied to the CPU."""
    out = {f"model.{k}": _plain(v).detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"optimizer.state.{names[id(p)]}.{k}"] = _plain(v).detach().to("cpu", copy=True)
    return out


def _checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read as plain CPU tensors."""
    from bcp_core.tools import read_tensor
    st, md = bcp.resolve(path), bcp.inspect(path)
    return {fqn: read_tensor(st, md, fqn) for fqn in md.tensors}


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def _devices(model: nn.Module, opt: torch.optim.Optimizer) -> set[str]:
    """The device types of every parameter, buffer and optimizer state (but torch's CPU step counters)."""
    found = {_plain(t).device.type for t in model.state_dict().values() if t.is_floating_point()}
    found |= {_plain(v).device.type for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v)
              and k != "step"}
    return found


def _mlp(device: str, dtype: torch.dtype, seed: int, width: int = 64, norm: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(width, 4 * width)]
    if norm:  # a module with buffers: copied at the call, not lazily (they change in forward)
        layers.append(nn.BatchNorm1d(4 * width))
    layers += [nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int, rows: int = 32) -> None:
    p = next(model.parameters())
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(rows, p.shape[1], generator=g).to(device=p.device, dtype=p.dtype)
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()


def _busy(device: str) -> None:
    """Queue ~0.1 s of work on the current CUDA stream without waiting for it: copies ordered after
    it start only once it ends, long after the CPU has gone on (so a missing order shows)."""
    if device == "cuda":
        torch.cuda._sleep(200_000_000)  # clock cycles: 0.1 s at 2 GHz


def _job(role: str):
    """The newest save of a role, as the checkpointer holds it (its plan and snapshot: staged copies, lazy copy)."""
    return get_checkpointer(role).queue.pending[-1].progress


def _staged_pairs(role: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(staging buffer, live source) of every box the role's newest save staged."""
    job = _job(role)
    return [(buf, job.plan.tensors[ti][1].boxes[bi].view) for (ti, bi), buf in job.snapshot.staged.items()]


def _pinned_where_on_cuda(pairs) -> bool:
    """Every buffer is pinned exactly when its source lives on CUDA (torch's step counters stay on the CPU)."""
    return all(b.is_pinned() == (s.device.type == "cuda") for b, s in pairs)


def _pool_buffers(role: str) -> list[torch.Tensor]:
    """Every staging buffer the role's pool holds (its slots, whatever layout each was made for)."""
    pool = get_checkpointer(role).snapshots.pool
    return [b for slot in pool._slots for b in slot]


# ----------------------------------------------------------------------------- model + optimizer round trip

MODES = ["sync", "async_lazy", "async_copy", "async_fork"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_model_and_optimizer_state_round_trip(device, dtype, mode, tmp_path):
    """Parameters, buffers and AdamW state on the device (fp32 and bf16), saved synchronously and
    asynchronously (lazy, copy, and fork, which falls back to copying for accelerator state), load
    back bit for bit into a model whose optimizer already has state (written in place) and into a
    fresh one (state made for the load), and every tensor stays on the device."""
    model = _mlp(device, dtype, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, seed=1)
    want = _state_tensors(model, opt)
    path = str(tmp_path / "ckpt")
    if mode == "sync":
        bcp.save(path, {"model": model, "optimizer": opt}).wait()
    else:
        bcp.save(path, {"model": model, "optimizer": opt}, async_save=True, role=f"rt-{device}",
                 snapshot=mode.removeprefix("async_")).wait()
    assert not _differ(_checkpoint_tensors(path), want)

    stepped = _mlp(device, dtype, seed=5)
    stepped_opt = torch.optim.AdamW(stepped.parameters(), lr=1e-2)
    _train(stepped, stepped_opt, 1, seed=7)  # its state exists: the load writes into it
    fresh = _mlp(device, dtype, seed=6)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    for m, o in ((stepped, stepped_opt), (fresh, fresh_opt)):
        before = _state_tensors(m, o)  # differs before the load, so the comparison below can fail
        assert not torch.equal(before["model.0.weight"], want["model.0.weight"])
        bcp.load(path, {"model": m, "optimizer": o})
        assert not _differ(_state_tensors(m, o), want)
        assert _devices(m, o) == {device}
        assert all(_plain(p).dtype == dtype for p in m.parameters())


# ----------------------------------------------------------------------------- lazy snapshot + step guard

@pytest.mark.parametrize("device", DEVICES)
def test_lazy_snapshot_holds_the_values_of_the_call(device, tmp_path):
    """An asynchronous save with CUDA parameters and optimizer state, then at once an optimizer
    step (the step pre-hook), for a second save an in-place edit inside `bcp.mutating()`, and for
    a third a load into the same state: each checkpoint holds the values of its call.

    On CUDA the race is forced: before each call ~0.1 s of GPU work is queued on the training
    stream, so the save's side-stream copies (which wait for it) have not run yet when every copy
    is queued and the step comes; only the guard ordering the training stream after the copies
    keeps the step's kernels from changing what is being copied."""
    width = 2048 if device == "cuda" else 64  # on CUDA, ~200 MiB of state: copies take milliseconds
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]).to(device)
    # fused AdamW keeps its step counters on the device too: every pair of the snapshot is then a
    # CUDA copy, all queued by the copy thread long before they run
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=device == "cuda")
    _train(model, opt, 2, seed=1)
    role = f"lazy-{device}"

    for k, change in enumerate(("step", "mutating", "load")):
        want = _state_tensors(model, opt)
        _busy(device)
        handle = bcp.save(str(tmp_path / f"ckpt{k}"), {"model": model, "optimizer": opt}, async_save=True, role=role)
        lazy = _job(role).snapshot.lazy
        assert lazy is not None  # parameters and optimizer state are taken after the call
        if device == "cuda":
            assert lazy._stream is not None and all(b.is_pinned() for b, _ in lazy._pairs)  # fused: all on CUDA
            assert lazy._done.wait(10)  # every copy queued (none run yet: the GPU is still busy)
        if change == "step":
            _train(model, opt, 1, seed=10 + k)
        elif change == "mutating":
            with bcp.mutating(), torch.no_grad():
                for p in model.parameters():
                    p.mul_(-2.0)
        else:  # a load into the state being saved: its copies (on streams of their own) wait for the snapshot's
            bcp.load(str(tmp_path / "ckpt0"), {"model": model, "optimizer": opt})
        handle.wait()
        assert _differ(_state_tensors(model, opt), want), "the state did not change after the call"
        assert not _differ(_checkpoint_tensors(str(tmp_path / f"ckpt{k}")), want)

    fresh = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]).to(device)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, fused=device == "cuda")
    bcp.load(str(tmp_path / "ckpt1"), {"model": fresh, "optimizer": fresh_opt})
    assert not _differ(_state_tensors(fresh, fresh_opt), _checkpoint_tensors(str(tmp_path / "ckpt1")))
    assert _devices(fresh, fresh_opt) == {device}


# ----------------------------------------------------------------------------- staging buffers

@pytest.mark.parametrize("device", DEVICES)
def test_staging_buffers_are_pinned_and_reused(device, tmp_path):
    """Five asynchronous saves, each waited for, stage into the same host buffers (pinned on CUDA,
    nothing allocated after the first); saves asked for while the previous one still writes use
    one second set at most. The last checkpoint holds the state of its call."""
    model = _mlp(device, torch.float32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1, seed=1)
    role = f"reuse-{device}"
    state = {"model": model, "optimizer": opt}
    first: set[int] | None = None
    for k in range(5):
        _train(model, opt, 1, seed=2 + k)
        bcp.save(str(tmp_path / "root"), state, step=k, async_save=True, role=role, keep=2).wait()
        buffers = _pool_buffers(role)
        pairs = _staged_pairs(role)
        assert _pinned_where_on_cuda(pairs) and any(b.is_pinned() for b, _ in pairs) == (device == "cuda")
        ids = {id(b) for b in buffers}  # the pool keeps them alive: same ids, same tensors
        nbytes = sum(b.nbytes for b in buffers)
        if first is None:
            first, first_bytes = ids, nbytes
        assert ids == first and nbytes == first_bytes, f"save {k}: the staging buffers changed"
    assert first_bytes >= sum(p.nbytes for p in model.parameters())

    handles = []
    for k in range(5, 9):  # back to back: a save starts while the previous one still writes
        _train(model, opt, 1, seed=20 + k)
        want = _state_tensors(model, opt)
        handles.append(bcp.save(str(tmp_path / "root"), state, step=k, async_save=True, role=role, keep=2))
    for h in handles:
        h.wait()
    assert _pinned_where_on_cuda(_staged_pairs(role))
    assert len({id(b) for b in _pool_buffers(role)} - first) <= len(first), "more than one second set of buffers"
    assert not _differ(_checkpoint_tensors(str(tmp_path / "root")), want)


# ----------------------------------------------------------------------------- chunked transfers

@pytest.mark.parametrize("device", DEVICES)
def test_bounce_moves_bytes_in_chunks_both_ways(device):
    """host_memory.Bounce with 1 KiB chunks: a download yields every byte of a device tensor in
    order (contiguous, a transposed view, one element, none), and an upload puts bytes back exactly,
    for sizes that end mid-chunk; the chunks are pinned on CUDA."""
    from bcp_core.host_memory import Bounce
    b = Bounce(torch.device(device), chunk=1024)
    assert all(buf.is_pinned() == (device == "cuda") for buf in b._bufs)
    g = torch.Generator().manual_seed(0)
    cases = [((777,), torch.float32), ((33, 65), torch.bfloat16), ((1,), torch.int64), ((0,), torch.float32)]
    for shape, dtype in cases:
        host = (torch.randn(shape, generator=g) * 100).to(dtype)
        src = host.to(device)
        transposed = (src.t(), host.t().contiguous()) if src.dim() == 2 else (src, host)
        for view, want in [(src, host), transposed]:
            got = b"".join(bytes(c) for c in b.download(view))
            assert got == want.contiguous().view(torch.uint8).numpy().tobytes(), (shape, dtype)
        dest = torch.full_like(src, 3)
        raw = memoryview(host.contiguous().view(torch.uint8).numpy()).cast("B") if host.numel() else memoryview(b"")
        b.upload(dest, raw)
        assert torch.equal(dest.cpu().view(torch.uint8), host.view(torch.uint8)), (shape, dtype)
    with pytest.raises(ValueError, match="upload of 5 bytes into a tensor of 8 bytes"):
        b.upload(torch.zeros(2, device=device), memoryview(b"12345"))


@pytest.mark.parametrize("device", DEVICES)
def test_a_bounce_given_up_mid_download_is_drained_before_reuse(device):
    """A writer that fails after the first chunk leaves the download as the engine uses it
    (`bounce()` and `closing`): the generator is closed, no copy of it is still in flight when
    the bounce goes back to the pool, and the next user gets exact bytes."""
    import contextlib

    from bcp_core import host_memory
    src = torch.arange(3 * (host_memory.CHUNK_BYTES // 4), dtype=torch.float32, device=device)
    with pytest.raises(OSError, match="disk full"):
        with host_memory.bounce(src.device) as b, contextlib.closing(b.download(src)) as chunks:
            for _ in chunks:
                raise OSError("disk full")
    assert chunks.gi_frame is None, "the download was left suspended"
    assert not any(b._queued), "a copy of the abandoned download was still in flight"
    with host_memory.bounce(src.device) as again:
        assert again is b
        got = b"".join(bytes(c) for c in again.download(src))
    assert got == src.cpu().numpy().tobytes()


@pytest.mark.parametrize("device", DEVICES)
def test_a_synchronous_save_of_device_state_failing_mid_tensor_commits_nothing(device, tmp_path, monkeypatch):
    """The disk fails in the middle of a tensor larger than two chunks: the save raises naming the
    file, no checkpoint is committed at the path, the previous one still loads exactly, and the
    next save (the same bounces reused) loads bit for bit."""
    from bcp_core.host_memory import CHUNK_BYTES
    from bcp_core.storage import local_writer
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(CHUNK_BYTES // 4 * 2 + 999, generator=g).to(device)}
    root = str(tmp_path / "root")
    bcp.save(root, state, step=1)
    first = state["w"].cpu().clone()
    state["w"].mul_(3)
    real, calls = local_writer._pwrite_all, []

    def failing(fd, data, offset):
        calls.append(len(data))
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)
    monkeypatch.setattr(local_writer, "_pwrite_all", failing)
    with pytest.raises(bcp.BCPError, match=r"writing .*\.safetensors failed: .*No space left on device"):
        bcp.save(root, state, step=2)  # a synchronous save raises at the call
    monkeypatch.setattr(local_writer, "_pwrite_all", real)
    dest = {"w": torch.zeros_like(state["w"])}
    bcp.load(root, dest)  # the newest committed: step 1
    assert torch.equal(dest["w"].cpu(), first)
    bcp.save(root, state, step=3)
    bcp.load(root, dest)
    assert torch.equal(dest["w"].cpu(), state["w"].cpu())


def _mapping_flags(addr: int) -> set[str] | None:
    """The kernel's VmFlags of this process's mapping holding `addr` (None: not mapped)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc/self/smaps")
def test_pinned_buffers_register_on_their_device_on_one_thread_and_never_in_a_forked_child(monkeypatch):
    """host_memory.pinned_empty with CUDA's registration calls recorded (no GPU here): the buffer is
    page-aligned and exactly its size, advised huge pages and not mapped in a forked child (Linux
    copies pinned private pages into a child at the fork); registering and unregistering run on
    the "bcp-pin" thread with the tensor's device current; the unregistering is queued once the
    last view is gone, and the memory stays mapped until it has run; a forked child that drops the
    parent's buffers calls nothing; a registration that fails falls back to torch's allocator."""
    import contextlib
    import gc
    import threading

    from bcp_core import host_memory
    calls = []

    class Runtime:
        class cudaError:  # noqa: N801 - as torch's binding names it
            success = 0

        def cudaHostRegister(self, ptr, n, flags):  # noqa: N802
            calls.append(("register", ptr, n, current[0], threading.current_thread().name))
            return 0 if n != 3 << 20 else 1

        def cudaHostUnregister(self, ptr):  # noqa: N802
            calls.append(("unregister", ptr, current[0], threading.current_thread().name,
                          _mapping_flags(ptr) is not None))

    current = [0]

    @contextlib.contextmanager
    def device(index):
        before, current[0] = current[0], index
        yield
        current[0] = before
    monkeypatch.setattr(host_memory, "_cudart", lambda: Runtime())
    monkeypatch.setattr(torch.cuda, "device", device)
    t = host_memory.pinned_empty((5, 1 << 18), torch.float32, torch.device("cuda", 3))
    assert t.shape == (5, 1 << 18) and t.untyped_storage().nbytes() == 5 << 20 and t.data_ptr() % 4096 == 0
    (reg,) = calls
    assert reg[1:4] == (t.data_ptr(), 5 << 20, 3) and reg[4].startswith("bcp-pin")
    flags = _mapping_flags(t.data_ptr())
    assert flags is not None and {"dc", "hg"} <= flags, f"not advised huge pages and no fork copy: {flags}"
    view = t[2:3]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child drops the parent's buffer: nothing of CUDA may run here
        if _mapping_flags(reg[1]) is not None:
            os.write(w, b"the buffer is mapped in a forked child")
            os._exit(0)
        del t, view
        gc.collect()
        host_memory._PINNER._executor().submit(lambda: None).result()  # anything queued has run
        os.write(w, repr(calls).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    assert os.read(r, 1 << 16).decode() == repr(calls), "a forked child unregistered the parent's memory"
    del t
    gc.collect()
    assert len(calls) == 1, "unregistered while a view was alive"
    held = threading.Event()  # the pin thread busy: the array is gone before the unregistering runs
    host_memory._PINNER._executor().submit(held.wait)
    del view
    gc.collect()
    held.set()
    host_memory._PINNER._executor().submit(lambda: None).result()  # the queued unregistering ran
    assert calls[1][:3] == ("unregister", reg[1], 3) and calls[1][3].startswith("bcp-pin")
    assert calls[1][4], "unmapped before it was unregistered: CUDA could refuse to pin what reuses the addresses"
    assert _mapping_flags(reg[1]) is None, "the map outlived its unregistering"
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: "torch's pinned allocator" if pin_memory
                        else real_empty(*a, **k))
    assert host_memory.pinned_empty((3 << 20,), torch.uint8, torch.device("cuda", 0)) == "torch's pinned allocator"


@pytest.mark.parametrize("device", DEVICES)
def test_synchronous_save_and_load_of_device_state_across_chunks(device, tmp_path):
    """A synchronous save of device tensors larger than a chunk (16 MiB), of odd sizes, one a
    transposed view, then a load into device tensors: bit for bit, the destinations stay on the
    device; values changed on the device just before the save call are the ones saved. On CUDA
    the staging buffers of an async save are pinned at their exact size (not rounded up to a
    power of two by torch's pinned allocator)."""
    from bcp_core.host_memory import CHUNK_BYTES, host_buffer
    g = torch.Generator().manual_seed(1)
    n = CHUNK_BYTES // 4 * 2 + 12345  # fp32: two chunks and a bit
    state = {"big": torch.randn(n, generator=g).to(device), "odd": torch.randn(1001, 37, generator=g).to(device),
             "t": torch.randn(300, 700, generator=g).to(torch.bfloat16).to(device).t()}
    state["big"].mul_(2).add_(1)  # queued on the device right before the call
    want = {k: v.cpu().clone() for k, v in state.items()}
    bcp.save(str(tmp_path / "ck"), state)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(str(tmp_path / "ck"), dest)
    for k, v in dest.items():
        assert v.device.type == device and torch.equal(v.cpu(), want[k]), k
    if device == "cuda":
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        before = stats.get("allocated_bytes.current")
        buf = host_buffer(torch.empty(86 << 18, device=device))  # 86 MiB of fp32
        assert buf.is_pinned() and buf.untyped_storage().nbytes() == 86 << 20
        after = torch.cuda.host_memory_stats().get("allocated_bytes.current") if before is not None else None
        assert before is None or after - before < 86 << 20, "the buffer came from torch's rounding pinned allocator"


# ----------------------------------------------------------------------------- resharding into the device

W_SHAPE, B_SHAPE = (64, 48), (32, 40)


def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(W_SHAPE, generator=g), "b": torch.randn(B_SHAPE, generator=g).to(torch.bfloat16),
            "m": torch.arange(16, dtype=torch.float32)}


def _save_two_ranks(rank, world_size, path):
    """Two CPU ranks (gloo) save DTensors: w Shard(0) fp32, b Shard(1) bf16, m replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    full = _full_tensors()
    state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "b": distribute_tensor(full["b"], mesh, [Shard(1)]),
             "m": distribute_tensor(full["m"], mesh, [Replicate()])}
    bcp.save(path, state).wait()
    return True


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("two_ranks") / "ckpt")
    run_ranks(2, _save_two_ranks, path, timeout=120)
    return path


@pytest.mark.parametrize("device", DEVICES)
def test_two_rank_cpu_checkpoint_loads_into_device_tensors(two_rank_checkpoint, device):
    full = _full_tensors()
    targets = {k: torch.full_like(v, float("nan"), device=device) for k, v in full.items()}
    bcp.load(two_rank_checkpoint, targets)
    for k, t in targets.items():
        assert t.device.type == device and t.dtype == full[k].dtype
        assert torch.equal(t.cpu(), full[k]), k


def _device_group(rank: int, world_size: int, device: str) -> None:
    """Replace the gloo default group `dist.run_ranks` made with one that also speaks NCCL for CUDA
    tensors (Megatron, FSDP2 and DTensor collectives run on the default group's backend)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", store=dist.PrefixStore(device, store),
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=120))


def _one_device_mesh(rank, world_size, device, two_rank_path, root):
    """On a one-device mesh: the 2-rank checkpoint resharded into DTensors; then FSDP2 over the mesh
    (parameters and AdamW state are DTensors) saved asynchronously with a step right after the call,
    and loaded into a fresh sharded model with no optimizer state yet."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _device_group(rank, world_size, device)
    mesh = init_device_mesh(device, (1,))
    full = _full_tensors()
    targets = {"w": distribute_tensor(torch.zeros(W_SHAPE, device=device), mesh, [Shard(1)]),
               "b": distribute_tensor(torch.zeros(B_SHAPE, dtype=torch.bfloat16, device=device), mesh, [Replicate()]),
               "m": distribute_tensor(torch.zeros(16, device=device), mesh, [Shard(0)])}
    bcp.load(two_rank_path, targets)
    out = {"resharded": {k: [t.to_local().device.type, torch.equal(t.to_local().cpu(), full[k])]
                         for k, t in targets.items()}}

    def sharded(seed):
        model = _mlp(device, torch.float32, seed, width=32, norm=False)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    model = sharded(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, seed=1)
    want = _state_tensors(model, opt)
    handle = bcp.save(os.path.join(root, "fsdp2"), {"model": model, "optimizer": opt}, async_save=True)
    _train(model, opt, 1, seed=2)  # right after the call
    handle.wait()
    fresh = sharded(9)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    bcp.load(os.path.join(root, "fsdp2"), {"model": fresh, "optimizer": fresh_opt})
    out["fsdp2_dtensors"] = all(hasattr(p, "to_local") for p in fresh.parameters())
    out["fsdp2_changed_after_call"] = bool(_differ(_state_tensors(model, opt), want))
    out["fsdp2_differ"] = _differ(_state_tensors(fresh, fresh_opt), want)
    out["fsdp2_devices"] = sorted(_devices(fresh, fresh_opt))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_dtensors_on_a_one_device_mesh(two_rank_checkpoint, device, tmp_path):
    [r] = run_ranks(1, _one_device_mesh, device, two_rank_checkpoint, str(tmp_path), timeout=180)
    assert r["resharded"] == {k: [device, True] for k in ("w", "b", "m")}, r["resharded"]
    assert r["fsdp2_dtensors"] and r["fsdp2_changed_after_call"]
    assert r["fsdp2_differ"] == [] and r["fsdp2_devices"] == [device]


# ----------------------------------------------------------------------------- Megatron-core on the device

VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS, SEQ = 100, 64, 4, 2, 128, 2, 16


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _megatron_gpt(device: str, seed: int):
    """A Llama-like GPTModel (RMSNorm, SwiGLU, GQA, RoPE, no biases, untied) in bf16, as
    Megatron-LM builds one: on the GPU, wrapped in Float16Module."""
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                            ffn_hidden_size=FFN, use_cpu_initialization=device == "cpu", bf16=True,
                            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            bias_activation_fusion=False, masked_softmax_fusion=False, layernorm_epsilon=1e-5,
                            hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=128, max_sequence_length=64,
                   position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=False)
    gpt.cuda()  # as Megatron-LM does (the norms are made on the CPU); a no-op under the CPU shim
    with torch.no_grad():  # norms away from 1: a misplaced one shows in the logits
        for name, p in gpt.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return cfg, Float16Module(cfg, gpt)


def _megatron_distributed(cfg, model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    cfg.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                     grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, bf16=True,
                                                 params_dtype=torch.bfloat16, use_distributed_optimizer=True), [ddp])
    return ddp, opt, (opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt)


def _megatron_pass(model, batch: torch.Tensor, forward_only: bool):
    """One pass through Megatron's schedule; the logits (fp32, [batch, seq, vocab]) when forward only."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    out = {}
    pos = torch.arange(SEQ, device=batch.device)[None].expand(batch.shape[0], SEQ)

    def step(_, m):
        if forward_only:
            logits = m(batch, pos, None)

            def keep(o):
                out["logits"] = o.detach().float()
                return o.sum() * 0, {}
            return logits, keep
        return m(batch, pos, None, labels=batch), lambda o: (o.float().mean(), {})

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[model], num_microbatches=1,
                                seq_length=SEQ, micro_batch_size=batch.shape[0], forward_only=forward_only)
    logits = out.get("logits")
    if logits is not None and logits.shape[0] == SEQ and logits.shape[1] != SEQ:
        logits = logits.transpose(0, 1)
    return logits


def _sharded_tensors(tree: dict) -> list:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from bcp_integrations.megatron.adapter import build_factories, iter_leaves
    built, _ = build_factories(tree)
    return [v for _, v in iter_leaves(built) if isinstance(v, ShardedTensor)]


def _box(sh) -> tuple[slice, ...]:
    lengths = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    return tuple(slice(o, o + n) for o, n in zip(sh.global_offset, lengths))


def _megatron_job(rank, world_size, device, root):
    """Megatron-core's GPTModel, DDP and DistributedOptimizer on the device (on CPU only under
    recipes/_megatron_cpu.py's shim, for the cpu twin): trained 2 steps in bf16, saved through
    ("bcp", 1) asynchronously by Megatron's own queue with the parameters changed right after the
    call, then read back: every model and optimizer tensor by name into device tensors, and the
    model through `dist_checkpointing.load` into a fresh GPTModel on the device."""
    import contextlib
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from bcp_integrations.megatron import fully_reshardable_param_state  # registers ("bcp", 1)

    _device_group(rank, world_size, device)
    if RECIPES not in sys.path:
        sys.path.insert(0, RECIPES)
    from _megatron_cpu import cuda_on_cpu

    out: dict = {}
    with cuda_on_cpu() if device == "cpu" else contextlib.nullcontext():
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                     create_gloo_process_groups=True)
        cfg, model = _megatron_gpt(device, seed=1234)
        ddp, opt, distopt = _megatron_distributed(cfg, model)
        for i in range(2):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            _megatron_pass(ddp, _tokens(10 + i).to(device), forward_only=False)
            opt.step()
        logits = _megatron_pass(ddp, _tokens(99).to(device), forward_only=True)
        out["param_device"] = {p.device.type for p in model.parameters()}
        out["param_dtype"] = {str(p.dtype) for p in model.parameters()}

        snapshot_sd = model.sharded_state_dict()
        snapshot = {"model": snapshot_sd, "param_state": fully_reshardable_param_state(distopt, snapshot_sd)}
        want = [(sh.key, _box(sh), sh.data.detach().to("cpu", copy=True)) for sh in _sharded_tensors(snapshot)]
        model_sd = model.sharded_state_dict()
        opt_sd = opt.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        opt_sd["param_state"] = fully_reshardable_param_state(distopt, model_sd)
        path = os.path.join(root, "megatron")
        os.makedirs(path)
        queue = AsyncCallsQueue()
        queue.schedule_async_request(dist_checkpointing.save({"model": model_sd, "optimizer": opt_sd}, path,
                                                             sharded_strategy=("bcp", 1), async_sharded_save=True))
        with torch.no_grad():  # after the call: must not reach the checkpoint
            for p in model.parameters():
                p.add_(1.0)
        out["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
        out["framework"] = bcp.inspect(path).framework

        # every tensor of the checkpoint by name, into device tensors: the values of the call
        md = bcp.inspect(path)
        plain = {k: torch.zeros(tm.shape, dtype=tm.dtype, device=device) for k, tm in md.tensors.items()}
        bcp.load(path, plain)
        out["plain_devices"] = sorted({t.device.type for t in plain.values()})
        out["checked"] = len(want)
        out["differ"] = [f"{key} {box}" for key, box, data in want
                         if not torch.equal(plain[key][box].reshape(data.shape).cpu(), data)]
        out["optimizer_keys"] = sum(k.startswith("optimizer.state.") for k in plain)

        # Megatron's own load into a fresh GPTModel on the device (bcp found from metadata.json); the
        # request has the saved nesting, as the common state (optimizer param groups) comes back too
        _, fresh = _megatron_gpt(device, seed=99)
        fresh.load_state_dict(dist_checkpointing.load({"model": fresh.sharded_state_dict()}, path)["model"])
        got = {(sh.key, str(_box(sh))): sh.data for sh in _sharded_tensors({"model": fresh.sharded_state_dict()})}
        out["reload_differ"] = [f"{key} {box}" for key, box, data in want if (key, str(box)) in got
                                and not torch.equal(got[(key, str(box))].cpu(), data)]
        out["reload_checked"] = sum((key, str(box)) in got for key, box, _ in want)
        out["reload_logits_diff"] = float((_megatron_pass(fresh, _tokens(99).to(device), True) - logits).abs().max())
        out["logits"] = logits.cpu()
        ps.destroy_model_parallel()
    out["path"] = path
    return out


# The cpu twin (Megatron under the CPU shim, ~15 s) is in the slow tier: Megatron's CPU path is the
# default suite's already (test_mapping_megatron, test_integration_megatron)
@pytest.fixture(scope="module", params=[pytest.param("cpu", id="cpu", marks=pytest.mark.slow), DEVICES[1]])
def megatron_run(request, tmp_path_factory):
    pytest.importorskip("megatron.core")
    root = str(tmp_path_factory.mktemp(f"megatron_{request.param}"))
    [r] = run_ranks(1, _megatron_job, request.param, root, timeout=300)
    r["device"] = request.param
    return r


def test_megatron_gpt_on_the_device_saves_and_reloads(megatron_run):
    """A GPTModel in bf16 with its DistributedOptimizer (fp32 main parameters, Adam moments) on the
    device, saved through ("bcp", 1) by Megatron's async queue: the checkpoint holds every model and
    optimizer tensor as of the call, read back into device tensors; Megatron's own load fills a fresh
    GPTModel on the device with the same weights, whose logits equal the original's."""
    r, device = megatron_run, megatron_run["device"]
    assert r["param_device"] == {device} and r["param_dtype"] == {"torch.bfloat16"}
    assert r["finalized"] == [0] and r["framework"] == "megatron"
    assert r["plain_devices"] == [device]
    assert r["checked"] > 20 and r["optimizer_keys"] >= 3 * 8
    assert r["differ"] == [], r["differ"][:5]
    assert r["reload_checked"] >= 8 and r["reload_differ"] == [], r["reload_differ"][:5]
    assert r["reload_logits_diff"] <= 1e-5 * float(r["logits"].abs().max())


def _hf_config():
    import transformers
    return transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                                    num_hidden_layers=LAYERS, intermediate_size=FFN, vocab_size=VOCAB,
                                    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                                    tie_word_embeddings=False, attention_bias=False)


def test_megatron_checkpoint_into_hf_llama_on_the_device_in_bf16(megatron_run):
    """The bf16 Megatron checkpoint, through `megatron_to_hf`, into a LlamaForCausalLM on the device
    in bf16: its weights are Megatron's exactly, and its logits are within bf16's precision of the
    same model's in fp32 and of Megatron's own."""
    import copy
    transformers = pytest.importorskip("transformers")
    device = megatron_run["device"]
    # made in bf16 (not cast after): RoPE's inverse frequencies stay fp32, as from_pretrained makes them
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(), dtype=torch.bfloat16).to(device).eval()
    bcp.load(megatron_run["path"], {"model": hf}, mapping=bcp.mapping.megatron_to_hf(hf.config))
    assert {p.device.type for p in hf.parameters()} == {device}
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    saved = _checkpoint_tensors(megatron_run["path"])
    assert torch.equal(hf.model.embed_tokens.weight.cpu(), saved["embedding.word_embeddings.weight"][:VOCAB])
    assert torch.equal(hf.model.norm.weight.cpu(), saved["decoder.final_layernorm.weight"])
    up = saved["decoder.layers.mlp.linear_fc1.weight"][1, FFN:]  # layer 1's [gate; up]: the second half
    assert torch.equal(hf.model.layers[1].mlp.up_proj.weight.cpu(), up)

    fp32 = copy.deepcopy(hf).float()  # the same weights, computed in fp32
    ids = _tokens(99).to(device)
    with torch.no_grad():
        got, ref = hf(input_ids=ids).logits.float().cpu(), fp32(input_ids=ids).logits.cpu()
    megatron = megatron_run["logits"][..., :VOCAB]
    scale = float(ref.abs().max())
    assert scale > 0.1
    # bf16 keeps 8 bits of mantissa (a relative step of 2**-8); through this model's 2 layers the
    # logits moved by 0.0063 of their scale on CPU: allowed 0.04 (a misplaced weight moves them by ~1)
    assert 0 < float((got - ref).abs().max()) <= 0.04 * scale, float((got - ref).abs().max())
    assert float((megatron - ref).abs().max()) <= 0.04 * scale, float((megatron - ref).abs().max())


# the cpu twin is in the slow tier: tests/test_mapping_deepseek.py runs the same load on CPU in the default suite
@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu", marks=pytest.mark.slow), DEVICES[1]])
def test_deepseek_v3_mapped_into_and_out_of_hf_on_the_device(device, tmp_path):
    """A Megatron DeepSeek-V3 layout (per layer: multi-latent attention, the first layer dense, experts, shared
    experts, the router's expert bias; DistributedOptimizer state; built by hand as tests/test_mapping_deepseek
    does) into a DeepseekV3ForCausalLM and AdamW on the device: every weight, the expert-bias buffer and every
    Adam moment equal the source's, the step is 2, the logits equal the source model's within fp32 rounding;
    and the device model's own bcp checkpoint maps back into Megatron's names, equal to the layout."""
    pytest.importorskip("transformers")
    import test_mapping_deepseek as ds
    src = ds.ds_model(ds.ds_config())
    opt = ds.trained(src)
    ds.megatron_checkpoint(tmp_path / "mg", src, opt)
    dst = ds.ds_model(ds.ds_config(), seed=1).to(device)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=1e-2)
    bcp.load(str(tmp_path / "mg"), {"model": dst, "optimizer": dst_opt},
             mapping=bcp.mapping.megatron_to_hf(dst.config))
    assert _devices(dst, dst_opt) == {device}
    want, got = _state_tensors(src, opt), _state_tensors(dst, dst_opt)
    assert not _differ(want, got), _differ(want, got)[:5]
    assert {float(s["step"]) for s in dst_opt.state.values()} == {2.0}
    ids = torch.randint(0, ds.VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref, out = src(input_ids=ids).logits, dst(input_ids=ids.to(device)).logits.cpu()
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    bcp.save(str(tmp_path / "hf"), {"model": dst, "optimizer": dst_opt}).wait()
    layout = ds.megatron_ds_layout({k: v.detach() for k, v in src.state_dict().items()}, ds.LAYERS)
    back = {k: torch.zeros_like(v) for k, v in layout.items()}
    bcp.load(str(tmp_path / "hf"), back, mapping=bcp.mapping.hf_to_megatron(dst.config, padded_vocab_size=ds.PADDED))
    for k, v in layout.items():
        n = ds.VOCAB if k.endswith(("word_embeddings.weight", "output_layer.weight")) else None
        assert torch.equal(back[k][:n], v[:n]), k


# ----------------------------------------------------------------------------- the GPU bench and its script

@pytest.mark.slow  # 10-15 s; the GPU check runs the bench itself
def test_gpu_bench_smoke_runs_on_cpu(tmp_path):
    """bench/gpu.py --device cpu with a tiny state: every figure and ratio is there and finite (no
    timing is asserted: this checks the bench's plumbing, bcp's and DCP's paths through it)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu.py"), "--device", "cpu", "--gib", "0.0005",
                           "--hidden", "128", "--steps", "6", "--every", "2", "--step-ms", "5", "--json", str(out),
                           "--dir", str(tmp_path / "ckpts")], capture_output=True, text=True, timeout=500, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    table = json.loads(out.read_text())
    assert table["config"]["device"] == "cpu" and not table["skipped"]
    [size] = table["sizes"].values()
    for system in ("bcp", "dcp"):
        s = size[system]
        assert "error" not in s, s
        for key in ("save_call_s", "durable_s", "first_ckpt_step_over_normal", "later_ckpt_step_over_normal",
                    "sync_save_gib_s", "load_cold_gib_s", "load_warm_gib_s", "pinned_peak_gib", "normal_step_s"):
            assert key in s, (system, key)
        assert s["loaded_exactly"] is True, system
    for name, value in size["ratios"].items():
        assert isinstance(value, float) and math.isfinite(value), (name, value)
    assert {"stall_first_bcp_over_dcp", "stall_later_bcp_over_dcp", "durable_later_bcp_over_dcp",
            "sync_save_speedup_vs_dcp", "load_cold_speedup_vs_dcp", "ckpt_step_bcp_over_dcp",
            "bcp_durable_later_over_disk_write_floor"} <= size["ratios"].keys()


@pytest.mark.slow  # 60-100 s here: four processes importing the frameworks; the GPU check runs the bench itself
def test_gpu_integrations_bench_smoke_runs_on_cpu(tmp_path):
    """bench/gpu_integrations.py --device cpu with a tiny state: each integration and the unprepared
    variant trains, checkpoints twice and reports its figures (no timing asserted: the plumbing)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_integrations.py"), "--device", "cpu",
                           "--gib", "0.001", "--hidden", "128", "--rows", "16", "--step-ms", "5", "--steps", "10",
                           "--first", "3", "--every", "4", "--json", str(out), "--dir", str(tmp_path / "ckpts")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    table = json.loads(out.read_text())
    assert set(table["runs"]) == {"hf", "accelerate", "lightning", "accelerate-unprepared"}
    for name, r in table["runs"].items():
        assert "error" not in r, (name, r)
        assert r["checkpoints_after_steps"] == [3, 7] and len(r["ckpt_step_over_normal"]) == 2, (name, r)
        assert r["steps_timed"] == 10 and all(math.isfinite(x) for x in r["ckpt_step_over_normal"]), (name, r)


def test_gpu_check_script_carries_a_supported_megatron():
    """bench/gpu_check.sh parses, and the megatron-core wheel it carries is one pyproject's extra allows."""
    from packaging.requirements import Requirement
    from packaging.version import Version
    for script in ("gpu_check.sh", "fetch_gpu_wheels.sh"):
        subprocess.run(["bash", "-n", os.path.join(REPO, "bench", script)], check=True)
    wheels = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu_check.sh"), "--print-wheels"], check=True,
                            capture_output=True, text=True).stdout.split()
    pins = dict(w.split("==") for w in wheels)
    assert {"megatron-core", "tenacity"} <= pins.keys()
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    [megatron] = [Requirement(r) for r in project["optional-dependencies"]["megatron"]]
    assert Version(pins["megatron-core"]) in megatron.specifier
    [tenacity] = [Requirement(r) for r in project["dependencies"] if r.startswith("tenacity")]
    assert Version(pins["tenacity"]) in tenacity.specifier
