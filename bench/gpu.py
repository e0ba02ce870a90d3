"""bcp vs PyTorch DCP on one GPU: save stall, time to durable, save and load throughput, the
checkpoint step of a training loop, peak pinned host memory.

    python bench/gpu.py [--gib 1,4,16] [--device cuda] [--systems bcp,dcp] [--dir DIR] [--json out.json]
                        [--step-ms 100] [--steps 16] [--every 5] [--budget-s SECONDS]

Each size runs in a fresh process of its own (one rank: a gloo group of one), the sizes one after
another, smallest first; with `--budget-s`, a size whose time, projected from the previous one,
would not fit in what is left is skipped (said in the output). The state: a residual stack of
`--hidden`-wide bf16 linear layers and its AdamW state (bf16 moments: 6 bytes per parameter),
GIB of parameters and optimizer state, on the device; the batch is calibrated so that a training
step (forward, backward, optimizer step) takes `--step-ms` of real device work. Per system, on
that same model:

- a training loop: every `--every` steps a checkpoint is asked for right after the optimizer step
  (where torchtitan, Lightning and HF's Trainer ask), asynchronously, once the previous one is
  durable (that wait and the removal of the previous checkpoint are timed apart). Reported: the
  save call (the stall), the time from the call until the checkpoint is durable (committed), and
  the checkpoint step: the call plus the next whole step, over a normal step; first save and later;
- a synchronous save of the state (GiB/s), then loads of it in place, cold (its files dropped from
  the page cache) and warm, each checked bit for bit against the state saved (`loaded_exactly`);
- peak pinned host memory: the bytes of the system's own pinned staging copies (bcp: its staging
  pool and the chunks it keeps for synchronous transfers; DCP: its stager's cached copies).

Systems:

- bcp: `bcp.save(async_save=True)` (lazy snapshot, the default): parameters and optimizer state are
  copied on a side stream into reused pinned buffers while the next forward and backward run; the
  next optimizer step waits for the copies (bcp's step pre-hook).
- dcp: `torch.distributed.checkpoint.async_save` as torchtitan's `async_with_pinned_mem` mode calls
  it: a reused `DefaultStager` (pinned memory on CUDA, shared memory, asynchronous staging,
  non-blocking copies), a checkpointing process (`AsyncCheckpointerType.PROCESS`) and a gloo group
  of its own; before the next optimizer step the loop waits for the staging, as torchtitan's
  `maybe_wait_for_staging` does. It saves `get_model_state_dict` / `get_optimizer_state_dict` and
  loads with `dcp.load`, then `set_model_state_dict` / `set_optimizer_state_dict`.
- bcp_prepared (opt-in): bcp after `bcp.prepare_save` (planned, pinned buffers allocated and touched
  before the loop, so the first save stalls like later ones).

Floors, each measured on up to 1 GiB and given as GiB/s and as the time the state's bytes would
take: device-to-host copies into pinned memory (any snapshot's floor), host-to-device copies, and
an fsync'd direct-I/O write and a direct-I/O read of the disk under `--dir`; on CUDA also pinned
host memory allocated per second, by bcp's staging and by torch's allocator (`pinning`).

Prints one JSON table: per size, each system's figures, the floors and the ratios (bcp over DCP,
and each over its floor), as bench/compare.py does. No assertion: this is a measurement.
`--device cpu` runs the same code on CPU tensors (the test suite's smoke run, tests/test_cuda.py).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

SYSTEMS = ("bcp", "dcp", "bcp_prepared")
WAIT_S = 300  # the longest wait for one save (a system that hangs fails, the others' figures stay)
BYTES_PER_PARAM = 6  # bf16 weight + AdamW's two bf16 moments
GIB = 1 << 30


# ----------------------------------------------------------------------------- the training state

class Trainer:
    """A residual stack of bf16 linear layers and its AdamW, one step at a time on `rows` rows."""

    def __init__(self, gib: float, hidden: int, device: str):
        self.device = device
        layers = max(1, round(gib * GIB / (BYTES_PER_PARAM * hidden * hidden)))
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False, device=device, dtype=torch.bfloat16)
                                     for _ in range(layers)])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.hidden, self.layers, self.x = hidden, layers, None

    def set_rows(self, rows: int) -> None:
        self.x = None  # the previous batch goes first (device memory)
        self.x = torch.randn(rows, self.hidden, generator=torch.Generator(self.device).manual_seed(1),
                             device=self.device, dtype=torch.bfloat16)

    def step(self, before_optimizer=None) -> None:
        h = self.x
        for layer in self.model:
            h = h + 0.1 * torch.relu(layer(h))  # residual, scaled: values stay in range at any depth
        h.float().square().mean().backward()
        if before_optimizer is not None:
            before_optimizer()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync(self.device)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state: weights, then each parameter's optimizer state (step included)."""
        out = [p.detach() for p in self.model.parameters()]
        for p in self.model.parameters():
            st = self.opt.state[p]  # by name: a load may put the state's keys in another order
            out += [st[k] for k in sorted(st) if torch.is_tensor(st[k])]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def calibrate(tr: Trainer, step_ms: float) -> tuple[int, float]:
    """Rows per step so that a step takes about `step_ms` (the device's real work); (rows, step s)."""
    cuda = tr.device == "cuda"
    quantum, lo, hi = (64, 64, 1 << 17) if cuda else (4, 4, 1 << 14)
    rows, step = (1024 if cuda else 16), 0.0
    for _ in range(4):
        try:
            tr.set_rows(rows)
            tr.step()
            step = min(timed(tr.step, tr.device) for _ in range(2))
        except torch.OutOfMemoryError:
            tr.opt.zero_grad(set_to_none=True)
            hi = rows // 2
            rows = max(lo, hi // quantum * quantum)
            torch.cuda.empty_cache()
            continue
        want = min(hi, max(lo, round(rows * step_ms / 1000 / step / quantum) * quantum))
        if abs(want - rows) <= max(quantum, rows // 10):
            break
        rows = want
    tr.set_rows(rows)
    return rows, step


def fingerprint(tr: Trainer) -> list[int]:
    """Position-weighted sums of every tensor's bits: equal before a save and after its load means
    the load put every byte back (a scrambled state in between makes the check able to fail)."""
    out = []
    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for t in tr.tensors():
        x = t.detach().reshape(-1).view(kinds[t.element_size()]).to(torch.int64)
        w = torch.arange(x.numel(), device=x.device, dtype=torch.int64) % 1021 + 1
        out.append(int((x * w).sum()))
    return out


def scramble(tr: Trainer) -> None:
    with torch.no_grad():
        for t in tr.tensors():
            t.fill_(3)


# ----------------------------------------------------------------------------- floors

def _aligned(nbytes: int) -> mmap.mmap:
    m = mmap.mmap(-1, -(-nbytes // 4096) * 4096)
    torch.frombuffer(m, dtype=torch.uint8).fill_(7)
    return m


def floors(tr: Trainer, root: str) -> dict:
    """Copy and disk bandwidths on up to 1 GiB, and the time the state's bytes would take at each."""
    state = tr.nbytes()
    n = min(GIB, state)
    cuda = tr.device == "cuda"
    dev = torch.empty(n, dtype=torch.uint8, device=tr.device).fill_(1)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    d2h = min(timed(lambda: host.copy_(dev, non_blocking=cuda), tr.device) for _ in range(3))
    h2d = min(timed(lambda: dev.copy_(host, non_blocking=cuda), tr.device) for _ in range(3))
    buf = _aligned(n)
    path = os.path.join(root, "floor.bin")
    direct = getattr(os, "O_DIRECT", 0)
    try:  # a file system without direct I/O (tmpfs) is measured through the page cache
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | direct, 0o644))
    except OSError:
        direct = 0

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
        try:
            os.pwrite(fd, buf, 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read():
        fd = os.open(path, os.O_RDONLY | direct)
        try:
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)

    writes = []
    for _ in range(2):  # new files each time, as checkpoints are
        if os.path.exists(path):
            os.remove(path)
        writes.append(timed(write, "cpu"))
    rd = min(timed(read, "cpu") for _ in range(2))
    os.remove(path)
    bw = {"d2h_gib_s": n / GIB / d2h, "h2d_gib_s": n / GIB / h2d, "disk_write_gib_s": n / GIB / min(writes),
          "disk_read_gib_s": n / GIB / rd, "direct_io": bool(direct)}
    if cuda:
        bw |= pinning(n)
    return bw | {"measured_gib": n / GIB, "d2h_state_s": state / GIB / bw["d2h_gib_s"],
                 "h2d_state_s": state / GIB / bw["h2d_gib_s"],
                 "disk_write_state_s": state / GIB / bw["disk_write_gib_s"],
                 "disk_read_state_s": state / GIB / bw["disk_read_gib_s"]}


def pinning(n: int) -> dict:
    """Pinned host memory allocated per second (requested bytes), in tensors of 86 MiB (not a
    power of two, as most of a model's are): torch's allocator (`pin_memory=True`, what a first
    save of DCP's stager allocates with) and bcp's staging buffers (bcp_core.host_memory); and
    the time of a fork (as of a DataLoader worker) while they are held."""
    from bcp_core.host_memory import pinned_empty
    piece = 86 << 20
    count = max(1, n // piece)
    out = {}
    for name, alloc in (("bcp", lambda: pinned_empty((piece,), torch.uint8, torch.device("cuda"))),
                        ("torch", lambda: torch.empty(piece, dtype=torch.uint8, pin_memory=True))):
        t = time.perf_counter()
        held = [alloc() for _ in range(count)]
        out[f"pin_alloc_{name}_gib_s"] = count * piece / GIB / (time.perf_counter() - t)
        assert all(h.is_pinned() for h in held), f"{name}: a buffer is not pinned"
        t = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        out[f"fork_with_pinned_{name}_s"] = time.perf_counter() - t
        os.waitpid(pid, 0)
        del held
    return out


def evict(path: str) -> None:
    """Drop the page-cache pages of every file under `path` (POSIX_FADV_DONTNEED)."""
    os.sync()
    for d, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ----------------------------------------------------------------------------- the systems

class Pending:
    """One asynchronous save in flight: when it was asked for, when it became durable."""

    def __init__(self, path: str, call_start: float):
        self.path, self.call_start = path, call_start
        self.call_s = 0.0
        self.done_at: float | None = None
        self.error: str | None = None
        self._done = threading.Event()

    def finished(self, error: BaseException | None = None) -> None:
        self.done_at = time.perf_counter()
        self.error = None if error is None else f"{type(error).__name__}: {error}"
        self._done.set()

    def wait(self) -> None:
        if not self._done.wait(WAIT_S):
            raise TimeoutError(f"the save to {self.path} did not end within {WAIT_S} s")

    @property
    def durable_s(self) -> float | None:
        return None if self.error or self.done_at is None else self.done_at - self.call_start


class Bcp:
    name = "bcp"

    def __init__(self, tr: Trainer, root: str, prepared: bool):
        import bcp_core as bcp
        self.bcp, self.tr, self.root = bcp, tr, root
        self.role = "gpu-bench-prepared" if prepared else "gpu-bench"
        self.state = {"model": tr.model, "optimizer": tr.opt}
        self.prepare_s = None
        if prepared:
            t = time.perf_counter()
            bcp.prepare_save(self.state, role=self.role).result()
            self.prepare_s = time.perf_counter() - t

    def start(self, k: int) -> Pending:
        pending = Pending(os.path.join(self.root, "loop", f"step_{k:08d}"), time.perf_counter())
        handle = self.bcp.save(os.path.join(self.root, "loop"), self.state, step=k, async_save=True, role=self.role)
        pending.call_s = time.perf_counter() - pending.call_start

        def watch():
            try:
                handle.wait()
                pending.finished()
            except Exception as e:  # noqa: BLE001 - reported in the table
                pending.finished(e)
        threading.Thread(target=watch, daemon=True).start()
        return pending

    before_optimizer = None  # bcp's own step pre-hook holds the step until the copies are made

    def pinned_bytes(self) -> int:
        """The staging pool's pinned buffers and the chunks kept for synchronous transfers."""
        from bcp_core import host_memory
        from bcp_core.checkpointer import get_checkpointer
        pool = get_checkpointer(self.role).snapshots.pool
        slots = list(pool._slots)  # every slot, whatever layout it was made for
        chunks = [c for free in host_memory._BOUNCES._free.values() for b in free for c in b._bufs]
        return sum(b.nbytes for slot in slots for b in slot if b.is_pinned()) + \
            sum(c.nbytes for c in chunks if c.is_pinned())

    def save_sync(self, path: str) -> None:
        self.bcp.save(path, self.state, role=self.role).wait()

    def load(self, path: str, num_threads: int | None = None) -> None:
        self.bcp.load(path, self.state, num_threads=num_threads)


def stager_reuse_broken(version: str | None = None) -> bool:
    """Whether this torch's `DefaultStager` fails when reused (pytorch#183413: seen on 2.11.0, fixed
    after 2.11; `DefaultStager` exists since 2.9)."""
    major, minor = (int(x) for x in (version or torch.__version__).split("+")[0].split(".")[:2])
    return (2, 9) <= (major, minor) < (2, 12)


class Dcp:
    name = "dcp"

    def __init__(self, tr: Trainer, root: str):
        import torch.distributed.checkpoint as dcp
        self.dcp, self.tr, self.root = dcp, tr, root
        self.group = dist.new_group(backend="gloo")  # as torchtitan: the checkpoint's collectives apart
        # torch 2.11's DefaultStager fails the second save it stages (`KeyError: <class 'type'>` in the
        # checkpointing process, pytorch#183413, fixed after 2.11): there, as torchtitan does, a new
        # stager per save (its pinned copies are allocated again each time)
        self.reuse, self.errors, self.config = not stager_reuse_broken(), [], {}
        self.stager = self._new_stager()
        self.config["stager_per_save"] = not self.reuse
        self.staging = None  # the last save's staging, waited for before the next optimizer step

    def _new_stager(self):
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:  # torch < 2.9: async_save's own staging
            self.config.update(stager=None)
            return None
        cuda = self.tr.device == "cuda"
        # torchtitan's async_with_pinned_mem: StagingOptions(True, True, True, True); pinned memory and
        # non-blocking copies exist only with an accelerator
        options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
                                 use_non_blocking_copy=cuda)
        self.config.update(stager="DefaultStager",
                           options=vars(options) if hasattr(options, "__dict__") else str(options))
        return DefaultStager(options)

    def _state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        return {"model": get_model_state_dict(self.tr.model),
                "optim": get_optimizer_state_dict(self.tr.model, self.tr.opt)}

    def start(self, k: int) -> Pending:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        path = os.path.join(self.root, "loop", f"step_{k:08d}")
        pending = Pending(path, time.perf_counter())
        if not self.reuse and k > 0:  # a stager per save (stager_reuse_broken), the first made in __init__
            if self.stager is not None:
                self.stager.close()  # the previous save is durable: the loop waited for it
            self.stager = self._new_stager()
        kwargs = {"async_stager": self.stager} if self.stager is not None else {}
        resp = self.dcp.async_save(self._state_dict(), checkpoint_id=path, process_group=self.group,
                                   async_checkpointer_type=AsyncCheckpointerType.PROCESS, **kwargs)
        pending.call_s = time.perf_counter() - pending.call_start
        self.staging = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)
        upload.add_done_callback(lambda f: pending.finished(f.exception()))
        return pending

    def before_optimizer(self) -> None:
        if self.staging is not None:
            staging, self.staging = self.staging, None
            try:
                staging.result(WAIT_S)
            except Exception as e:  # noqa: BLE001 - reported; later saves get a stager each
                self.errors.append(f"staging: {type(e).__name__}: {e}")
                self.reuse = False
                self.config["stager_per_save"] = True

    def pinned_bytes(self) -> int:
        stager = getattr(self.stager, "_state_dict_stager", None)
        cached = getattr(stager, "_cached_storage_mapping", None)
        if cached is None:
            return 0
        try:
            return sum(s.nbytes() for s in list(cached.values()) if s.is_pinned())
        except RuntimeError:  # the staging thread changed the cache meanwhile: seen at the next call
            return 0

    def save_sync(self, path: str) -> None:
        self.dcp.save(self._state_dict(), checkpoint_id=path, process_group=self.group)

    def load(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
        sd = self._state_dict()
        self.dcp.load(sd, checkpoint_id=path, process_group=self.group)
        set_model_state_dict(self.tr.model, sd["model"])
        set_optimizer_state_dict(self.tr.model, self.tr.opt, sd["optim"])

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def run_system(system, tr: Trainer, steps: int, every: int) -> dict:
    """The training loop with checkpoints, then a synchronous save and loads of it."""
    times, saves, waits, after = [], [], [], []
    pinned = 0
    pending: Pending | None = None
    for s in range(steps):
        t = time.perf_counter()
        tr.step(system.before_optimizer)
        times.append(time.perf_counter() - t)
        pinned = max(pinned, system.pinned_bytes())
        if (s + 1) % every == 0 and s + 1 < steps:  # a checkpoint after this step; the next step is timed
            t = time.perf_counter()
            if pending is not None:
                pending.wait()  # at most one in flight; its checkpoint then goes (disk space)
                shutil.rmtree(pending.path, ignore_errors=True)
            waits.append(time.perf_counter() - t)
            pending = system.start(len(saves))
            saves.append(pending)
            after.append(s + 1)
    pending.wait()
    pinned = max(pinned, system.pinned_bytes())
    shutil.rmtree(os.path.join(system.root, "loop"), ignore_errors=True)
    normal = [t for s, t in enumerate(times) if s >= 1 and s not in after]
    step = sum(normal) / len(normal)
    ckpt = [p.call_s + times[s] for p, s in zip(saves, after)]
    out = {"normal_step_s": step, "save_call_s": [p.call_s for p in saves], "durable_s": [p.durable_s for p in saves],
           "wait_previous_s": waits, "ckpt_step_s": ckpt, "first_ckpt_step_s": ckpt[0],
           "later_ckpt_step_s": sum(ckpt[1:]) / max(1, len(ckpt) - 1),
           "save_errors": [p.error for p in saves if p.error]}
    out["first_ckpt_step_over_normal"] = out["first_ckpt_step_s"] / step
    out["later_ckpt_step_over_normal"] = out["later_ckpt_step_s"] / step
    gib = tr.nbytes() / GIB

    want = fingerprint(tr)
    path = os.path.join(system.root, "sync")
    out["sync_save_s"] = timed(lambda: system.save_sync(path), tr.device)
    out["sync_save_gib_s"] = gib / out["sync_save_s"]
    pinned = max(pinned, system.pinned_bytes())
    exact = True
    for kind in ("cold", "warm"):
        scramble(tr)
        if kind == "cold":
            evict(path)
        out[f"load_{kind}_s"] = timed(lambda: system.load(path), tr.device)
        out[f"load_{kind}_gib_s"] = gib / out[f"load_{kind}_s"]
        exact &= fingerprint(tr) == want
    if isinstance(system, Bcp):  # the warm load's threads: bcp's default (its share of the cores), 4, 8 and 16
        from bcp_core.utils import load_threads
        out["load_threads"] = load_threads()
        for n in sorted({4, 8, 16} - {load_threads()}):
            scramble(tr)
            out[f"load_warm_{n}_threads_gib_s"] = gib / timed(lambda n=n: system.load(path, n), tr.device)
            exact &= fingerprint(tr) == want
    out["loaded_exactly"] = exact
    shutil.rmtree(path, ignore_errors=True)
    out["pinned_peak_gib"] = pinned / GIB
    out["process_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if getattr(system, "errors", None):
        out["errors"] = system.errors
    if getattr(system, "prepare_s", None) is not None:
        out["prepare_s"] = system.prepare_s
    if getattr(system, "config", None):
        out["config"] = system.config
    return out


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def ratios(table: dict) -> dict:
    out = {}
    fl = table["floors"]
    ok = {name: r for name in SYSTEMS if isinstance(r := table.get(name), dict) and "error" not in r}
    for name, r in ok.items():
        out[f"{name}_durable_later_over_disk_write_floor"] = _mean(r["durable_s"][1:]) / fl["disk_write_state_s"]
        out[f"{name}_sync_save_over_disk_write_floor"] = r["sync_save_s"] / fl["disk_write_state_s"]
        out[f"{name}_load_cold_over_disk_read_floor"] = r["load_cold_s"] / fl["disk_read_state_s"]
        out[f"{name}_load_warm_over_h2d_floor"] = r["load_warm_s"] / fl["h2d_state_s"]
    b, d = ok.get("bcp"), ok.get("dcp")
    if b is not None and d is not None:
        out |= {"stall_first_bcp_over_dcp": b["save_call_s"][0] / d["save_call_s"][0],
                "stall_later_bcp_over_dcp": _mean(b["save_call_s"][1:]) / _mean(d["save_call_s"][1:]),
                "durable_first_bcp_over_dcp": _ratio(b["durable_s"][0], d["durable_s"][0]),
                "durable_later_bcp_over_dcp": _mean(b["durable_s"][1:]) / _mean(d["durable_s"][1:]),
                "first_ckpt_step_bcp_over_dcp": b["first_ckpt_step_s"] / d["first_ckpt_step_s"],
                "ckpt_step_bcp_over_dcp": b["later_ckpt_step_s"] / d["later_ckpt_step_s"],
                "sync_save_speedup_vs_dcp": d["sync_save_s"] / b["sync_save_s"],
                "load_cold_speedup_vs_dcp": d["load_cold_s"] / b["load_cold_s"],
                "load_warm_speedup_vs_dcp": d["load_warm_s"] / b["load_warm_s"]}
        if d["pinned_peak_gib"] > 0:
            out["pinned_peak_bcp_over_dcp"] = b["pinned_peak_gib"] / d["pinned_peak_gib"]
    return {k: v for k, v in out.items() if v is not None and math.isfinite(v)}


def _ratio(a, b):
    return a / b if a is not None and b else None


# ----------------------------------------------------------------------------- one size, in its own process

def fits(gib: float, device: str, root: str) -> str | None:
    """Why a state of `gib` cannot run here, or None: device memory (state, gradients, activations),
    host memory (two systems' pinned copies beside the page cache), disk (one checkpoint)."""
    need = gib * GIB
    free_disk = shutil.disk_usage(root).free
    if free_disk < 1.2 * need + GIB:
        return f"{free_disk / GIB:.1f} GiB free under {root}, a checkpoint takes {need / GIB:.1f}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if host < 3 * need + 8 * GIB:
        return f"{host / GIB:.0f} GiB of host memory, pinned copies of two systems and the page cache need more"
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if free < need * 8 / 6 + 6 * GIB:  # weights + gradients + two moments, and room for activations
            return f"{free / GIB:.1f} GiB free on the GPU, the state and its gradients take {need * 8 / 6 / GIB:.1f}"
    return None


def worker(a: dict, out: str) -> dict:
    """One size; the table so far is written to `out` after each system (a worker stopped at its
    time limit leaves the systems it finished)."""
    t0 = time.perf_counter()
    device = a["device"]
    if device == "cuda":
        torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    root = tempfile.mkdtemp(prefix=f"gib{a['gib']}_", dir=a["dir"])
    why = fits(a["gib"], device, root)
    if why is not None:
        return {"skipped": why}
    tr = Trainer(a["gib"], a["hidden"], device)
    rows, step = calibrate(tr, a["step_ms"])
    table: dict = {"device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   "state_gib": tr.nbytes() / GIB, "tensors": len(tr.tensors()), "layers": tr.layers,
                   "hidden": tr.hidden, "rows": rows, "calibrated_step_s": step}
    table["floors"] = floors(tr, root)
    table["setup_s"] = time.perf_counter() - t0
    for name in a["systems"]:
        sub = os.path.join(root, name)
        os.makedirs(sub)
        system = Dcp(tr, sub) if name == "dcp" else Bcp(tr, sub, prepared=name == "bcp_prepared")
        try:
            table[name] = run_system(system, tr, a["steps"], a["every"])
        except Exception as e:  # noqa: BLE001 - one system's failure leaves the others' figures
            import traceback
            table[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        finally:
            if isinstance(system, Dcp):
                system.close()
            shutil.rmtree(sub, ignore_errors=True)
        with open(out, "w") as f:
            json.dump(table | {"ratios": ratios(table), "incomplete": f"the worker ended after {name}"}, f)
    table["ratios"] = ratios(table)
    if device == "cuda":
        table["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    shutil.rmtree(root, ignore_errors=True)
    return table


def run_size(a: dict, timeout: float | None) -> dict:
    """`worker(a)` in a fresh process (and session: DCP's checkpointing process goes with it)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(a), out, str(os.getpid())]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # a worker over its time, or what it left running
    except ProcessLookupError:
        pass
    proc.wait()
    try:
        with open(out) as f:
            text = f.read()
        return json.loads(text) if text else {"failed": f"the worker ended with status {rc}, no table"}
    finally:
        os.remove(out)
        if rc is None:
            print(f"bench: {a['gib']} GiB stopped at its time limit of {timeout:.0f} s", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", default="1,4,16", help="comma-separated state sizes in GiB (default 1,4,16)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--systems", default="bcp,dcp", help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--hidden", type=int, default=4096, help="layer width (default 4096)")
    ap.add_argument("--step-ms", type=float, default=100.0, help="training step to calibrate to (default 100 ms)")
    ap.add_argument("--steps", type=int, default=16, help="training steps per system (default 16)")
    ap.add_argument("--every", type=int, default=5, help="a checkpoint every this many steps (default 5)")
    ap.add_argument("--budget-s", type=float, default=0, help="skip sizes that would end after this (0: none)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir, removed after)")
    ap.add_argument("--json", default=None, help="also write the table to this file")
    args = ap.parse_args()
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        raise SystemExit(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu for the smoke run)")
    if args.every < 1 or args.steps < 2 * args.every + 2:
        raise SystemExit("--steps must leave room for two checkpoints and the steps after them (>= 2 * every + 2)")
    root = args.dir or tempfile.mkdtemp(prefix="bcp_gpu_bench_")
    os.makedirs(root, exist_ok=True)
    start = time.perf_counter()
    table: dict = {"config": {k: v for k, v in vars(args).items() if k != "json"} | {
        "torch": torch.__version__, "device_name": None, "cpus": os.cpu_count()}, "sizes": {}, "skipped": []}
    last: tuple[float, dict, float] | None = None  # (gib, table, seconds) of the last size run
    try:
        for gib in sorted(float(g) for g in args.gib.split(",")):
            left = args.budget_s - (time.perf_counter() - start) if args.budget_s else None
            if left is not None and last is not None:
                g0, t0, s0 = last
                setup = t0.get("setup_s", 0.0)
                projected = setup + (s0 - setup) * gib / g0
                if projected > left:
                    table["skipped"].append({"gib": gib, "why": f"projected {projected:.0f} s, {left:.0f} s left"})
                    continue
            a = vars(args) | {"gib": gib, "systems": systems, "dir": root}
            t = time.perf_counter()
            result = run_size(a, left)
            if "skipped" in result or "failed" in result:
                table["skipped"].append({"gib": gib, "why": result.get("skipped") or result["failed"]})
                continue
            table["sizes"][f"{gib:g}"] = result
            table["config"]["device_name"] = result["device_name"]
            last = (gib, result, time.perf_counter() - t)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    table["total_s"] = time.perf_counter() - start
    text = json.dumps(table, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


def _end_with_parent(parent: int) -> None:
    """A worker ends with the bench that started it (killed at a timeout, it must not run on alone)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it was gone already
        os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":  # one size (run_size)
        _end_with_parent(int(sys.argv[4]))
        result = worker(json.loads(sys.argv[2]), sys.argv[3])
        with open(sys.argv[3], "w") as f:
            json.dump(result, f)
        sys.exit(0)
    sys.exit(main())
